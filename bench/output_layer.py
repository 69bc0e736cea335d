"""The output layer's product by orientation and table dtype, per number of rows.

Times h [n, d] against the model's tied embedding [V, d] (Gemma 3 270M: 262,144 x 640) for each
`--rows` n, interleaved, the median of `--repeats` runs: rows @ table.T in float32 and with a
bfloat16 copy of the table (what a float32 engine kept before engine.model.gemma.tied_logits), and
table @ rows.T then transposed (tied_logits: what runs now up to FEW_ROWS rows), in both
dtypes. Also says whether this CPU has bfloat16 units (engine.loader.cpu_has_bf16), which
decides whether the engine keeps the bfloat16 copy. Prints one JSON object.

    python -m bench.output_layer [--rows 1,4,16,32,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench import print_and_write


def measure(table: np.ndarray, rows: tuple[int, ...], repeats: int = 5) -> dict:
    """Median ms per (rows, variant) on `table` [V, d] float32."""
    import jax
    import jax.numpy as jnp

    from engine.model.gemma import tied_logits

    plain = jax.jit(lambda t, h: jnp.einsum("nd,vd->nv", h.astype(t.dtype), t,
                                            preferred_element_type=jnp.float32))
    tied = jax.jit(tied_logits)
    tables = {"float32": jnp.asarray(table), "bfloat16": jnp.asarray(table).astype(jnp.bfloat16)}
    variants = {f"{how} {dt}": (fn, tables[dt])
                for how, fn in (("rows @ table.T", plain), ("tied_logits", tied))
                for dt in tables}
    out = {}
    rng = np.random.default_rng(0)
    for n in rows:
        h = jnp.asarray(rng.standard_normal((n, table.shape[1])).astype(np.float32))
        times: dict[str, list[float]] = {k: [] for k in variants}
        for fn, t in variants.values():
            jax.block_until_ready(fn(t, h))
        for _ in range(repeats):
            for k, (fn, t) in variants.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(t, h))
                times[k].append((time.perf_counter() - t0) * 1e3)
        out[str(n)] = {k: round(float(np.median(v)), 1) for k, v in times.items()}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,32,64", help="comma-separated row counts")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", help="JSON output file")
    args = ap.parse_args(argv)
    try:
        rows = tuple(int(r) for r in args.rows.split(","))
    except ValueError:
        ap.error(f"--rows: {args.rows!r} is not a comma-separated list of integers")
    if min(rows) < 1:
        ap.error(f"--rows: {args.rows!r} holds a value below 1")
    from engine.loader import cpu_has_bf16
    from engine.model.weights import load_model

    _, params = load_model(None, "float32", progress=False)
    result = {"bench": "output_layer", "cpu_has_bf16": cpu_has_bf16(),
              "table": list(params["embed"].shape),
              "ms": measure(np.asarray(params["embed"]), rows, args.repeats)}
    return print_and_write(result, args.out)


if __name__ == "__main__":
    main()
