"""The quantized matmul (engine/quant) against float32 on the default model's own matrices.

    python -m bench.quant_matmul [--rows 1,4,8,16,32,64] [--reps 7] [--what layers,head,greedy]

Two workloads, each one jitted call:
- layers: the 18 layers' projections as the engine fuses them (qkv [640, 1536] where q, k and v
  share a block type, else the three apart; o [1024, 640], gate_up [640, 4096], down [2048, 640])
  applied to M rows each;
- head: the tied 262144 x 640 output layer (Q8_0 embedding), x [M, 640] -> [M, 262144];
- greedy: each row's greedy token from that layer, the kernel's logits and their argmax against
  the screen (`qgreedy`: exact logits at the few candidate columns alone).

Paths: f32 (today's float32 weights, `x @ W`), ffi (the kernel, every ISA this CPU runs, plus
one thread where the pool has more, plus its software prefetch off: "-no-prefetch"; the screen
likewise), jnp (dequantize then dot inside the jit). Each repetition
times every path once, in turn, so load on the shared machine hits them alike; the JSON on
stdout has each path's median and spread (min, max) in milliseconds and the ratio to f32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.cpu import cpu_flags, cpu_model
from engine.model.gguf_file import GGUFFile, default_gguf_path
from engine.quant import matmul as qm
from engine.quant.formats import QuantWeight, concat_columns, dequantize, from_gguf
from engine.runtime.allocator import allocator_settings

LAYER_LEAVES = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",),
                "gate_up": ("ffn_gate", "ffn_up"), "down": ("ffn_down",)}


def _read(gf: GGUFFile, name: str) -> QuantWeight:
    t = gf.tensors[name]
    raw = np.fromfile(gf.path, np.uint8, count=t.nbytes, offset=t.offset)
    return from_gguf(raw, t.qtype.name, t.shape)


def _fused(ws: list[QuantWeight]) -> list[QuantWeight]:
    """One leaf where the parts agree on group, bits and scale dtype (as the engine fuses), else
    the parts apart."""
    try:
        return [concat_columns(ws)]
    except ValueError:
        return ws


def load_weights(gf: GGUFFile, what: list[str]) -> dict[str, list[QuantWeight]]:
    out: dict[str, list[QuantWeight]] = {}
    if "layers" in what:
        n_layers = int(gf.metadata["gemma3.block_count"])
        out["layers"] = [w for i in range(n_layers) for roles in LAYER_LEAVES.values()
                         for w in _fused([_read(gf, f"blk.{i}.{r}.weight") for r in roles])]
    if "head" in what:
        out["head"] = [_read(gf, "token_embd.weight")]
    return out


def _fn(path: str):
    def run(xs, ws):
        if path == "f32":
            return [jnp.dot(x, w, preferred_element_type=jnp.float32) for x, w in zip(xs, ws)]
        return [qm.qmatmul(x, w, path=path) for x, w in zip(xs, ws)]

    return jax.jit(run)


def _default_prefetch() -> int:
    """The kernel's prefetch distance as it stands (engine.quant.matmul.set_prefetch), unchanged."""
    now = qm.set_prefetch(0)
    qm.set_prefetch(now)
    return now


def _paths(prefetch: int) -> list[tuple[str, str, str | None, int, int]]:
    """(label, qmatmul path, ISA, threads, prefetch bytes) of each path timed; `prefetch`: the
    kernel's own distance, 0 on the "-no-prefetch" paths."""
    out = [("f32", "f32", None, 0, prefetch), ("jnp", "jnp", None, 0, prefetch)]
    for isa in qm.supported_isas():
        out += [(f"ffi-{isa}", "ffi", isa, 0, prefetch), (f"ffi-{isa}-1t", "ffi", isa, 1, prefetch),
                (f"ffi-{isa}-no-prefetch", "ffi", isa, 0, 0)]
    return out


def bench(weights: list[QuantWeight], rows: list[int], reps: int, seed: int = 0) -> dict:
    f32 = [jax.device_put(dequantize(w)) for w in weights]
    qw = [jax.tree.map(jax.device_put, w) for w in weights]
    prefetch = _default_prefetch()
    paths, fns = _paths(prefetch), {p: _fn(p) for p in ("f32", "jnp", "ffi")}
    rng = np.random.default_rng(seed)
    result = {}
    for m in rows:
        xs = [jnp.asarray(rng.standard_normal((m, w.shape[0])), jnp.float32) for w in weights]
        times: dict[str, list[float]] = {label: [] for label, *_ in paths}
        outs = {}
        for rep in range(reps + 1):  # repetition 0 compiles and warms
            for label, path, isa, threads, ahead in paths:
                if isa:
                    qm.set_isa(isa)
                    qm.set_threads(threads)
                    qm.set_prefetch(ahead)
                t0 = time.perf_counter()
                y = jax.block_until_ready(fns[path](xs, f32 if path == "f32" else qw))
                dt = time.perf_counter() - t0
                if rep:
                    times[label].append(dt * 1e3)
                else:
                    outs[label] = y
        qm.set_isa("best")
        qm.set_threads(0)
        qm.set_prefetch(prefetch)
        ref = outs["f32"]
        scale = max(float(jnp.abs(r).max()) for r in ref)
        row = {}
        for label, ts in times.items():
            err = max(float(jnp.abs(a - b).max()) for a, b in zip(outs[label], ref)) / scale
            row[label] = {"median_ms": round(statistics.median(ts), 3), "min_ms": round(min(ts), 3),
                          "max_ms": round(max(ts), 3), "max_rel_err_vs_f32": float(f"{err:.2e}")}
        base = row["f32"]["median_ms"]
        for r in row.values():
            r["x_f32"] = round(base / r["median_ms"], 2)
        result[str(m)] = row
        print(json.dumps({"rows": m, **{k: v["median_ms"] for k, v in row.items()}}), flush=True,
              file=sys.stderr)
    return result


def bench_greedy(table: QuantWeight, rows: list[int], reps: int, seed: int = 0) -> dict:
    """The greedy token of each row from the head: the kernel's logits then their argmax, against
    the screen that computes only candidate columns exactly (`qgreedy`); tokens must agree."""
    from engine.execute.sampling import greedy

    w = jax.tree.map(jax.device_put, table)
    screen, prefetch = jax.jit(qm.qgreedy), _default_prefetch()
    fns = {"ffi+argmax": jax.jit(lambda x, w: greedy(qm.qmatmul(x, w))),
           "screen": screen, "screen-no-prefetch": screen}  # the same call, prefetch off
    rng = np.random.default_rng(seed)
    result = {}
    for m in rows:
        x = jnp.asarray(rng.standard_normal((m, table.shape[0])) * 4, jnp.float32)
        times: dict[str, list[float]] = {k: [] for k in fns}
        toks = {}
        for rep in range(reps + 1):
            for label, fn in fns.items():
                qm.set_prefetch(0 if label.endswith("no-prefetch") else prefetch)
                t0 = time.perf_counter()
                toks[label] = np.asarray(jax.block_until_ready(fn(x, w)))
                if rep:
                    times[label].append((time.perf_counter() - t0) * 1e3)
        if not np.array_equal(toks["screen"], toks["ffi+argmax"]):
            raise AssertionError(f"rows {m}: the screen's tokens differ from the argmax of the logits")
        row = {k: {"median_ms": round(statistics.median(ts), 3), "min_ms": round(min(ts), 3),
                   "max_ms": round(max(ts), 3)} for k, ts in times.items()}
        qm.set_prefetch(prefetch)
        med = {k: v["median_ms"] for k, v in row.items()}
        row["screen"]["x_argmax"] = round(med["ffi+argmax"] / med["screen"], 2)
        row["screen"]["x_no_prefetch"] = round(med["screen-no-prefetch"] / med["screen"], 2)
        result[str(m)] = row
        print(json.dumps({"rows": m, **{k: v["median_ms"] for k, v in row.items()}}), flush=True,
              file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--what", default="layers,head")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    what = args.what.split(",")
    gf = GGUFFile.open(default_gguf_path())
    weights = load_weights(gf, [w for w in what if w != "greedy"])
    report = {
        "cpu": cpu_model(), "cpu_flags": cpu_flags(), "kernel": qm.kernel_status(),
        "allocator": allocator_settings(),
        "isas": qm.supported_isas(), "jax": jax.__version__, "reps": args.reps,
        "command": "python -m bench.quant_matmul " + " ".join(argv or sys.argv[1:]),
    }
    for name, ws in weights.items():
        report[name] = {
            "matrices": len(ws), "f32_bytes": sum(4 * w.shape[0] * w.shape[1] for w in ws),
            "quant_bytes": sum(w.nbytes for w in ws), "by_rows": bench(ws, rows, args.reps),
        }
    if "greedy" in what:
        report["greedy"] = {"by_rows": bench_greedy(_read(gf, "token_embd.weight"), rows, args.reps)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    from engine.runtime.allocator import restart_with_allocator_settings

    restart_with_allocator_settings()  # as the daemon runs: each call's output not page-faulted anew
    main()
