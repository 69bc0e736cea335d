"""`crossover bench tuner`'s flags and the TunerBenchConfig they make (bench/tuner.py)."""

from __future__ import annotations

import argparse
from typing import Any

from cli.commands.bench_flags import add_engine, add_policies
from daemon.user_error import UserError


def add_tuner(t: argparse.ArgumentParser) -> None:
    add = t.add_argument
    add("--out", default="bench-out/tuner.json", help="JSON output file (the PNG plot goes next to it)")
    add("--quick", action="store_true",
        help="a short run to check a tuner change: "
             f"{', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, (_, v) in QUICK.items())} "
             "unless given (the full run stays the reference)")
    add("--phase-seconds", type=float, default=60.0, help="length of each of the trace's three phases")
    add("--rate-scale", type=float, default=1.0, help="factor on the trace's arrival rates")
    add("--low-rate", type=float, default=0.5, help="arrivals/s of the low-load phases (before the scale)")
    add("--high-rate", type=float, default=2.0, help="arrivals/s of the high-load phase (before the scale)")
    add("--low-max-concurrency", type=int, default=2,
        help="most requests in flight in a low-load phase (0: no cap)")
    add("--mid-mixed", action="store_true",
        help="add a fourth phase: every tenant at moderate load (batches of about 4-8), where "
             "per-tenant rules are compared with the best single-depth policy")
    add("--mid-rate", type=float, default=2.0, help="arrivals/s of the mid-mixed phase (before the scale)")
    add("--mid-max-concurrency", type=int, default=8, help="most requests in flight in the mid-mixed phase")
    add("--max-tokens", type=int, default=None, help="cap on each request's max_tokens (default: its kind's)")
    add("--ignore-eos", action="store_true", help="every request decodes exactly max_tokens tokens")
    add("--seed", type=int, default=0, help="seed of the trace")
    add("--temperatures", default="chat:0.8,prose:0.8",
        help="KIND:TEMPERATURE,... sampling of each kind's requests, seeded per request (unlisted "
             "kinds: greedy; 'none': all greedy)")
    add("--no-drain", action="store_true",
        help="replay the phases back to back (default: each starts once the last one's requests finished)")
    add("--runs", default="autotuned,never,fixed,table",
        help="policies to run (comma-separated): autotuned, never, fixed, table, tenants (a fixed "
             "per-tenant policy), single-rule (the tuner with per-tenant rules off)")
    add_policies(add, techniques="proposers loaded: the autotuned run's choices, and the fixed policies' "
                                 "techniques unless --fixed-techniques says", depths="2,4,8",
                 depths_help="depths of the fixed policies",
                 pool_split_help="pool split of static model-based policies")
    add("--fixed-techniques", default=None,
        help="techniques of the fixed policies (default: every loaded one; --quick: the table's)")
    add("--table", default="4:4,8:2",
        help="batch-size table BATCH:DEPTH,... (larger batches do not speculate)")
    add("--table-technique", default="ngram", help="technique of the batch-size table")
    add("--tenant-policy", default="*=ngram@2,copy-tenant=ngram@4,code-tenant=ngram@4,prose-tenant=none",
        help="the 'tenants' run (--runs ...,tenants): TENANT=TECHNIQUE@DEPTH or TENANT=none, "
             "comma-separated, '*' for every other tenant's rows")
    add("--retune-interval", type=float, default=None, help="seconds between retunes (default: phase/6)")
    add("--fit-window", type=float, default=None, help="tuner's telemetry window in s (default: a phase)")
    add("--traffic-window", type=float, default=None,
        help="recent traffic a retune optimizes for, in s (default: a third of a phase)")
    add("--validation-seconds", type=float, default=None,
        help="longest validation (default: half the retune interval)")
    add("--trials", type=int, default=48,
        help="Optuna trials per TPE search (an exact solve tells at most two)")
    add("--min-new-steps", type=int, default=10,
        help="steps a scheduled retune needs (the daemon's 500 per 10 min, time-compressed)")
    add("--profile-steps", type=int, default=100, help="startup profile decisions")
    add("--validation-min-steps", type=int, default=60, help="validation ends with this many steps")
    add("--search-in-thread", action="store_true", help="search in a thread, not a spawned process")
    add("--probe-retunes", type=int, default=12, help="retunes measured for inter-token latency (0: none)")
    add("--repeats", type=int, default=1,
        help="rounds of the trace, every policy once per round in a rotated order; each policy's "
             "figures are its median round's")
    add("--probe-concurrency", type=int, default=4, help="closed-loop clients during the probe")
    add("--probe-quiet", type=float, default=None,
        help="quiet seconds between probe retunes (default: phase/4)")
    add_engine(add, heads=True, sized=True)
    add("--keep-db", default=None, help="keep each run's telemetry database in this directory")
    add("--fake-time-scale", type=float, default=1.0, help="fake engine: real s per simulated s of step time")
    add("--trace", default="shifting",
        help="shifting (the default three phases), or pool-split traces memory-bound,light "
             "(comma-separated): fixed --splits against the tuner's split (bench/split_bench.py; arrivals/s: "
             "--high-rate memory-bound, --low-rate light)")
    add("--splits", default="0,0.125,0.25,0.5", help="--trace memory-bound|light: the fixed pool splits")
    add("--split-technique", default="draft",
        help="--trace memory-bound|light: technique of the fixed splits")
    add("--split-depth", type=int, default=2, help="--trace memory-bound|light: depth of the fixed splits")
    add("--split-repeats", type=int, default=1,
        help="--trace memory-bound|light: rounds of every fixed split and the tuned policy, in turn; "
             "each policy's goodput is its median over the rounds")
    add("--kv-budget", default=None, help="KV pool size of the engine, e.g. 96MiB (default: the backend's)")
    # None marks a --quick flag not given, so that one given at its default value still wins
    t.set_defaults(**dict.fromkeys(QUICK))


QUICK: dict[str, tuple[Any, Any]] = {"phase_seconds": (60.0, 15.0), "depths": ("2,4,8", "2"),
                                     "probe_retunes": (12, 3)}
"""`bench tuner --quick`: flag -> (its default, the quick value); a flag given explicitly wins.
It also runs the fixed policies of the table's technique only (--fixed-techniques)."""


def _tenant_choice(text: str) -> tuple[str, str, int]:
    """"copy-tenant=ngram@4" -> ("copy-tenant", "ngram", 4); "prose-tenant=none" -> (..., "none", 0)."""
    name, sep, choice = text.partition("=")
    technique, _, depth = choice.partition("@")
    if not sep or not name.strip() or not technique.strip() or (technique.strip() != "none") != bool(depth):
        raise ValueError(f"--tenant-policy entry {text!r} must be TENANT=TECHNIQUE@DEPTH or TENANT=none")
    return name.strip(), technique.strip(), int(depth) if depth else 0


def tuner_config(args: argparse.Namespace) -> Any:
    """The bench tuner config from flags; UserError naming what is wrong."""
    from bench.tuner_config import TunerBenchConfig
    from cli.commands.plan import parse_size
    from engine.policy import TECHNIQUES

    for name, (default, quick) in QUICK.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else default)
    if args.quick and args.fixed_techniques is None:  # every technique stays loaded for the autotuned run
        args.fixed_techniques = args.table_technique

    def items(text: str | None) -> tuple[str, ...]:
        return tuple(x.strip() for x in (text or "").split(",") if x.strip())

    known = tuple(t for t in TECHNIQUES if t != "none")  # refused now, not after the model loads
    for flag, given in (("--techniques", args.techniques), ("--fixed-techniques", args.fixed_techniques),
                        ("--table-technique", args.table_technique)):
        unknown = [t for t in items(given) if t not in known]
        if unknown:
            raise UserError(f"bench tuner: {flag}: unknown technique {unknown[0]!r} "
                            f"(known: {', '.join(known)})")
    try:
        depths = tuple(int(d) for d in items(args.depths))
        table = tuple((int(b), int(d)) for b, d in (x.split(":") for x in items(args.table)))
        tenants = tuple(_tenant_choice(x) for x in items(args.tenant_policy))
        temps = () if args.temperatures == "none" else tuple(
            _kind_value("--temperatures", x) for x in items(args.temperatures))
        return TunerBenchConfig(
            phase_s=args.phase_seconds, rate_scale=args.rate_scale, low_rate=args.low_rate,
            high_rate=args.high_rate, low_max_concurrency=args.low_max_concurrency or None,
            mid_phase=args.mid_mixed, mid_rate=args.mid_rate, mid_max_concurrency=args.mid_max_concurrency,
            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, seed=args.seed, drain=not args.no_drain,
            temperatures=temps,
            techniques=items(args.techniques), fixed_techniques=items(args.fixed_techniques),
            depths=depths, table=table,
            table_technique=args.table_technique, pool_split=args.pool_split, runs=items(args.runs),
            tenant_policy=tenants,
            retune_interval_s=args.retune_interval, fit_window_s=args.fit_window,
            traffic_window_s=args.traffic_window,
            validation_s=args.validation_seconds, trials=args.trials,
            min_new_steps=args.min_new_steps, profile_steps=args.profile_steps,
            validation_min_steps=args.validation_min_steps, search_process=not args.search_in_thread,
            probe_retunes=args.probe_retunes, probe_concurrency=args.probe_concurrency,
            probe_quiet_s=args.probe_quiet, model=args.model, heads=args.heads, dtype=args.dtype,
            max_batch=args.max_batch, max_context=1024 if args.max_context is None else args.max_context,
            keep_db=args.keep_db,
            fake=args.fake, fake_time_scale=args.fake_time_scale,
            traces=() if args.trace == "shifting" else items(args.trace),
            splits=tuple(float(x) for x in items(args.splits)), split_technique=args.split_technique,
            split_depth=args.split_depth, split_repeats=args.split_repeats, repeats=args.repeats,
            kv_budget=None if args.kv_budget is None else parse_size("--kv-budget", args.kv_budget))
    except ValueError as exc:
        raise UserError(f"bench tuner: {exc}") from None


def _kind_value(flag: str, item: str) -> tuple[str, float]:
    """"chat:0.8" -> ("chat", 0.8); UserError naming the item otherwise."""
    kind, _, value = item.partition(":")
    try:
        return kind.strip(), float(value)
    except ValueError:
        raise UserError(f"{flag}: {item!r} is not KIND:NUMBER") from None
