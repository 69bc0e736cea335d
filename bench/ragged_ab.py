"""The ragged forward (engine/model/ragged.py) against the padded [B, T] forward, in one process.

For each case (rows x new tokens after a cached context), both forwards run the same rows on
the same pools: the padded one as the runner calls it (forward, output scores at each row's
last token, KV write), the ragged one with the same outputs. Reports each one's best mean
step time over two rounds, their ratio (padded / ragged: above 1, ragged is faster), the
ragged forward's compile time and the padded call's first-call time (compile included).

    python -m bench.ragged_ab --out bench/results/engine-ragged/ab.json
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np

from bench.padded import forward_and_write
from engine.execute.runner import output_scores
from engine.memory.kv import Batch
from engine.model import ragged
from engine.model.gemma import ATTEND_BLOCK
from engine.runtime.progress import note

CASES = {  # name: (rows, new tokens per row, cached tokens per row, token slots, row slots)
    "decode_b1_ctx32": (1, 1, 32, 1, 1),
    "decode_b8_ctx32": (8, 1, 32, 8, 8),
    "decode_b32_ctx2048": (32, 1, 2048, 32, 32),
    "decode_b64_ctx2048": (64, 1, 2048, 64, 64),
    "verify_b8_depth4_ctx300": (8, 5, 300, 64, 8),
    "prefill_512": (1, 512, 0, 512, 64),
}
BLOCK = ATTEND_BLOCK
"""Cache slots the ragged forward reads per loop iteration: what the padded forward reads."""


def _timed(f, n: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def measure(engine, cases: dict[str, tuple], repeats: int = 10, progress=True) -> dict:
    """Each of `cases` (as CASES) timed both ways on the engine's runner (its params and pools; the
    pools' contents are overwritten): {case: {padded_ms, ragged_ms, ratio, ragged_compile_s,
    padded_first_call_s, ...}}."""
    r = engine.runner
    cfg, params, ring, ps = r.cfg, r.params, r.rc.ring_pages, r.kv.page_size
    width = r.rc.max_context // ps
    state = {"kv": r.kv}
    r.kv = None  # the calls below donate the pools; the newest go back at the end

    @partial(jax.jit, static_argnames=("cfg",))
    def run(cfg, params, kv, rb, rows):
        h, new_kv, _ = ragged.forward(cfg, params, kv, rb, block=BLOCK)
        return output_scores(params, h[rows][None]).best, new_kv

    @partial(jax.jit, donate_argnames=("kv",))
    def write(kv, rb, new_kv):  # apart from the reads: in one call XLA:CPU copies the whole pool
        return ragged.write(kv, rb, new_kv)

    def case(name: str, b: int, t: int, ctx: int, slots: int, row_slots: int) -> dict:
        need = -(-(ctx + t) // ps)
        if b * need >= state["kv"].global_k.shape[1] or need > width:
            raise ValueError(f"case {name} needs {b * need} global pages, {need} a row (at most "
                             f"{width}); the pool has {state['kv'].global_k.shape[1] - 1}")
        rows = [([5] * t, ctx, list(range(1 + i * need, 1 + (i + 1) * need)),
                 list(range(1 + i * ring, 1 + (i + 1) * ring))) for i in range(b)]
        rb = ragged.RaggedBatch.build(rows, slots, row_slots, width, ring)
        rb = jax.tree.map(np.asarray, rb)
        last = (np.arange(b) * t + t - 1).astype(np.int32)
        note(progress, f"ragged-ab: {name}: compiling")
        t0 = time.perf_counter()
        run.lower(cfg, params, state["kv"], rb, last).compile()
        compile_s = time.perf_counter() - t0

        gt, lt = np.zeros((b, width), np.int32), np.asarray([ring_ for _, _, _, ring_ in rows], np.int32)
        for i, (_, _, g, _) in enumerate(rows):
            gt[i, : len(g)] = g
        full = lambda value: np.full(b, value, np.int32)
        batch = Batch(np.full((b, t), 5, np.int32), full(ctx), full(t), gt, lt)
        logit_idx = np.full((b, 1), t - 1, np.int32)

        def padded():
            state["kv"], sc, _ = forward_and_write(cfg, ring, params, state["kv"], batch, logit_idx)
            np.asarray(sc.best)

        def ragged_call():
            best, new_kv = run(cfg, params, state["kv"], rb, last)
            state["kv"] = write(state["kv"], rb, new_kv)
            np.asarray(best)

        t0 = time.perf_counter()
        padded()
        first_s = time.perf_counter() - t0
        n = max(1, repeats // 3) if b * t >= 256 else repeats
        note(progress, f"ragged-ab: {name}: timing {n} calls of each, two rounds")
        pad_ms = min(_timed(padded, n) for _ in range(2))
        rag_ms = min(_timed(ragged_call, n) for _ in range(2))
        result = {"rows": b, "new_tokens": t, "context": ctx, "padded_ms": round(pad_ms, 2),
                  "ragged_ms": round(rag_ms, 2), "ratio": round(pad_ms / rag_ms, 3),
                  "ragged_compile_s": round(compile_s, 1), "padded_first_call_s": round(first_s, 1)}
        note(progress, f"ragged-ab: {name}: {json.dumps(result)}")
        return result

    try:
        return {name: case(name, *spec) for name, spec in cases.items()}
    finally:
        r.kv = state["kv"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ragged_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="JSON output file")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--repeats", type=int, default=10, help="calls timed per round (a third for large cases)")
    ap.add_argument("--kv-gib", type=float, default=3.0, help="KV pool budget (batch 64 at 2,048 needs ~3)")
    args = ap.parse_args(argv)
    names = [c for c in args.cases.split(",") if c]
    bad = [c for c in names if c not in CASES]
    if bad or not names or args.repeats < 1:
        ap.error(f"--cases {args.cases!r}: unknown {bad}" if bad or not names
                 else f"--repeats {args.repeats}")
    from engine.loader import load_engine

    engine = load_engine(dtype="float32", max_batch=64, max_context=4096, speculation=False,
                         kv_budget_bytes=int(args.kv_gib * (1 << 30)))
    cases = measure(engine, {n: CASES[n] for n in names}, args.repeats)
    result = {"backend": jax.default_backend(), "block": BLOCK, "cases": cases}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
