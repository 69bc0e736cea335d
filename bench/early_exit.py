"""`crossover bench early-exit`: early exit with a compacting batch — LOSSY, opt-in, an experiment.

Answers the essay's question 4 (does early exit pay once a scheduler compacts the
batch mid-network, or does the machinery cost more than it saves?) on the real
model, with bench/early_exit_decoder.py. One run, so ratios are comparable on a busy machine:

1. Speed: for each batch size, greedy decode of `new_tokens` per prompt through
   the compacting stages at each threshold, and at "never" (the full model through
   the same stages); beside them the engine's own forward in the same loop
   ("plain loop") and the serving engine (bench/engine.decode_throughput).
   Decode steps only (the prefill's token is the full model's). Every shape is
   compiled before timing; compiles during the timed runs are counted.
   `parts_ms`: each part of a step timed alone per row bucket (stage s, the state
   propagation after exit point k, the K/V write, the engine's forward): what
   compaction saves and what its machinery costs.
   Each K/V fill of `kv_fills` (state propagation now, or recompute later: exited
   positions run the upper layers with the row's next full step) runs in the same
   loop, so its speedups are against the same "never" and plain loop.
2. Quality, per threshold, on `quality_batch` prompts: greedy agreement (share
   of decoded positions where the early-exit token equals the full model's token
   for the same prefix; also at exited positions only) and the share of sequences
   identical to the full model's over all tokens.
3. Perplexity of held-out text (HELD_OUT, written for this benchmark) teacher-forced
   through the early-exit decoder, against the full model. An exited position's
   distribution is the exit adapter over the whole vocabulary (over the draft
   vocabulary a held-out token outside it would have probability 0).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.early_exit_decoder import FILLS, NEVER, EarlyExit, pow2_bucket
from engine.runtime.compiles import compile_count

HELD_OUT = (
    "The harbour town woke slowly in winter. Fishing boats stayed tied to the quay while the wind "
    "pushed grey water against the stones, and the baker opened an hour late because nobody came "
    "before the light. By noon the market had a few stalls of apples, rope and dried fish, and the "
    "children who should have been at school ran between them, daring each other to touch the cold "
    "iron of the old crane that had not moved in forty years.",
    "A cache is only useful when the data it keeps is read again before it is evicted. Engineers "
    "therefore measure the hit rate under the traffic they actually serve, not under a synthetic "
    "benchmark that repeats one request. When the working set grows past the cache, the hit rate "
    "falls quickly, and every miss pays the full cost of the slower tier plus the bookkeeping of "
    "the cache itself, which is why a small cache can make a system slower than no cache at all.",
    "To make a simple bread, mix flour, water, salt and a little yeast until no dry flour remains. "
    "Leave the dough covered for several hours, folding it twice so that it becomes smooth and "
    "elastic. Shape it into a round loaf, let it rise again until it is soft to the touch, and bake "
    "it in a very hot oven with a lid for the first half of the time, so that the crust stays thin "
    "while the inside finishes cooking.",
    "The committee met on Tuesday to review the budget for the coming year. Most members agreed "
    "that the library needed a new roof before anything else, but they disagreed about whether to "
    "borrow the money or to delay the repairs to the sports hall. After two hours the chair proposed "
    "a compromise: the roof would be fixed in spring, and the hall would be inspected again in the "
    "autumn before any decision was made about its future.",
)
"""Held-out paragraphs for perplexity (written for this benchmark; not from any training set)."""


@dataclass(frozen=True)
class EarlyExitGrid:
    """What `crossover bench early-exit` measures."""

    batches: tuple[int, ...] = (1, 4, 16, 64)
    """Batch sizes (rows decoded together)."""
    thresholds: tuple[float, ...] = (0.5, 0.7, 0.9)
    """Confidence thresholds; "never" (the full model through the same stages) is always added."""
    exits: tuple[int, ...] = (8,)
    """Exit points (layers run before each exit adapter), ascending."""
    new_tokens: int = 32
    """Tokens per sequence (the first from the prefill)."""
    prompt_tokens: int = 64
    """Longest prompt (longer ones keep their last tokens)."""
    exit_vocab: int = 8192
    """Draft-vocabulary ids the exit adapters score (0: the whole vocabulary)."""
    confidence: str = "prob"
    """Exit rule: max softmax probability ("prob") or top-1 minus top-2 ("margin")."""
    quality_batch: int = 16
    """Prompts the greedy agreement is measured on."""
    ppl_tokens: int = 96
    """Held-out tokens scored per paragraph."""
    seed: int = 0
    """Seed of the prompt draw."""
    rounds: int = 2
    """Timed runs per configuration; each reports its fastest (for a machine other processes share) and
    every round's speedup (`crossover bench early-exit` runs 3, for intervals over rounds)."""
    kv_fills: tuple[str, ...] = ("propagate",)
    """How exited rows' skipped layers get K/V: "propagate" (CALM, now) and/or "recompute" (later)."""
    max_pending: int = 4
    """Recompute later: positions a row may leave pending before a forced full step (a power of two)."""

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {list(self.batches)}")
        if not self.thresholds or any(not 0 <= t for t in self.thresholds):
            raise ValueError(f"thresholds must be >= 0, got {list(self.thresholds)}")
        if self.new_tokens < 2 or self.prompt_tokens < 2 or self.ppl_tokens < 2 or self.quality_batch < 1 \
                or self.rounds < 1:
            raise ValueError(f"new_tokens={self.new_tokens}, prompt_tokens={self.prompt_tokens}, ppl_tokens="
                             f"{self.ppl_tokens} must be >= 2, quality_batch={self.quality_batch} and "
                             f"rounds={self.rounds} >= 1")
        if not self.kv_fills or any(f not in FILLS for f in self.kv_fills) or len(set(self.kv_fills)) < len(
                self.kv_fills):
            raise ValueError(f"kv fills must be distinct of {list(FILLS)}, got {list(self.kv_fills)}")


def _label(thr: float) -> str | float:
    return "never" if thr == NEVER else thr


def prompt_ids(tokenizer, n: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """n prompts of mixed kinds (bench.workloads), each BOS + at most prompt_tokens - 1 tokens."""
    from bench.workloads import mixed

    out = []
    for p in mixed(n, {"prose": 1, "chat": 1, "code": 1, "copy": 1}, seed):
        ids = tokenizer.encode(p.render(tokenizer), add_bos=False)
        out.append([tokenizer.bos_id] + ids[-(prompt_tokens - 1):])
    return out


def held_out_ids(tokenizer, tokens: int) -> list[list[int]]:
    """HELD_OUT as BOS + tokens, every row cut to the same length (at most `tokens` + 1)."""
    rows = [[tokenizer.bos_id] + tokenizer.encode(t, add_bos=False) for t in HELD_OUT]
    n = min(tokens + 1, *(len(r) for r in rows))
    return [r[:n] for r in rows]


def _rate(ee: EarlyExit, prompts, grid: EarlyExitGrid, thr: float, plain: bool = False,
          fill: str = "propagate"):
    run = ee.run(prompts, grid.new_tokens, thr, plain=plain, kv_fill=fill)
    steps = grid.new_tokens - 1
    return run, {"tokens_per_s": len(prompts) * steps / run.decode_s, "step_ms": 1e3 * run.decode_s / steps}


def _exit_stats(ee: EarlyExit, run) -> dict:
    """Exit shares over decoded positions (step 0 is the prefill's), the share of steps whose
    last stage ran in a smaller bucket than the batch's (or not at all): where compaction saved,
    and (recompute later) positions caught up and row-steps forced full, per decoded token."""
    dec = run.layers_run[:, 1:]
    rest = (dec == ee.cfg.n_layers).sum(axis=0)  # rows through the whole model, per step
    full = pow2_bucket(dec.shape[0])
    return {"exit_fraction": float((dec < ee.cfg.n_layers).mean()),
            "exit_fraction_by_layer": {str(k): float((dec == k).mean()) for k in ee.exits},
            "steps_compacted": float(np.mean([n == 0 or pow2_bucket(int(n)) < full for n in rest])),
            "caught_up_per_token": run.caught_up / dec.size, "forced_per_token": run.forced / dec.size}


def _fastest(rates: list[dict]) -> dict:
    return max(rates, key=lambda r: r["tokens_per_s"])


def measure_speed(ee: EarlyExit, engine, grid: EarlyExitGrid, prompts: list[list[int]], log) -> dict:
    """Tokens/s per (batch, K/V fill, threshold), the plain loop and the serving engine per batch:
    each the fastest of `grid.rounds` rounds, the configurations taking turns within a round; each cell
    also keeps every round's speedup over that round's "never" (`speedup_by_round`), for intervals.
    "never" runs once per batch (with the first fill) and is every fill's reference."""
    from bench.engine import decode_throughput

    cells, plain, eng, runs, parts_ms = {f: [] for f in grid.kv_fills}, [], [], {}, {}
    warm0, timed = compile_count(), 0
    first = grid.kv_fills[0]
    configs = (("plain", first, NEVER), ("never", first, NEVER),
               *((f, f, t) for f in grid.kv_fills for t in grid.thresholds))
    for b in grid.batches:
        rows = prompts[:b]
        parts_ms[str(b)] = {}
        for f in grid.kv_fills:
            parts = ee.warm(b, max(len(p) for p in rows), grid.new_tokens, reps=grid.rounds + 1, kv_fill=f)
            parts_ms[str(b)][f] = {k: round(v, 3) for k, v in parts.items()}
        if engine is not None:
            decode_throughput(engine, b, len(rows[0]), grid.new_tokens)  # compiles the engine's shapes
        rates: dict = {c: [] for c in (*configs, "engine")}
        for _ in range(grid.rounds):
            c0 = compile_count()
            for c in configs:
                run, r = _rate(ee, rows, grid, c[2], plain=c[0] == "plain", fill=c[1])
                rates[c].append(r)
                runs[(b, c[1] if c[0] != "never" else "never", c[2])] = run
            timed += compile_count() - c0
            if engine is not None:
                e = decode_throughput(engine, b, len(rows[0]), grid.new_tokens)
                rates["engine"].append({"tokens_per_s": e["tokens_per_s"], "step_ms": e["step_ms"]})
        pr, never = _fastest(rates[configs[0]]), _fastest(rates[configs[1]])["tokens_per_s"]
        plain.append({"batch": b, **pr})
        if engine is not None:
            eng.append({"batch": b, **_fastest(rates["engine"])})
        for c in configs[1:]:
            r = _fastest(rates[c])
            run = runs[(b, "never", NEVER) if c[0] == "never" else (b, c[1], c[2])]
            by_round = [x["tokens_per_s"] / n["tokens_per_s"] for x, n in zip(rates[c], rates[configs[1]])]
            cell = {"batch": b, "threshold": _label(c[2]), **r, **_exit_stats(ee, run),
                    "speedup_vs_never": r["tokens_per_s"] / never, "speedup_by_round": by_round,
                    "speedup_vs_plain_loop": r["tokens_per_s"] / pr["tokens_per_s"]}
            for f in (grid.kv_fills if c[0] == "never" else (c[1],)):
                cells[f].append({**cell, "kv_fill": f})
            log(f"batch {b:3d} {c[0]:>9} threshold {_label(c[2])!s:>5}: {r['tokens_per_s']:8.1f} tok/s, "
                f"{cell['exit_fraction']:.0%} exited, {cell['speedup_vs_never']:.2f}x never")
        log(f"batch {b:3d}: plain loop {pr['tokens_per_s']:.1f} tok/s"
            + (f", engine {eng[-1]['tokens_per_s']:.1f} tok/s" if engine is not None else ""))
    for c in (c for fc in cells.values() for c in fc):
        ref = next((e["tokens_per_s"] for e in eng if e["batch"] == c["batch"]), None)
        c["speedup_vs_engine"] = c["tokens_per_s"] / ref if ref else None
    compiles = {"outside_timed_runs": compile_count() - warm0 - timed, "during_timed_runs": timed}
    speed = {"cells": cells, "plain_loop": plain, "engine": eng, "compiles": compiles, "parts_ms": parts_ms}
    return speed, runs


def measure_quality(ee: EarlyExit, grid: EarlyExitGrid, prompts, held_out, runs: dict, log) -> dict:
    """Greedy agreement, identical sequences and held-out perplexity per K/V fill and threshold."""
    N, q = grid.new_tokens, prompts[: grid.quality_batch]
    full = runs.get((len(q), "never", NEVER)) or ee.run(q, N, NEVER)
    feed = np.array([r[1:] for r in held_out], np.int32)
    starts = [r[:1] for r in held_out]
    ref = ee.run(starts, feed.shape[1], NEVER, feed=feed)
    full_nll = -float(ref.logprob[:, 1:].mean())
    out: dict = {f: [] for f in grid.kv_fills}
    for f in grid.kv_fills:
        for thr in grid.thresholds:
            run = runs.get((len(q), f, thr)) or ee.run(q, N, thr, kv_fill=f)
            same_prefix = ee.run(q, N, NEVER, feed=run.tokens)  # the full model's token after each prefix
            agree = same_prefix.tokens[:, 1:] == run.tokens[:, 1:]
            exited = run.layers_run[:, 1:] < ee.cfg.n_layers
            ppl = ee.run(starts, feed.shape[1], thr, feed=feed, kv_fill=f)
            nll = -float(ppl.logprob[:, 1:].mean())
            row = {"threshold": thr, "kv_fill": f, **_exit_stats(ee, run),
                   "greedy_agreement": float(agree.mean()),
                   "agreement_at_exits": float(agree[exited].mean()) if exited.any() else None,
                   "sequences_identical": float((run.tokens == full.tokens).all(axis=1).mean()),
                   "perplexity": math.exp(nll), "perplexity_full": math.exp(full_nll),
                   "perplexity_ratio": math.exp(nll - full_nll),
                   "perplexity_exit_fraction": _exit_stats(ee, ppl)["exit_fraction"]}
            out[f].append(row)
            at = row["agreement_at_exits"]
            log(f"{f} threshold {thr}: agreement {row['greedy_agreement']:.3f} (at exits "
                f"{at if at is None else round(at, 3)}), identical {row['sequences_identical']:.2f}, "
                f"perplexity {row['perplexity']:.2f} vs {row['perplexity_full']:.2f} full")
    return out


PAYS_MARGIN = 1.05
"""Speedup over never exiting that counts as paying: on the shared 2-core machine two loops of the
same work (never exiting and the plain loop) differed by 4-9% within one run."""


AGREEMENT_FLOOR = 0.95
"""Greedy agreement with the full model above which a threshold counts as near-lossless in the summary."""


def summarize(speed: dict, quality: list[dict] | None = None) -> dict:
    """Per batch size: the fastest threshold above 0 against never exiting (the same stages, measured
    in turn with it) and against the engine, with its greedy agreement; threshold 0 (every row exits
    at the first exit point) is reported apart, as the bound early exit could reach.

    "pays": the fastest threshold above 0 decodes at least PAYS_MARGIN times as fast as never exiting;
    "best_at_agreement_floor": the fastest threshold whose greedy agreement is >= AGREEMENT_FLOOR.
    """
    agreement = {q["threshold"]: q["greedy_agreement"] for q in quality or ()}
    out = {}
    for b in sorted({c["batch"] for c in speed["cells"]}):
        mine = [c for c in speed["cells"] if c["batch"] == b]
        never = next(c for c in mine if c["threshold"] == "never")
        bound = next((c for c in mine if c["threshold"] == 0), None)
        cs = [c for c in mine if c["threshold"] not in ("never", 0)]
        best = max(cs, key=lambda c: c["tokens_per_s"]) if cs else None
        out[str(b)] = {
            "best_threshold": best and best["threshold"],
            "best_speedup_vs_never": best and best["speedup_vs_never"],
            "best_speedup_vs_engine": best and best["speedup_vs_engine"],
            "best_greedy_agreement": best and agreement.get(best["threshold"]),
            "always_exit_speedup_vs_never": bound and bound["speedup_vs_never"],
            "never_vs_plain_loop": never["speedup_vs_plain_loop"],
            "pays": bool(best and best["speedup_vs_never"] >= PAYS_MARGIN)}
        good = [c for c in cs if agreement.get(c["threshold"], 0) >= AGREEMENT_FLOOR]
        if good:  # the fastest threshold that keeps the output close to the full model's
            g = max(good, key=lambda c: c["tokens_per_s"])
            out[str(b)]["best_at_agreement_floor"] = {"threshold": g["threshold"],
                                                      "speedup_vs_never": g["speedup_vs_never"],
                                                      "greedy_agreement": agreement[g["threshold"]]}
    return out


FILL_NOTES = {
    "propagate": "their upper layers' K/V are propagated from the exit layer (CALM)",
    "recompute": "their upper layers run later, with the row's next full step, over the pending positions "
                 "(at most max_pending; then a forced full step): the pages get the full model's K/V",
}


def measure(ee: EarlyExit, engine, tokenizer, grid: EarlyExitGrid, log=None) -> dict[str, dict]:
    """The whole benchmark on a built decoder (and serving engine, or None): one result dict per K/V
    fill, all from the same loop (each with the shared plain loop, engine and "never" figures)."""
    log = log or (lambda msg: print(f"bench early-exit: {msg}", file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    n = max(max(grid.batches), grid.quality_batch)
    prompts = prompt_ids(tokenizer, n, grid.prompt_tokens, grid.seed)
    speed, runs = measure_speed(ee, engine, grid, prompts, log)
    quality = measure_quality(ee, grid, prompts, held_out_ids(tokenizer, grid.ppl_tokens), runs, log)
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    out = {}
    for f in grid.kv_fills:
        mine = {**speed, "cells": speed["cells"][f]}
        out[f] = {
            "lossy": True,
            "note": f"opt-in experiment, not a serving path: exited rows emit the exit adapter's token and "
                    f"{FILL_NOTES[f]}; output differs from the full model",
            "kv_fill": f, "same_run_as": list(grid.kv_fills), "max_pending": ee.max_pending,
            "kv": "paged (engine/memory/kv.py)",
            "model": ee.cfg.name, "dtype": str(ee.params["embed"].dtype), "grid": asdict(grid),
            "exit_vocab": ee.exit_vocab, "machine": {"cpus": os.cpu_count(), "load_average_at_end": load,
                                                     "shared": True},
            **mine, "quality": quality[f], "summary": summarize(mine, quality[f]),
            "seconds": time.perf_counter() - t0,
        }
    return out


def fill_path(out_path: str, fill: str, fills: tuple[str, ...]) -> str:
    """Where one fill's result goes: `out_path` itself for a single fill, else `-{fill}` before
    the suffix.

    >>> fill_path("a/ee.json", "recompute", ("propagate", "recompute"))
    'a/ee-recompute.json'
    """
    if len(fills) == 1:
        return out_path
    p = Path(out_path)
    return str(p.with_name(f"{p.stem}-{fill}{p.suffix}"))


def run_bench(out_path: str | None, grid: EarlyExitGrid, model: str | None = None, heads: str | None = None,
              dtype: str | None = None) -> dict[str, dict]:
    """Load the real model, its exit adapters and a serving engine; measure; write JSON (one file
    per K/V fill, see fill_path); the results by fill."""
    import jax.numpy as jnp

    from daemon.progress import reporter, say
    from engine.loader import default_dtype, find_heads, load_engine
    from engine.speculation.heads import DraftHeads

    log = lambda msg: say(f"bench early-exit: {msg}")
    dtype = dtype or default_dtype()  # the compacting decoder reads float weights, not quantized ones
    progress = reporter()
    max_context = -(-(grid.prompt_tokens + max(grid.new_tokens, grid.ppl_tokens) + 1) // 64) * 64
    engine = load_engine(model=model, dtype=dtype, max_batch=max(grid.batches),
                         max_context=max(max_context, 128), speculation=False, progress=progress)
    path, source = find_heads(heads, engine.cfg)
    if path is None:
        raise ValueError(f"no exit adapters for {engine.cfg.name}: give --heads "
                         "(see `crossover train-heads`)")
    loaded = DraftHeads.load(path, dtype=jnp.dtype(engine.runner.rc.dtype))
    loaded.check(engine.cfg)
    log(f"exit adapters from {path} ({source}); exits {list(grid.exits)} of {sorted(loaded.exits)}")
    ee = EarlyExit(engine.cfg, engine.runner.params, loaded, grid.exits, grid.exit_vocab, grid.confidence,
                   max_pending=grid.max_pending)
    results = measure(ee, engine, engine.tokenizer, grid, log)
    for f, result in results.items():
        result["command"] = " ".join(["crossover", *sys.argv[1:]]) if sys.argv else None
        if out_path:
            write_result(fill_path(out_path, f, grid.kv_fills), result)
            log(f"wrote {fill_path(out_path, f, grid.kv_fills)}")
    return results


def write_result(out_path: str | None, result: dict) -> None:
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2, default=str))
