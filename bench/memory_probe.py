"""Where the serving process's memory goes: RSS at steady state, and per compiled shape.

Two measurements, each in a process of its own (XLA flags are read once, at start):

1. `serving`: load the engine as `crossover serve` does (default settings, staged warmup),
   wait until the background warmup has compiled every shape, trim the heap, and report
   the process's RSS against the acceptance formula of issue 17
   (RSS <= weights + KV budget + 1.5 GiB) with a breakdown: weights, the bfloat16 output
   copy, the KV pool, the proposers' resident bytes (by their bytes), the Python/JAX runtime
   (RSS before loading), and by difference the rest: compiled executables and what JAX keeps
   of them, the tokenizer, allocator slack. (The KV pool's pages turn resident during warmup,
   so RSS right after loading is no guide to the arrays.)
2. `executables`: compile the serving runner's ragged forward (and its KV write) at token
   counts one at a time and report the RSS and memory mappings each adds (under the XLA_FLAGS
   given), to see what one compiled forward costs on the host, with or without JAX's lowerings
   kept.

    python -m bench.memory_probe serving [--model M] [--max-batch 32] ...
    XLA_FLAGS=... python -m bench.memory_probe executables [--tokens 1,2,4] [--release]

Each prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MiB, GiB = 1 << 20, 1 << 30
HEADROOM = 3 * GiB // 2
"""What issue 17 allows beyond weights and the KV budget."""


def process_memory() -> dict:
    """RSS of this process split by kind (Linux /proc/self/smaps): anonymous, file-backed and
    shared memory, in bytes, and the number of memory mappings."""
    out = {"rss": 0, "anon": 0, "file": 0, "mappings": 0}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                out["mappings"] += 1
            elif head == "Rss:":
                out["rss"] += int(line.split()[1]) * 1024
            elif head == "Anonymous:":
                out["anon"] += int(line.split()[1]) * 1024
    out["file"] = out["rss"] - out["anon"]
    return out


_by_function: dict[str, int] = {}
_listening: list[bool] = []


def _count_compiles() -> None:
    """Count executables compiled or loaded per jitted function from here on (the backend-compile
    event fires once per executable, a persistent-cache hit included)."""
    import jax

    def on_event(name: str, _secs: float, fun_name: str = "?", **_kw) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            fun = fun_name[4:-1] if fun_name.startswith("jit(") else fun_name
            _by_function[fun] = _by_function.get(fun, 0) + 1

    _by_function.clear()
    if not _listening:
        jax.monitoring.register_event_duration_secs_listener(on_event)
        _listening.append(True)


def _settle() -> dict:
    import gc

    from engine.runtime.compiles import trim_heap

    gc.collect()
    trim_heap()
    return process_memory()


def _tree_bytes(tree) -> int:
    import jax

    return int(sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(tree)))


def serving(model: str | None = None, max_batch: int = 32, max_context: int = 4096,
            kv_budget_bytes: int | None = None, speculation: bool = True, wait_s: float = 3600.0,
            progress: bool = False, load=None, requests: int = 8, keep_lowerings: bool = False) -> dict:
    """Load and warm the engine as `crossover serve` does; the memory report once the background
    warmup has ended (see the module docstring). `load`: a function returning the (unwarmed,
    background-warmup) EngineCore instead of engine.loader.load_engine with these settings.
    `requests`: greedy requests served once the warmup has ended (so the weights' pages are
    touched as in serving) before the steady-state figures are taken.
    `keep_lowerings`: the warmup keeps JAX's lowerings (engine.runtime.compiles.drop_lowering made
    a no-op), to measure what dropping them saves."""
    from engine.runtime.compiles import compile_count, limit_malloc_arenas

    limit_malloc_arenas(2)  # as daemon/lifecycle.py does before XLA starts its threads
    import jax

    import engine.runtime.compiles

    if keep_lowerings:
        engine.runtime.compiles.drop_lowering = lambda lowered: False

    _count_compiles()
    jax.devices()
    runtime = _settle()
    if load is None:
        from engine.loader import load_engine

        def load():
            return load_engine(model=model, max_batch=max_batch, max_context=max_context,
                               kv_budget_bytes=kv_budget_bytes, speculation=speculation,
                               background_warmup=True, progress=progress)

    t0 = time.perf_counter()
    core = load()
    loaded = _settle()
    before = compile_count()
    core.warmup(progress=progress)
    ready_s = time.perf_counter() - t0
    at_ready = _settle()
    finished = core.spec_warmup.join(wait_s)
    steady_s = time.perf_counter() - t0
    _traffic(core, requests)
    steady = _settle()
    runner = core.runner
    params = dict(runner.params)
    fast = params.pop("embed_fast", None)
    weights = _tree_bytes(params)
    fast_bytes = 0 if fast is None else int(fast.nbytes)
    kv = _tree_bytes(runner.kv)
    proposers = sum(int(p.resident_bytes()) for p in core.proposers.values() if hasattr(p, "resident_bytes"))
    budget = int(getattr(core, "budget_bytes", None) or kv)
    limit = weights + budget + HEADROOM
    return {
        "settings": {"model": model, "max_batch": max_batch, "max_context": max_context,
                     "kv_budget_bytes": budget, "speculation": speculation},
        "warmup_finished": finished, "ready_s": round(ready_s, 1), "steady_s": round(steady_s, 1),
        "executables": compile_count() - before, "compiles_while_serving": core.compiles_since_warmup(),
        "by_function": dict(sorted(_by_function.items())),
        "techniques": core.spec_warmup.status(), "lowerings_kept": keep_lowerings,
        "max_context": runner.rc.max_context,
        "rss_runtime": runtime["rss"], "rss_loaded": loaded["rss"], "rss_ready": at_ready["rss"],
        "rss_steady": steady["rss"], "mappings_steady": steady["mappings"],
        "limit": limit, "meets_limit": steady["rss"] <= limit, "margin": limit - steady["rss"],
        "breakdown": {  # parts of rss_steady: the arrays by their bytes, the rest by difference
            "python_jax_runtime": runtime["rss"],
            "weights": weights, "bf16_output_copy": fast_bytes, "kv_pool": kv,
            "proposers_resident": proposers,
            "executables_and_rest": steady["rss"] - runtime["rss"] - weights - fast_bytes - kv - proposers,
        },
        "anon": steady["anon"], "file_backed": steady["file"],
    }


def _traffic(core, n: int) -> None:
    """Serve `n` greedy requests of different prompt lengths to the end."""
    from engine.types import Request, SamplingParams

    vocab, room = core.cfg.vocab_size, core.runner.rc.max_context - 16
    for i in range(n):
        ids = [(7 * i + 13 * j) % (vocab - 3) + 3 for j in range(max(1, min(5 + 40 * i, room - 1)))]
        core.add_request(Request(f"probe{i}", ids, SamplingParams(max_tokens=16)))
    while core.has_work():
        core.step()


def executables(tokens: list[int], model: str | None = None, drop: bool = False, release: bool = False,
                runner=None) -> dict:
    """Compile the ragged forward (+ KV write) at each token count of `tokens` in turn; RSS and
    mappings after each. The runner is the serving engine's at default settings (so its calls
    hit the persistent compilation cache), or `runner`.
    `drop`: clear JAX's in-memory caches after the last compile (what that gives back).
    `release`: drop each compiled computation's StableHLO module (engine.runtime.compiles.drop_lowering);
    without it the lowerings are kept, to measure what dropping them saves."""
    import jax

    import engine.runtime.compiles
    from engine.execute.ragged_calls import compile_jobs

    if not release:
        engine.runtime.compiles.drop_lowering = lambda lowered: False
    if runner is None:
        from engine.loader import load_engine

        runner = load_engine(model=model, progress=False).runner
    rows = [{"tokens": 0, **_settle()}]
    for n in tokens:
        t = time.perf_counter()
        forwards, _ = compile_jobs(runner, n, 1)
        forwards[-1]()  # the bucket holding n (the smaller ones are other shapes)
        seconds = round(time.perf_counter() - t, 2)
        rows.append({"tokens": n, "seconds": seconds, **_settle()})
    out = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows,
           "per_shape_rss": (rows[-1]["rss"] - rows[1]["rss"]) / max(1, len(rows) - 2),
           "first_shape_rss": rows[1]["rss"] - rows[0]["rss"]}
    if drop:
        jax.clear_caches()
        out["after_clear_caches"] = _settle()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory_probe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("serving")
    s.add_argument("--model")
    s.add_argument("--max-batch", type=int, default=32)
    s.add_argument("--max-context", type=int, default=4096)
    s.add_argument("--kv-budget", type=int)
    s.add_argument("--no-speculation", action="store_true")
    s.add_argument("--progress", action="store_true")
    s.add_argument("--requests", type=int, default=8, help="requests served before the steady figures")
    s.add_argument("--keep-lowerings", action="store_true",
                   help="keep JAX's lowerings of the compiled shapes (engine.runtime.compiles.drop_lowering "
                        "not called)")
    e = sub.add_parser("executables")
    e.add_argument("--model")
    e.add_argument("--tokens", default="1,2,4", help="token counts, comma-separated")
    e.add_argument("--drop", action="store_true")
    e.add_argument("--release", action="store_true")
    args = p.parse_args(argv)
    if args.what == "serving":
        out = serving(args.model, args.max_batch, args.max_context, args.kv_budget, not args.no_speculation,
                      progress=args.progress, requests=args.requests, keep_lowerings=args.keep_lowerings)
    else:
        out = executables([int(n) for n in args.tokens.split(",") if n], args.model, args.drop, args.release)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
