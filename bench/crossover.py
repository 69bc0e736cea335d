"""`crossover bench crossover`: goodput of each speculative technique against batch size.

Everything is measured in one run, interleaved, so ratios are meaningful on a noisy machine:
1. Prompts: per workload kind, the first max(batches) prompts of a seeded draw
   that fit in `prompt_tokens` (too few fit: the rest keep BOS + their last tokens).
2. For each kind and batch size B, runs in the order plain, t1@d1 .. t1@dn,
   plain, t2@d1 .., plain: each run adds B greedy requests (EOS ignored),
   prefills them under plain decoding, and switches to the run's policy once
   all B decode; only steps where all B sequences decode (no prefill) count.
   Goodput = output tokens emitted / step time. Every run, plain included,
   has the same pool split (the draft model drafts only in a lent pool).
3. Per technique: its best depth at each B, the speedup over plain (the plain
   runs of that kind and B pooled), the crossover (the largest B where the
   best depth beats plain; 0: never) and acceptance per draft position.
4. JSON and a PNG plot next to it (bench.plots.crossover_plot): one panel per
   kind, goodput vs batch size (log2 axis), a line per technique at its best
   depth and one for plain, each crossover a dashed vertical line in the
   technique's colour.

Acceptance at position i is the share of sequence-steps (sequences times
counted steps) whose position-i draft was accepted, so 1 + sum(per_pos) is
the tokens each sequence emits per step; `conditional_per_pos[i]` is the
rate given position i - 1 was accepted (None where never reached).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bench.crossover_summary import Tally, pool_sets, progress_line, summarize_kind
from bench.workloads import KINDS, pool, prompts, to_request
from engine.policy import MAX_POOL_SPLIT, TECHNIQUES, BatchRule, TunedPolicy
from engine.runtime.progress import Reporter, report
from engine.types import Request, SamplingParams

MAX_DEPTH = 8
SPEC_TECHNIQUES = tuple(t for t in TECHNIQUES if t != "none")


class BenchConfigError(ValueError):
    """A grid value the bench cannot run (the CLI turns it into a UserError)."""


@dataclass(frozen=True)
class CrossoverGrid:
    """What to measure."""

    techniques: tuple[str, ...] = ()
    """Proposers to measure (empty: every one the engine has loaded)."""
    depths: tuple[int, ...] = (1, 2, 4, 8)
    """Draft depths tried per technique (deeper than a proposer can draft: skipped)."""
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Concurrent requests per measurement."""
    kinds: tuple[str, ...] = KINDS
    """Workload kinds (bench.workloads)."""
    new_tokens: int = 64
    """Output tokens each request decodes after all B are decoding."""
    prompt_tokens: int = 256
    """Longest prompt in tokens."""
    pool_split: float = 0.25
    """Share of the KV pool lent to speculation in every run (plain included)."""
    draft_vocab: int | None = None
    """MTP's draft vocabulary (None: its smallest compiled one)."""
    seed: int = 0
    """Seed of the prompt draw."""
    temperature: float = 0.0
    """Sampling temperature of every request (0: greedy); each request has its own seed, so a run
    repeats. Sampled output quotes itself less, which is what n-gram drafting feeds on."""
    prompt_sets: int = 1
    """Disjoint sets of prompts measured at each batch size, their counts pooled, so that one
    prompt that happens to repeat itself (or not) does not decide the small batches."""

    def __post_init__(self) -> None:
        for name in ("depths", "batches"):
            values = getattr(self, name)
            if not values:
                raise BenchConfigError(f"{name}: at least one value is needed")
            object.__setattr__(self, name, tuple(sorted(set(values))))
        if not all(1 <= d <= MAX_DEPTH for d in self.depths):
            raise BenchConfigError(f"depths {list(self.depths)}: each must be in 1..{MAX_DEPTH}")
        if not 0.0 <= self.temperature <= 2.0:
            raise BenchConfigError(f"temperature={self.temperature} must be in [0, 2]")
        if self.prompt_sets < 1:
            raise BenchConfigError(f"prompt_sets {self.prompt_sets} must be >= 1")
        if self.batches[0] < 1:
            raise BenchConfigError(f"batches {list(self.batches)}: each must be >= 1")
        for name, values, known in (("kinds", self.kinds, KINDS),
                                    ("techniques", self.techniques, SPEC_TECHNIQUES)):
            bad = [v for v in values if v not in known]
            if bad or (name == "kinds" and not values):
                raise BenchConfigError(f"{name} {list(values)}: {bad or 'none given'} not in {list(known)}")
        for name, low in (("new_tokens", 2), ("prompt_tokens", 2)):
            if getattr(self, name) < low:
                raise BenchConfigError(f"{name}={getattr(self, name)} must be >= {low}")
        if not 0.0 <= self.pool_split <= MAX_POOL_SPLIT:
            raise BenchConfigError(f"pool_split={self.pool_split} must be in [0, {MAX_POOL_SPLIT}]")


# --- measuring -----------------------------------------------------------------

def measure(engine, grid: CrossoverGrid, log=None, progress: Reporter = None) -> dict:
    """Run the grid on an engine (warmed up here if it is not) and return the result dict.

    `log(line)` gets a line per kind and batch size; `progress` (engine/runtime/progress.py) sees
    warmup and each (kind, batch size) measured. Without either the run is silent."""
    techniques, depths, vocab = _resolve(engine, grid)
    if not engine.warmed_up:
        if log:
            log("warming up (compiles every bucket once; cached on disk for the next run)")
        engine.warmup(progress=progress if progress is not None else log is not None)
        from bench.engine import run_each_shape_once

        run_each_shape_once(engine, progress)
    log = log or (lambda msg: None)
    kinds, cells, done = {}, len(grid.kinds) * len(grid.batches), 0
    report(progress, "bench crossover", 0, cells)
    for kind in grid.kinds:
        n = max(grid.batches) * grid.prompt_sets
        ids, truncated = prompt_ids(engine.tokenizer, kind, n, grid.prompt_tokens, grid.seed)
        rows = []
        for b in grid.batches:
            for k in range(grid.prompt_sets):
                part = ids[k * b : (k + 1) * b]
                max_tokens = grid.new_tokens + prefill_steps(engine.scheduler.cfg.token_budget, part)
                rows += _measure_batch(engine, grid, kind, part, max_tokens, techniques, depths, vocab)
            log(progress_line(kind, b, pool_sets(rows)))
            done += 1
            report(progress, "bench crossover", done, cells)
        kinds[kind] = summarize_kind(pool_sets(rows), techniques, depths)
        kinds[kind]["prompts"] = {"count": len(ids), "truncated": truncated,
                                  "mean_tokens": sum(map(len, ids)) / len(ids)}
    return {
        "model": engine.model_name, "dtype": engine.runner.rc.dtype,
        "grid": {"techniques": list(techniques), "depths": {t: list(depths[t]) for t in techniques},
                 "batches": list(grid.batches), "kinds": list(grid.kinds), "new_tokens": grid.new_tokens,
                 "prompt_tokens": grid.prompt_tokens, "pool_split": grid.pool_split, "mtp_draft_vocab": vocab,
                 "seed": grid.seed, "prompt_sets": grid.prompt_sets, "temperature": grid.temperature},
        "kinds": kinds,
        "crossover": {k: {t: v["techniques"][t]["crossover"] for t in techniques} for k, v in kinds.items()},
        "speedup_batch1": {k: v["speedup_batch1"] for k, v in kinds.items()},
        "compiles_since_warmup": engine.compiles_since_warmup(),
    }


def _resolve(engine, grid: CrossoverGrid) -> tuple[tuple[str, ...], dict[str, tuple[int, ...]], int]:
    """Techniques, depths per technique and MTP draft vocabulary; BenchConfigError when the engine cannot."""
    loaded = tuple(t for t in SPEC_TECHNIQUES if t in engine.proposers)
    missing = [t for t in grid.techniques if t not in loaded]
    if missing:
        raise BenchConfigError(f"techniques {missing} are not loaded (loaded: {list(loaded)}; the "
                               "model-based ones need a heads file)")
    techniques = grid.techniques or loaded
    rc = engine.runner.rc
    if grid.batches[-1] > min(engine.max_batch, rc.spec_max_batch):
        raise BenchConfigError(f"batch {grid.batches[-1]} exceeds the engine's max batch {engine.max_batch} "
                               f"or speculative max batch {rc.spec_max_batch}")
    if grid.depths[-1] + 1 > max(rc.verify_tokens, default=1):
        raise BenchConfigError(f"depth {grid.depths[-1]} exceeds the compiled verify buckets "
                               f"{rc.verify_tokens}")
    _check_context(engine, grid)
    depths = {t: tuple(d for d in grid.depths if d <= engine.proposers[t].max_depth) or grid.depths[:1]
              for t in techniques}
    mtp = engine.capacity().proposers.get("mtp")
    sizes = mtp.draft_vocabs if mtp else (0,)
    vocab = grid.draft_vocab if grid.draft_vocab is not None else min((v for v in sizes if v), default=0)
    if "mtp" in techniques and vocab not in sizes:
        raise BenchConfigError(f"draft_vocab={vocab} is not one of MTP's compiled vocabularies {list(sizes)}")
    return techniques, depths, vocab if "mtp" in techniques else 0


def _check_context(engine, grid: CrossoverGrid) -> None:
    """The longest prompt, its output (new tokens plus what it decodes while others prefill) and the
    verify lookahead must fit in the engine's context."""
    top = grid.batches[-1]
    worst = prefill_steps(engine.scheduler.cfg.token_budget, [[0] * grid.prompt_tokens] * top)
    need = grid.prompt_tokens + grid.new_tokens + worst + engine.scheduler.cfg.lookahead
    if need > engine.max_context:
        raise BenchConfigError(f"prompt_tokens={grid.prompt_tokens} + new_tokens={grid.new_tokens} at batch "
                               f"{top} need a {need}-token context, the engine has {engine.max_context}")


def prompt_ids(tokenizer, kind: str, n: int, limit: int, seed: int) -> tuple[list[list[int]], int]:
    """n prompts' token ids (BOS first): the first of a seeded draw that fit in `limit`
    tokens, then, if too few fit, others cut to BOS + their last limit - 1 tokens.
    Returns (ids, how many were cut); a pool smaller than n repeats."""
    fit, long = [], []
    for i, p in enumerate(prompts(kind, len(pool(kind)), seed)):
        ids = to_request(p, tokenizer, f"{kind}-{i}").prompt_ids
        (fit if len(ids) <= limit else long).append(ids)
        if len(fit) == n:
            break
    cut = [ids[:1] + ids[len(ids) - limit + 1:] for ids in long[: n - len(fit)]]
    chosen = fit + cut
    return (chosen * -(-n // len(chosen)))[:n], len(cut)


def prefill_steps(token_budget: int, ids: list[list[int]]) -> int:
    """Most steps B prompts take to prefill (the early ones decode meanwhile).

    Example: prefill_steps(512, [[1] * 100] * 4) == 2 (one step of prefill, one spare).
    """
    room = max(1, token_budget - len(ids))
    return -(-sum(map(len, ids)) // room) + 1


def _policy(grid: CrossoverGrid, technique: str | None, depth: int, vocab: int) -> TunedPolicy:
    if technique is None:
        return TunedPolicy(pool_split=grid.pool_split)
    top = grid.batches[-1]
    return TunedPolicy(rules=(BatchRule(top, technique, depth),), crossover=top, pool_split=grid.pool_split,
                       draft_vocab=vocab if technique == "mtp" else 0)


def _measure_batch(engine, grid, kind, ids, max_tokens, techniques, depths, vocab) -> list[dict]:
    """Plain, each depth of the first technique, plain, ... plain: one row per run."""
    order: list[tuple[str | None, int]] = [(None, 0)]
    for t in techniques:
        order += [(t, d) for d in depths[t]] + [(None, 0)]
    rows = []
    for i, (t, d) in enumerate(order):
        tally = run_one(engine, ids, _policy(grid, t, d, vocab), max_tokens, f"{kind}-b{len(ids)}-{i}",
                        grid.temperature)
        rows.append({"kind": kind, "batch": len(ids), "technique": t or "none", "depth": d, "tally": tally})
    return rows


def run_one(engine, ids: list[list[int]], policy: TunedPolicy, max_tokens: int, tag: str,
            temperature: float = 0.0) -> Tally:
    """B = len(ids) requests (greedy, or sampled at `temperature` with seed i for the i-th): prefill
    under plain decoding, then `policy`; count all-B decode steps."""
    b = len(ids)
    engine.set_policy(TunedPolicy(pool_split=policy.pool_split))
    for i, p in enumerate(ids):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature,
                            seed=i if temperature > 0 else None)
        engine.add_request(Request(f"{tag}-{i}", list(p), sp))
    tally, started, switched = Tally(runs=1), set(), False
    while engine.has_work():
        out = engine.step()
        st = out.stats
        if st is not None:
            tally.preempted += st.preempted
        if switched and st is not None and st.prefill_tokens == 0 and st.batch_size == b:
            tally.add(st)
        elif not switched:
            started.update(ev.request_id for ev in out.events if ev.token_ids)
            if len(started) == b:
                engine.set_policy(policy)
                switched = True
    return tally


# --- the command -------------------------------------------------------------------

def write_result(result: dict, out_path: str) -> dict:
    """Write the JSON and the PNG next to it (same name, .png); returns the result with its "plot" entry."""
    from bench.plots import crossover_plot

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {**result, "plot": crossover_plot(result, out.with_suffix(".png"))}
    out.write_text(json.dumps(result, indent=2))
    return result


def verify_tokens_for(depths) -> tuple[int, ...]:
    """The loader's verify buckets (1 + depth) the depths need: (1, 2, 4, 8) -> (2, 3, 5, 9)."""
    from engine.loader import VERIFY_TOKENS

    return tuple(sorted({min(v for v in VERIFY_TOKENS if v >= d + 1) for d in depths}))


def run_bench(out_path: str | None, grid: CrossoverGrid, model: str | None = None, heads: str | None = None,
              dtype: str | None = None) -> dict:
    from daemon.progress import reporter, say
    from engine.loader import load_engine

    log = lambda msg: say(f"bench crossover: {msg}")
    progress = reporter()
    top = grid.batches[-1]
    budget = max(512, top * (grid.prompt_tokens + 1))  # every prompt prefilled in one step
    verify = verify_tokens_for(grid.depths)
    context = grid.prompt_tokens + grid.new_tokens + 2 + verify[-1]
    engine = load_engine(model=model, dtype=dtype, max_batch=top, max_context=context, token_budget=budget,
                         speculation=True, heads=heads, verify_tokens=verify, spec_max_batch=top,
                         progress=progress)
    result = measure(engine, grid, log, progress)
    result["backend"] = _backend()
    if out_path:
        result = write_result(result, out_path)
        log(f"wrote {out_path} and {result['plot']['path']}")
    for kind, s in result["speedup_batch1"].items():
        if s:
            log(f"{kind}: best at batch {s['batch']}: {s['technique']}@{s['depth']} {s['speedup']:.2f}x; "
                f"crossovers {result['crossover'][kind]}")
    return result


def _backend() -> str:
    import jax

    return jax.default_backend()
