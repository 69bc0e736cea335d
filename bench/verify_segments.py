"""What a verify that runs each row at its own length would save: one padded call against segments.

Today a step whose rows draft different depths verifies every row at the deepest one
(engine/step.py): a row that drafts nothing still pays 1 + depth positions of the forward and
of the output layer. This bench times, on the loaded model, for batches where `plain` rows draft
nothing and `drafting` rows draft `--depth` tokens:

1. `padded`: one verify call [plain + drafting, 1 + depth] (what the engine runs);
2. `two_calls`: a decode call [plain, 1] and a verify call [drafting, 1 + depth];
3. `segmented`: one forward over both as segments, then sampling for the plain rows and
   verification for the drafting rows: the engine's segmented verify (engine/segments.py).

Each is the median of `--repeats` timed runs after two untimed ones, interleaved per batch so
that a noisy machine affects all three alike. The engine runs segmented verifies for a small
set of shapes (engine/segments.py, `crossover serve --segment-rows`): each (plain, drafting,
depth, context) is an executable of its own (~30-40 MiB and ~440 memory mappings each on
XLA:CPU, engine/loader.py). Here every split runs at its exact row counts.
tests/bench/test_verify_segments.py checks that the segmented call gives each row the padded
call's tokens and acceptance.

    python -m bench.verify_segments --out bench/results/verify-segments/depth4.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.progress import Steps
from engine.runner import CallArrays, ModelRunner, RunnerConfig
from engine.segments import run_segmented

SPLITS = ((2, 2), (3, 3), (4, 4), (6, 2), (2, 6))
"""(plain rows, drafting rows) timed by default: batches 4-8, the mid-load range."""


def fill(c: CallArrays, tokens: np.ndarray, context: int, first_page: int, pages_per_row: int) -> CallArrays:
    """Rows of `c` at `context` cached tokens with `tokens` [B, n] new, on distinct pages."""
    B, n = tokens.shape
    c.tokens[:, :n] = tokens
    c.start[:], c.n_new[:] = context, n
    for i in range(B):
        base = first_page + i * pages_per_row
        c.global_table[i] = base + np.arange(c.global_table.shape[1])
        c.local_table[i] = base + np.arange(c.local_table.shape[1])
    c.counter[:] = context + np.arange(c.counter.shape[1])
    return c


def _median_ms(fn, repeats: int) -> float:
    fn(), fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(1e3 * float(np.median(times)), 2)


def measure(runner: ModelRunner, splits, depth: int, context: int, repeats: int, progress=True) -> list[dict]:
    """The three timings of the module docstring per (plain, drafting) split."""
    rng = np.random.default_rng(0)
    T, per_row = 1 + depth, runner.rc.max_context // runner.rc.page_size
    out = []
    with Steps(progress, "verify segments", len(splits)) as bar:
        for plain, drafting in splits:
            B = plain + drafting
            draft = lambda b: rng.integers(100, 20000, (b, T)).astype(np.int32)  # noqa: E731
            padded = fill(runner.new_verify_call(B, depth, context + T), draft(B), context, 1, per_row)
            alone = fill(runner.new_call(plain, 1, context + 1), draft(plain)[:, :1], context, 1, per_row)
            verify = fill(runner.new_verify_call(drafting, depth, context + T), draft(drafting), context,
                          1 + plain * per_row, per_row)
            whole = fill(runner.new_call(B, 1, context + 1), draft(B)[:, :1], context, 1, per_row)
            cand = lambda c: np.full(c.tokens.shape, -1, np.int32)  # noqa: E731
            runs = {
                "padded": lambda: runner.run_verify(padded, cand(padded)),
                "two_calls": lambda: (runner.run(alone), runner.run_verify(verify, cand(verify))),
                "segmented": lambda: run_segmented(runner, alone, verify, cand(verify)),
                "plain_decode": lambda: runner.run(whole),  # every row decoding, for scale
            }
            ms = {k: _median_ms(f, repeats) for k, f in runs.items()}
            out.append({"plain_rows": plain, "drafting_rows": drafting, "depth": depth, "context": context,
                        "ms": ms, "segmented_over_padded": round(ms["segmented"] / ms["padded"], 3),
                        "two_calls_over_padded": round(ms["two_calls"] / ms["padded"], 3)})
            bar.advance()
    return out


def runner_for(cfg, params, max_batch: int, depth: int, max_context: int) -> ModelRunner:
    """A runner with every batch size up to max_batch (no padding to a bucket), one context,
    pages for max_batch rows, and the engine's CPU output scoring (RunnerConfig.fast_output)."""
    pages = max_batch * (max_context // 16) + 1
    rc = RunnerConfig(page_size=16, batch_buckets=tuple(range(1, max_batch + 1)), prefill_buckets=(32,),
                      context_buckets=(max_context,), global_pages=pages, local_pages=pages,
                      verify_tokens=(1 + depth,), spec_max_batch=max_batch,
                      fast_output=params["embed"].dtype == jnp.float32 and jax.default_backend() == "cpu")
    return ModelRunner(cfg, params, rc)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="JSON output file")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--context", type=int, default=300, help="cached tokens per row")
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args(argv)
    from engine.loader import default_dtype
    from engine.weights import load_model

    dtype = default_dtype()
    cfg, params = load_model(None, dtype, progress=True)
    runner = runner_for(cfg, params, max(p + d for p, d in SPLITS), args.depth, 1024)
    result = {"bench": "verify_segments", "model": cfg.name, "dtype": dtype, "backend": jax.default_backend(),
              "repeats": args.repeats, "splits": measure(runner, SPLITS, args.depth, args.context, args.repeats)}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
