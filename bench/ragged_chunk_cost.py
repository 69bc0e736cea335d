"""What a prefill chunk costs a ragged call, by how much cache its row already holds.

Loads the engine as `crossover serve` does (plain decoding), then times ragged calls
(engine/ragged_calls.py) on rows laid over arbitrary pool pages (what they write is never read):
4 decode rows at a short context alone, with a 16-token chunk of a row that has 0 / 500 / 1000
/ 1900 tokens cached, the chunk alone, one decode row at 1900 alone and beside the 4. Each
case is the fastest of `--repeats` runs after one untimed run. Prints one JSON object.

    python -m bench.ragged_chunk_cost [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


STARTS = (0, 500, 1000, 1900)
"""Tokens cached before the chunk, and (the last) before the long decode row."""


def measure(engine, starts: tuple[int, ...] = STARTS, repeats: int = 3) -> dict:
    """Milliseconds per case (module docstring) on `engine` (an EngineCore, warmed up)."""
    from engine.ragged_calls import RaggedRow, new_call, run, table_width

    runner, rc = engine.runner, engine.runner.rc
    width = table_width(rc)

    def row(tokens: int, start: int, first_page: int) -> RaggedRow:
        pages = (np.arange(first_page, first_page + width, dtype=np.int32) % (rc.global_pages - 1)) + 1
        ring = np.arange(1, rc.ring_pages + 1, dtype=np.int32)
        return RaggedRow((5,) * tokens, start, pages, ring, ring)

    def timed(rows: list[RaggedRow]) -> float:
        run(runner, new_call(runner, rows))
        best = float("inf")
        for _ in range(repeats):
            call = new_call(runner, rows)
            t0 = time.perf_counter()
            run(runner, call)
            best = min(best, time.perf_counter() - t0)
        return round(best * 1e3, 1)

    short, last = min(60, starts[-1]), starts[-1]
    decode = [row(1, short, 300 + 10 * i) for i in range(4)]
    out = {f"4 decode rows at {short}": timed(decode)}
    for start in starts:
        out[f"4 decode rows + a 16-token chunk after {start}"] = timed(decode + [row(16, start, 1)])
    out[f"a 16-token chunk after {last} alone"] = timed([row(16, last, 1)])
    out[f"1 decode row at {last} alone"] = timed([row(1, last, 1)])
    out[f"4 decode rows + 1 decode row at {last}"] = timed(decode + [row(1, last, 1)])
    return {"bench": "ragged_chunk_cost", "max_batch": rc.max_batch, "max_context": rc.max_context,
            "ms": out}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output file")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from engine.loader import load_engine

    engine = load_engine(max_batch=32, max_context=4096, progress=False, speculation=False)
    engine.warmup(progress=False)
    result = measure(engine, repeats=args.repeats)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
