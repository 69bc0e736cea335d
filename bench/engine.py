"""`crossover bench engine`: decode/prefill throughput against the memory roofline.

Everything is measured in one run, so ratios are meaningful on a noisy machine:
1. Memory bandwidth: an XLA copy (read + write) and an XLA reduction (read)
   over 512 MiB; the larger figure is the roofline bandwidth.
2. Decode tokens/s per batch size at each prompt length (`contexts`): B
   identical-length requests, greedy, ignore EOS; only steps that did no
   prefill count. The first context's figures are `decode` (what
   `bench serve --engine-rates` reads); all are under `decode_by_context`.
3. Prefill tokens/s on one long prompt.
4. Peak RSS, weight bytes read per decode step, roofline fraction at batch 1,
   minor page faults per decode step (scratch buffers the allocator hands
   back to the OS after a call are faulted in again by the next), and the
   compiled executables and memory mappings of the warmed-up engine.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from engine.runtime.allocator import allocator_settings
from engine.runtime.compiles import memory_mappings
from engine.runtime.progress import Steps
from engine.types import Request, SamplingParams


def memory_bandwidth(nbytes: int = 512 << 20, reps: int = 5) -> dict:
    """Best-of-reps bandwidth of an XLA copy and an XLA read (bytes/s)."""
    x = jnp.ones(nbytes // 4, jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    read = jax.jit(lambda a: jnp.sum(a))
    out = {}
    for name, fn, moved in (("copy", copy, 2 * nbytes), ("read", read, nbytes)):
        fn(x).block_until_ready()
        best = min(_timed(lambda: fn(x).block_until_ready()) for _ in range(reps))  # noqa: B023
        out[f"{name}_bytes_per_s"] = moved / best
    out["roofline_bytes_per_s"] = max(out["copy_bytes_per_s"], out["read_bytes_per_s"])
    return out


def run_each_shape_once(engine, progress=None) -> None:
    """Run each compiled shape once (engine/warmup/first_runs.py) before a benchmark times any: a
    shape's first execution costs 100-400 ms more than later ones. The fake engine has none."""
    runs = getattr(engine, "first_runs", None)
    if runs is not None:
        runs.run_all(progress)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


SHARED_TAIL = 16
"""Prompts longer than 4x this share all but their last SHARED_TAIL tokens, so the prefix cache
prefills a long context once for every batch size (decode reads each row's pages all the same)."""


def _decode_prompt(tok, n: int, salt: int) -> list[int]:
    """`_prompt`, sharing all but the last SHARED_TAIL tokens when n > 4 * SHARED_TAIL."""
    if n > 4 * SHARED_TAIL:
        return _prompt(tok, n - SHARED_TAIL, 0) + _prompt(tok, SHARED_TAIL, salt)
    return _prompt(tok, n, salt)


def _prompt(tok, n: int, salt: int) -> list[int]:
    """A deterministic prompt of exactly n tokens (n >= 2): 2n words, each a token or more."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
    text = " ".join(words[(i * 7 + salt) % len(words)] for i in range(n * 2))
    return tok.encode(text)[:n]


def minor_faults() -> int:
    """Minor page faults of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def decode_throughput(engine, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Decode tokens/s with `batch` concurrent greedy requests of `prompt_len` prompt tokens, and
    the minor page faults per decode step."""
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(Request(f"b{batch}-{i}", _decode_prompt(engine.tokenizer, prompt_len, i), sp))
    tokens, ms, steps, faults = 0, 0.0, 0, 0
    while engine.has_work():
        before = minor_faults()
        st = engine.step().stats
        if st and st.prefill_tokens == 0 and st.batch_size == batch:
            tokens += st.decode_tokens
            ms += st.step_ms
            steps += 1
            faults += minor_faults() - before
    if not steps:  # the pool never held `batch` such sequences at once
        return {"batch": batch, "context": prompt_len, "tokens_per_s": None, "step_ms": None, "steps": 0,
                "minor_faults_per_step": None}
    return {"batch": batch, "context": prompt_len, "tokens_per_s": tokens / (ms / 1e3),
            "step_ms": ms / steps, "steps": steps, "minor_faults_per_step": faults / steps}


def prefill_throughput(engine, prompt_len: int, repeats: int = 3) -> dict:
    """Prefill tokens/s of one prompt of `prompt_len` tokens: the best of `repeats` different
    prompts (one ~0.1-0.6 s timing alone varies by a third on a shared machine), each
    prefilled whole (a prefix cache cannot serve one from another: they differ from the first
    word)."""
    best = 0.0
    for r in range(repeats):
        prompt = _prompt(engine.tokenizer, prompt_len, 3 + r)
        engine.add_request(Request(f"prefill-{r}", prompt, SamplingParams(max_tokens=1)))
        tokens, ms = 0, 0.0
        while engine.has_work():
            st = engine.step().stats
            if st:
                tokens += st.prefill_tokens
                ms += st.step_ms
        best = max(best, tokens / (ms / 1e3))
    return {"prompt_tokens": prompt_len, "tokens_per_s": best, "repeats": repeats}


def weight_bytes(params) -> int:
    """Bytes of weights one decode step streams (all of them; the tied table twice is not counted)."""
    return int(sum(a.nbytes for a in jax.tree.leaves(params)))


def run_bench(out_path: str | None, model: str | None = None, dtype: str | None = None,
              batches=(1, 2, 4, 8, 16, 32, 64), contexts=(32, 2048), new_tokens: int = 32,
              prefill_len: int = 512, hf_baseline: str | None = None, tensor_parallel: int = 1,
              max_context: int = 4096, kv_budget_bytes: int | None = None,
              weights: str | None = None) -> dict:
    from daemon.progress import reporter, say
    from engine.loader import load_engine

    log = lambda msg: say(f"bench engine: {msg}")
    progress = reporter()
    engine = load_engine(model=model, dtype=dtype, weights=weights, max_batch=max(batches),
                         max_context=max_context,
                         kv_budget_bytes=kv_budget_bytes,
                         speculation=False, progress=progress,
                         **({"tensor_parallel": tensor_parallel} if tensor_parallel > 1 else {}))
    log("measuring memory bandwidth")
    bw = memory_bandwidth()
    log("warming up (compiles every bucket once; cached on disk for the next run)")
    engine.warmup(progress=progress)
    run_each_shape_once(engine, progress)
    wbytes = weight_bytes(engine.runner.params)
    by_context = {}
    with Steps(progress, "bench engine: decode batch sizes", len(batches) * len(contexts)) as bar:
        for c in contexts:
            rows = by_context[str(c)] = []
            for b in batches:
                r = decode_throughput(engine, b, c, new_tokens)
                log(f"context {c:5d} batch {b:3d}: " + (
                    "never held that many such sequences at once (a larger --kv-gib fits them)"
                    if r["tokens_per_s"] is None else f"{r['tokens_per_s']:8.1f} tok/s ({r['step_ms']:.1f} "
                    f"ms/step, {r['minor_faults_per_step']:.0f} minor faults/step)"))
                rows.append(r)
                bar.advance()
    decode = by_context[str(contexts[0])]
    prefill = prefill_throughput(engine, prefill_len)
    log(f"prefill: {prefill['tokens_per_s']:.0f} tok/s")
    by_b = {r["batch"]: r["tokens_per_s"] or float("nan") for r in decode}
    roof_tps = bw["roofline_bytes_per_s"] / wbytes
    result = {
        "model": engine.model_name, "dtype": engine.runner.rc.dtype,
        "weights": engine.weights_form, "backend": jax.default_backend(),
        "decode": decode, "decode_by_context": by_context, "max_context": max_context, "prefill": prefill,
        "weight_bytes_per_decode_step": wbytes, "memory": bw,
        "roofline_tokens_per_s_batch1": roof_tps,
        "roofline_fraction_batch1": by_b.get(1, float("nan")) / roof_tps,
        "speedup_batch32_over_batch1": by_b.get(32, float("nan")) / by_b.get(1, float("nan")),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "compiles_since_warmup": engine.compiles_since_warmup(),
        "executables": _executables(engine),
        "memory_mappings": memory_mappings(),
        "allocator": allocator_settings(),
        "tensor_parallel": tensor_parallel,
    }
    if hf_baseline and Path(hf_baseline).exists():
        result["vs_hf_transformers"] = _versus(by_b, json.loads(Path(hf_baseline).read_text()))
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(result, indent=2))
        log(f"wrote {out_path}")
    return result


def _executables(engine) -> dict | None:
    """The warmed-up engine's compiled forwards: one ragged forward per token bucket (None: the fake's)."""
    if getattr(engine, "runner", None) is None:
        return None
    from engine.execute.ragged_calls import token_buckets
    from engine.warmup.warm import max_tokens

    return {"full_forwards": len(token_buckets(max_tokens(engine)))}


def _versus(ours: dict[int, float], hf: dict) -> dict:
    """Our decode tokens/s over Hugging Face transformers' at each batch both measured."""
    theirs = {int(r["batch"]): float(r.get("decode_tok_s", r.get("tokens_per_s", 0)))
              for r in hf.get("decode", [])}
    return {str(b): ours[b] / theirs[b] for b in sorted(ours) if b in theirs and theirs[b] > 0}


if __name__ == "__main__":  # pragma: no cover
    run_bench(sys.argv[1] if len(sys.argv) > 1 else None)
