"""What a prefill chunk costs a ragged call, by how much cache its row already holds.

Loads the engine as `crossover serve` does (plain decoding), then times ragged calls
(engine/execute/ragged_calls.py) on rows laid over arbitrary pool pages (what they write is never read):
4 decode rows at a short context alone, with a 16-token (`--chunk-tokens`) chunk of a row that has 0 / 500 /
1000 / 1900 tokens cached, the chunk alone, one decode row at 1900 alone and beside the 4, and a
full batch of decode rows at 1900. Each case is the fastest of `--repeats` runs after one
untimed run. With `--chunks`, it also times each case's forward alone at each number of query
groups read together (engine/model/ragged.py CHUNK; 512 reads every group slot of a call in one pass,
however few are real), in the same process. Prints one JSON object.

    python -m bench.ragged_chunk_cost [--chunks 4,512] [--chunk-tokens 8 16 28] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench import print_and_write

STARTS = (0, 500, 1000, 1900)
"""Tokens cached before the chunk, and (the last) before the long decode row."""


def measure(engine, starts: tuple[int, ...] = STARTS, repeats: int = 3, chunks: tuple[int, ...] = (),
            chunk_tokens: tuple[int, ...] = (16,)) -> dict:
    """Milliseconds per case (module docstring) on `engine` (an EngineCore, warmed up), and per
    case and chunk the forward alone for each of `chunks`; the prompt chunks beside the decode
    rows are `chunk_tokens` long."""
    from functools import partial

    import jax

    from engine.execute.ragged_calls import RaggedRow, new_call, run, table_width
    from engine.model import ragged

    runner, rc = engine.runner, engine.runner.rc
    width = table_width(rc)

    def row(tokens: int, start: int, first_page: int) -> RaggedRow:
        pages = (np.arange(first_page, first_page + width, dtype=np.int32) % (rc.global_pages - 1)) + 1
        ring = np.arange(1, rc.ring_pages + 1, dtype=np.int32)
        return RaggedRow((5,) * tokens, start, pages, ring, ring)

    def timed(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return round(best * 1e3, 1)

    @partial(jax.jit, static_argnames=("cfg", "chunk"))
    def forward(cfg, params, kv, rb, chunk):
        return ragged.forward(cfg, params, kv, rb, chunk=chunk)[:2]

    short, last = min(60, starts[-1]), starts[-1]
    decode = [row(1, short, 300 + 10 * i) for i in range(4)]
    cases = {f"4 decode rows at {short}": decode}
    for n in chunk_tokens:
        for start in starts:
            cases[f"4 decode rows + a {n}-token chunk after {start}"] = decode + [row(n, start, 1)]
    cases[f"a 16-token chunk after {last} alone"] = [row(16, last, 1)]
    cases[f"1 decode row at {last} alone"] = [row(1, last, 1)]
    cases[f"4 decode rows + 1 decode row at {last}"] = decode + [row(1, last, 1)]
    cases[f"{rc.max_batch} decode rows at {last}"] = [row(1, last, 1 + 3 * i) for i in range(rc.max_batch)]
    out = {name: timed(lambda: run(runner, new_call(runner, rows))) for name, rows in cases.items()}  # noqa: B023
    by_chunk = {}
    for name, rows in cases.items():
        rb = new_call(runner, rows).batch
        by_chunk[name] = {c: timed(lambda: jax.block_until_ready(
            forward(runner.cfg, runner.params, runner.kv, rb, c))) for c in chunks}  # noqa: B023
    return {"bench": "ragged_chunk_cost", "max_batch": rc.max_batch, "max_context": rc.max_context,
            "chunk": ragged.CHUNK, "ms": out, **({"forward_ms_by_chunk": by_chunk} if chunks else {})}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output file")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-tokens", type=int, nargs="+", default=[16], help="prompt chunk lengths")
    ap.add_argument("--chunks", default="", help="comma-separated query groups read together, e.g. 4,512")
    args = ap.parse_args(argv)
    try:
        chunks = tuple(int(c) for c in args.chunks.split(",") if c.strip())
    except ValueError:
        ap.error(f"--chunks: {args.chunks!r} is not a comma-separated list of integers")
    if any(c < 1 for c in chunks):
        ap.error(f"--chunks: {args.chunks!r} holds a value below 1")
    from engine.loader import load_engine

    engine = load_engine(max_batch=32, max_context=4096, progress=False, speculation=False)
    engine.warmup(progress=False)
    if min(args.chunk_tokens) < 1:
        ap.error(f"--chunk-tokens: {min(args.chunk_tokens)} is below 1")
    result = measure(engine, repeats=args.repeats, chunks=chunks, chunk_tokens=tuple(args.chunk_tokens))
    return print_and_write(result, args.out)


if __name__ == "__main__":
    main()
