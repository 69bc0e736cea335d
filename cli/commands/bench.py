"""`crossover bench KIND`: measure, print progress, write JSON. KIND: engine|telemetry|serve|crossover|tuner|
tuner-compare|early-exit|findings|soak|structured|lm-eval."""

from __future__ import annotations

import argparse
from typing import Any

from cli.commands.bench_flags import add_engine, add_policies
from cli.commands.bench_tuner import add_tuner, tuner_config
from daemon.user_error import UserError
from engine.config import WEIGHT_FORMS


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="WHAT")
    sub.required = True
    e = sub.add_parser("engine", help="decode/prefill throughput vs the memory roofline")
    e.add_argument("--out", default="bench-out/engine.json", help="JSON output file")
    e.add_argument("--model", default=None, help="a .gguf file or a HF Gemma 3 directory")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    e.add_argument("--weights", default=None, choices=WEIGHT_FORMS,
                   help="weights as served (gguf: the file's own quantized blocks; default: --dtype's; "
                        "without --dtype, gguf for a GGUF model on the CPU)")
    e.add_argument("--batches", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    e.add_argument("--new-tokens", type=int, default=32, help="tokens decoded per request")
    e.add_argument("--contexts", default="32,2048",
                   help="comma-separated prompt lengths decoded at; the first one's rates are `decode`")
    e.add_argument("--max-context", type=int, default=4096, help="the engine's max context (serve's default)")
    e.add_argument("--kv-gib", type=float, default=None,
                   help="KV pool budget in GiB (default: serve's); batch 64 at context 2048 needs ~3")
    e.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model and KV pool over N devices (default 1)")
    e.add_argument("--hf-baseline", default="bench/results/hf_baseline.json",
                   help="JSON from bench/hf_baseline.py to compare with (skipped if missing)")
    t = sub.add_parser("telemetry", help="recorder throughput and caller-side cost")
    t.add_argument("--out", default="bench-out/telemetry.json", help="JSON output file")
    t.add_argument("--seconds", type=float, default=5.0, help="duration of each phase")
    t.add_argument("--db", default=None, help="SQLAlchemy URL (default: a temporary SQLite file)")
    from bench.lm_eval_check import add_flags as add_lm_eval_flags

    for name, add_flags, what in (
        ("serve", _add_serve, "HTTP load test: throughput, TTFT/TPOT percentiles, overhead over the "
                              "bare engine"),
        ("crossover", _add_crossover, "goodput of each speculative technique and depth vs batch size, "
                                      "acceptance per position, crossover batch; JSON + PNG"),
        ("tuner", add_tuner, "the autotuned daemon vs static policies on a shifting trace: goodput per "
                             "phase, ratios, ITL during retunes; JSON + PNG"),
        ("early-exit", _add_early_exit, "LOSSY opt-in experiment: early exit with a compacting batch; "
                                        "tokens/s vs batch and threshold, agreement, perplexity; JSON"),
        ("findings", _add_findings, "measure the four open questions into one telemetry database, then "
                                    "write the findings report (README + PNGs)"),
        ("soak", _add_soak, "a `crossover serve` child under well-formed and hostile traffic (loopback), "
                            "then an audit: health, KV pages, telemetry rows, RSS and descriptors, TTFT "
                            "beside a baseline; JSON"),
        ("structured", _add_structured, "constrained decoding (20 JSON schemas x 5 prompts) against free "
                                        "decoding on one daemon: TPOT ratio, validity, grammar time per "
                                        "step; JSON"),
        ("lm-eval", add_lm_eval_flags, "lm-eval's local-completions scores a 60-item multiple-choice task "
                                       "against the daemon; its accuracy against the engine's own "
                                       "loglikelihoods; JSON"),
    ):
        add_flags(sub.add_parser(name, help=what))
    c = sub.add_parser("tuner-compare", help="do two `bench tuner` JSONs (e.g. --quick against the full "
                                              "run) read the same ratios within their round-to-round noise")
    c.add_argument("a", help="a `bench tuner` result JSON (e.g. a --quick run)")
    c.add_argument("b", help="the run to compare it with (e.g. the full run of record, "
                             "bench/results/tuner/full-repeats3-search-one-cpu.json)")
    c.add_argument("--out", default=None, help="write the comparison as JSON here too")


def _add_serve(s: argparse.ArgumentParser) -> None:
    add = s.add_argument
    add("--out", default="bench-out/serve.json", help="JSON output file")
    add("--concurrency", type=int, default=8,
        help="closed loop: clients, each sending its next request when the last one finished")
    add("--rate", type=float, default=None,
        help="open loop instead: Poisson arrivals, requests per second")
    add("--requests", type=int, default=64, help="requests to send")
    add("--seconds", type=float, default=None, help="stop sending after this many seconds")
    add("--max-tokens", type=int, default=64, help="output tokens per request (EOS is ignored)")
    add("--mix", default="copy=1,code=1,chat=1,prose=1",
        help="prompt kinds and weights (bench.workloads: copy, code, chat, prose)")
    add("--seed", type=int, default=0, help="seed of the prompt draw and the arrivals")
    add("--rounds", type=int, default=1,
        help="run the HTTP and engine-only phases this many times, alternating; each reports "
             "its fastest round (for a machine other processes share)")
    add_engine(add, heads=False, sized=True)
    add("--fake-step-ms", type=float, default=10.0, help="the fake engine's time per step")
    add("--no-prefix-cache", action="store_true",
        help="the engine started here does not share prompt-prefix KV pages (compare with --shared-prefix)")
    add("--no-speculation", action="store_true",
        help="the engine started here decodes plainly (default: n-gram loaded, the starter policy served)")
    add("--url", default=None,
        help="bench the daemon at this URL instead of one started here (no engine-only run)")
    add("--api-key", default=None, help="bearer key for --url (default: $CROSSOVER_API_KEY)")
    add("--admin-token", default=None,
        help="--url's admin token (default: $CROSSOVER_ADMIN_TOKEN): the daemon's prefix cache is "
             "emptied (POST /admin/reset_prefix_cache) before each HTTP round and the idle-TTFT "
             "phase; without it the daemon keeps its cache and the idle TTFT may come out low")
    add("--db", default=None,
        help="telemetry database of the daemon started here (default: a temporary SQLite file)")
    add("--no-db", action="store_true", help="start the daemon without a telemetry database")
    add("--shared-prefix", action="store_true",
        help="instead of --mix: 4 tenants, each with its own system prompt of --prefix-tokens "
             "tokens, questions differing after it; each tenant sends with its own API key "
             "(default --max-context 2048)")
    add("--prefix-tokens", type=int, default=1000, help="--shared-prefix: system prompt tokens")
    add("--engine-rates", default=None, metavar="FILE",
        help="a `crossover bench engine` JSON whose prefill/decode rates bound the efficiency "
             "(default: measured on the engine started here; with --url, none: no ratio)")
    add("--tenant-keys", default=None, metavar="FILE",
        help="with --url and --shared-prefix: JSON {tenant: API key} the tenants send with")
    add("--no-idle-ttft", action="store_true",
        help="skip sending each request again alone to compare its TTFT with an idle daemon's")
    add("--structured", action="store_true",
        help="the structured-output workload instead: `crossover bench structured` with --url, "
             "--admin-token, --concurrency, --rounds and --out (JSON schemas against free decoding, same "
             "daemon)")


def _add_crossover(c: argparse.ArgumentParser) -> None:
    add = c.add_argument
    add("--out", default="bench-out/crossover.json", help="JSON output file (the PNG plot goes next to it)")
    add_policies(add, techniques="comma-separated proposers", depths="1,2,4,8",
                  depths_help="comma-separated draft depths (1-8)",
                  pool_split_help="share of the KV pool lent to speculation in every run "
                                  "(the draft model needs > 0)")
    add("--batches", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    add("--kinds", default="copy,code,chat,prose", help="comma-separated workload kinds")
    add("--new-tokens", type=int, default=64, help="tokens each request decodes once all are decoding")
    add("--prompt-tokens", type=int, default=256, help="longest prompt (longer ones keep their last tokens)")
    add("--draft-vocab", type=int, default=None, help="MTP draft vocabulary (default: its smallest)")
    add("--seed", type=int, default=0, help="seed of the prompt draw")
    add("--temperature", type=float, default=0.0,
        help="sampling temperature of every request (0: greedy; each request seeded)")
    add("--prompt-sets", type=int, default=1,
        help="disjoint prompt sets measured per batch size, pooled (more: steadier small batches)")
    add_engine(add, heads=True, sized=False)


def run(args: argparse.Namespace) -> int:
    if args.bench == "engine":
        from bench.engine import run_bench

        try:
            batches = tuple(int(b) for b in args.batches.split(","))
        except ValueError:
            raise UserError(f"--batches must be comma-separated integers, got {args.batches!r}") from None
        if args.tensor_parallel < 1:
            raise UserError(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
        if any(b < 1 for b in batches) or args.new_tokens < 2:
            raise UserError(f"batch sizes must be >= 1 and --new-tokens >= 2 (got {args.batches!r}, "
                            f"{args.new_tokens})")
        try:
            contexts = tuple(int(c) for c in args.contexts.split(","))
        except ValueError:
            raise UserError(f"--contexts must be comma-separated integers, got {args.contexts!r}") from None
        if args.kv_gib is not None and not args.kv_gib > 0:
            raise UserError(f"--kv-gib must be positive, got {args.kv_gib}")
        if any(c < 2 or c + args.new_tokens > args.max_context for c in contexts):
            raise UserError(f"--contexts must each be >= 2 and leave --new-tokens {args.new_tokens} within "
                            f"--max-context {args.max_context}, got {args.contexts!r}")
        run_bench(args.out, model=args.model, dtype=args.dtype, weights=args.weights, batches=batches,
                  contexts=contexts,
                  new_tokens=args.new_tokens, hf_baseline=args.hf_baseline,
                  tensor_parallel=args.tensor_parallel, max_context=args.max_context,
                  kv_budget_bytes=None if args.kv_gib is None else int(args.kv_gib * 2**30))
    elif args.bench == "telemetry":
        from bench.telemetry import run_bench as tel_bench

        if args.seconds <= 0:
            raise UserError(f"--seconds must be positive, got {args.seconds}")
        tel_bench(args.out, args.seconds, args.db)
    elif args.bench == "serve" and args.structured:
        # --max-tokens: free answers
        args.free_tokens, args.max_tokens, args.serve_arg = args.max_tokens, 160, []
        _run_structured(args)
    elif args.bench == "serve":
        from bench.serve import run_bench as serve_bench

        serve_bench(_serve_config(args), args.out)
    elif args.bench == "crossover":
        _run_crossover(args)
    elif args.bench == "tuner":
        from bench.split_bench import run_split_bench
        from bench.tuner import run_bench as tuner_bench

        config = tuner_config(args)  # --trace memory-bound|light: the pool-split bench
        (run_split_bench if config.traces else tuner_bench)(config, args.out)
    elif args.bench == "early-exit":
        _run_early_exit(args)
    elif args.bench == "findings":
        _run_findings(args)
    elif args.bench == "soak":
        _run_soak(args)
    elif args.bench == "structured":
        _run_structured(args)
    elif args.bench == "lm-eval":
        from bench.lm_eval_check import run_flags as run_lm_eval

        if code := run_lm_eval(args):
            raise SystemExit(code)
    elif args.bench == "tuner-compare":
        from bench.tuner_compare import run_compare

        try:
            run_compare(args.a, args.b, args.out)
        except ValueError as exc:
            raise UserError(f"bench tuner-compare: {exc}") from None
    return 0


def _run_crossover(args: argparse.Namespace) -> None:
    from pathlib import Path

    from bench.crossover import BenchConfigError, CrossoverGrid, run_bench

    def ints(flag: str, text: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(","))
        except ValueError:
            raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None

    def names(text: str | None) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip()) if text else ()

    for flag, path in (("--model", args.model), ("--heads", args.heads)):
        if path and not Path(path).exists():
            raise UserError(f"{flag} {path!r} does not exist")
    try:
        grid = CrossoverGrid(
            techniques=names(args.techniques), depths=ints("--depths", args.depths),
            batches=ints("--batches", args.batches), kinds=names(args.kinds), new_tokens=args.new_tokens,
            prompt_tokens=args.prompt_tokens, pool_split=args.pool_split, draft_vocab=args.draft_vocab,
            seed=args.seed, prompt_sets=args.prompt_sets, temperature=args.temperature)
        run_bench(args.out, grid, model=args.model, heads=args.heads, dtype=args.dtype)
    except BenchConfigError as exc:
        raise UserError(str(exc)) from None


def _serve_config(args: argparse.Namespace) -> Any:
    """The bench serve config from flags; UserError naming a bad one."""
    import os

    from bench.serve_config import ServeBenchConfig
    from bench.workloads import check_mix

    max_context = (args.max_context if args.max_context is not None
                   else 2048 if args.shared_prefix else 1024)
    minimums = (("--concurrency", args.concurrency, 1), ("--requests", args.requests, 1),
                ("--max-tokens", args.max_tokens, 1), ("--max-batch", args.max_batch, 1),
                ("--rounds", args.rounds, 1), ("--max-context", max_context, 2),
                ("--prefix-tokens", args.prefix_tokens, 1))
    for flag, value, low in minimums:
        if value < low:
            raise UserError(f"{flag} must be >= {low}, got {value}")
    for flag, value in (("--rate", args.rate), ("--seconds", args.seconds)):
        if value is not None and not value > 0:
            raise UserError(f"{flag} must be positive, got {value}")
    if not args.fake_step_ms >= 0:
        raise UserError(f"--fake-step-ms must be >= 0, got {args.fake_step_ms}")
    if args.admin_token and not args.url:
        raise UserError("--admin-token is the token of the daemon at --url (the daemon started "
                        "here has its prefix cache emptied anyway): pass --url too, or drop it")
    if args.shared_prefix and args.no_db and not args.url:
        raise UserError("--shared-prefix: each tenant sends with its own API key, kept in the "
                        "telemetry database: drop --no-db")
    try:
        mix = {k.strip(): float(w) for k, w in (part.split("=") for part in args.mix.split(","))}
        check_mix(mix)
    except ValueError as exc:
        raise UserError(f"--mix {args.mix!r}: {exc} (expected e.g. copy=1,chat=2)") from None
    return ServeBenchConfig(
        concurrency=args.concurrency, requests=args.requests, max_tokens=args.max_tokens,
        rate=args.rate, seconds=args.seconds, mix=mix, seed=args.seed, rounds=args.rounds,
        model=args.model, dtype=args.dtype, max_batch=args.max_batch,
        max_context=max_context, fake=args.fake, fake_step_ms=args.fake_step_ms,
        url=args.url, api_key=args.api_key or os.environ.get("CROSSOVER_API_KEY"), db=args.db,
        admin_token=(args.admin_token or os.environ.get("CROSSOVER_ADMIN_TOKEN")) if args.url else None,
        no_db=args.no_db, shared_prefix=args.shared_prefix, prefix_tokens=args.prefix_tokens,
        engine_rates=args.engine_rates, tenant_keys=args.tenant_keys, prefix_cache=not args.no_prefix_cache,
        speculation=not args.no_speculation,
        idle_ttft=not args.no_idle_ttft)


def _add_soak(s: argparse.ArgumentParser) -> None:
    add = s.add_argument
    add("--out", default="bench-out/soak.json", help="JSON output file")
    add("--requests", type=int, default=2000, help="HTTP requests the soak phase sends in all")
    add("--well-formed", type=int, default=400, help="well-formed requests of each phase (baseline, soak)")
    add("--concurrency", type=int, default=8, help="clients sending the well-formed requests")
    add("--hostile", type=int, default=56,
        help="slowloris, idle and stalled-body connections held at once (nothing reaches the engine)")
    add("--engine-hostile", type=int, default=4,
        help="clients at once whose requests reach the engine: unread and slowly read streams, hang-ups")
    add("--max-tokens", type=int, default=24, help="most output tokens of a well-formed request")
    add("--seed", type=int, default=0, help="seed of the prompts and the clients' choices")
    add("--tolerance", type=float, default=0.05, help="RSS and descriptors must end within this share "
                                                       "of their level after the baseline")
    add("--ttft-ratio", type=float, default=3.0,
        help="the soak's well-formed TTFT p99 over the baseline's, at most")
    add("--serve-arg", action="append", default=[], metavar="ARG",
        help="one more argument for `crossover serve` (repeatable), e.g. --serve-arg=--max-batch=16")
    add("--fake", action="store_true", help="serve the fake engine (the soak's machinery in a minute)")


def _run_soak(args: argparse.Namespace) -> None:
    from bench.soak import run_soak
    from bench.soak_daemon import SoakConfig

    cfg = SoakConfig(requests=args.requests, well_formed=args.well_formed, concurrency=args.concurrency,
                     hostile=args.hostile, engine_hostile=args.engine_hostile, max_tokens=args.max_tokens,
                     seed=args.seed, fake=args.fake, serve_args=tuple(args.serve_arg),
                     tolerance=args.tolerance, ttft_ratio=args.ttft_ratio)
    try:
        cfg.check()
    except ValueError as exc:
        raise UserError(f"bench soak: {exc}") from None
    result = run_soak(cfg, args.out)
    if not result["ok"]:
        raise UserError("bench soak: a check failed (see `checks` in the JSON)")


def _add_structured(s: argparse.ArgumentParser) -> None:
    add = s.add_argument
    add("--out", default="bench-out/structured.json", help="JSON output file")
    add("--url", default=None, help="bench the daemon at this URL (default: start `crossover serve` here)")
    add("--admin-token", default=None, help="the --url daemon's admin token: its prefix cache is emptied "
                                            "before each phase and its /metrics read")
    add("--concurrency", type=int, default=8, help="clients sending at once")
    add("--rounds", type=int, default=2,
        help="constrained and free phases, alternating, this many times each")
    add("--max-tokens", type=int, default=160, help="most tokens of a constrained answer")
    add("--free-tokens", type=int, default=48, help="tokens of each free answer (EOS ignored)")
    add("--serve-arg", action="append", default=[], metavar="ARG",
        help="one more argument for the `crossover serve` started here (repeatable)")


def _run_structured(args: argparse.Namespace) -> None:
    from bench.structured import StructuredConfig, run_structured

    for flag, value in (("--concurrency", args.concurrency), ("--rounds", args.rounds),
                        ("--max-tokens", args.max_tokens), ("--free-tokens", args.free_tokens)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    run_structured(StructuredConfig(url=args.url, admin_token=args.admin_token, concurrency=args.concurrency,
                                    rounds=args.rounds, max_tokens=args.max_tokens,
                                    free_tokens=args.free_tokens,
                                    serve_args=tuple(args.serve_arg)), args.out)


def _add_findings(f: argparse.ArgumentParser) -> None:
    add = f.add_argument
    add("--db", required=True, help="telemetry database to record into (SQLAlchemy URL or SQLite path; "
                                    "migrated to head, rows appended)")
    add("--out", default="docs/findings",
        help="report folder: README.md, PNGs, findings.json (default: %(default)s)")
    add("--quick", action="store_true",
        help="the fake engine and a small grid: the whole pipeline in seconds")
    add("--dry-run", action="store_true", help="print the runs and their estimated time; measure nothing")
    add("--kv-budget", default=None, metavar="BYTES",
        help="memory budget of the Q1/Q2 engine, e.g. 896MiB (default: bench/findings_config.py's)")
    add("--q3-kv-budget", default=None, metavar="BYTES",
        help="memory budget of each Q3 engine (default: bench/findings_config.py's, sized so the Q3 queue "
             "binds)")
    add("--splits", default=None, help="comma-separated pool splits of the draft model's Q3 runs")
    add("--batches", default=None, help="comma-separated Q2 batch sizes")
    add("--contexts", default=None, help="comma-separated Q2 contexts (tokens per request)")
    add("--depths", default=None, help="comma-separated Q2 draft depths (the report takes each best one)")
    add("--rounds", type=int, default=None, help="Q2 and Q3 rounds (default: 3)")
    add("--techniques", default=None, help="comma-separated proposers (default: every one loaded)")
    add("--phases", default=None, help="comma-separated phases to run, in order (default: q1,q2,q3; a run of "
                                       "some appends to a database holding the others)")
    add("--early-exit", action="append", default=None, metavar="FILE",
        help="a `crossover bench early-exit` JSON for Q4 (repeatable; default: "
             "bench/results/early-exit/exit8-b1-64-rounds3.json)")
    add("--note", default=None, help="a sentence for the report header, e.g. that the machine was shared")
    add("--seed", type=int, default=0, help="seed of the prompt draws")
    add_engine(add, heads=True, sized=False)


def _run_findings(args: argparse.Namespace) -> None:
    from bench.findings import run_findings
    from bench.findings_config import config_from_flags
    from bench.report.data import ReportInputError

    try:
        cfg = config_from_flags(args)
    except ValueError as exc:
        raise UserError(f"bench findings: {exc}") from None
    try:
        run_findings(cfg)
    except ReportInputError as exc:
        raise UserError(str(exc)) from None


def _add_early_exit(x: argparse.ArgumentParser) -> None:
    add = x.add_argument
    add("--out", default="bench-out/early-exit.json", help="JSON output file")
    add("--batches", default="1,4,16,64", help="comma-separated batch sizes")
    add("--thresholds", default="0.5,0.7,0.9",
        help="comma-separated confidence thresholds (never exiting is always measured too)")
    add("--exits", default="8", help="comma-separated exit points: layers run before each exit adapter")
    add("--new-tokens", type=int, default=32, help="tokens per sequence")
    add("--prompt-tokens", type=int, default=64, help="longest prompt (longer ones keep their last tokens)")
    add("--exit-vocab", type=int, default=8192, help="draft-vocabulary ids the exit adapters score (0: all)")
    add("--confidence", default="prob", choices=["prob", "margin"],
        help="exit when the max softmax probability (prob) or top-1 minus top-2 (margin) reaches the "
             "threshold")
    add("--quality-batch", type=int, default=16, help="prompts the greedy agreement is measured on")
    add("--ppl-tokens", type=int, default=96, help="held-out tokens scored per paragraph")
    add("--seed", type=int, default=0, help="seed of the prompt draw")
    add("--rounds", type=int, default=3,
        help="timed runs per configuration; each reports its fastest and every round's speedup")
    add("--kv-fill", default="propagate",
        help="comma-separated K/V fills of exited rows' skipped layers: propagate (CALM, now) and/or "
             "recompute (later, with the row's next full step); several: one JSON each, --out with -FILL "
             "before .json")
    add("--max-pending", type=int, default=4,
        help="recompute: positions a row may leave pending before a forced full step (a power of two)")
    add_engine(add, heads=True, sized=False)


def _run_early_exit(args: argparse.Namespace) -> None:
    from bench.early_exit import EarlyExitGrid, run_bench

    def numbers(flag: str, text: str, kind: type) -> tuple:
        try:
            return tuple(kind(v) for v in text.split(","))
        except ValueError:
            raise UserError(f"{flag} must be comma-separated numbers, got {text!r}") from None

    try:
        grid = EarlyExitGrid(
            batches=numbers("--batches", args.batches, int),
            thresholds=numbers("--thresholds", args.thresholds, float),
            exits=numbers("--exits", args.exits, int), new_tokens=args.new_tokens,
            prompt_tokens=args.prompt_tokens,
            exit_vocab=args.exit_vocab, confidence=args.confidence, quality_batch=args.quality_batch,
            ppl_tokens=args.ppl_tokens, seed=args.seed, rounds=args.rounds,
            kv_fills=tuple(f.strip() for f in args.kv_fill.split(",")), max_pending=args.max_pending)
        run_bench(args.out, grid, model=args.model, heads=args.heads, dtype=args.dtype)
    except ValueError as exc:
        raise UserError(f"bench early-exit: {exc}") from None
