"""The quantized engine against the float32 one, in one process: greedy agreement and decode speed.

    python -m bench.quant_engine [--weights gguf] [--reps 5] [--memory] [--out FILE]

1. Two engines on the default model: float32, and `--weights` (gguf: the file's own blocks
   through the quantized-matmul kernel, engine/model/quant_weights.py).
2. Agreement: every case of the golden fixture (tests/fixtures/golden_270m.json) decodes
   greedily on both in one batch each; per case the first step where the two differ, the
   float32 top-1 margin there, and whether the golden (transformers) tokens agree up to their
   first near-tie. The largest logit difference: both params' logits over each case's prompt
   and float32 continuation (one ragged forward from an empty cache, the positions that
   predict the continuation), all vocabulary entries.
3. Speed: decode tokens/s at each batch size (bench.engine.decode_throughput: only steps that
   did no prefill), the two engines interleaved (order alternating) for `reps` rounds after an
   untimed round that compiles each shape; median, min and max per engine and the per-round
   ratio.
4. With `--llamacpp PYTHON` (a Python with llama_cpp, bench/README.md): each round also runs
   bench/llamacpp_baseline.py in a child process on the same GGUF, the batch-1 prompt ids and
   token count (the child exits between rounds, so its threads never share the CPU with the
   engines'); per-round ratios of each engine to it; then 512-token prefill on all three.
5. With `--memory`: /ready's memory block (engine.memory.budget.memory_status) of an engine
   loaded at `crossover serve`'s defaults (the default memory budget, every proposer, max batch
   32, context 4096) in float32 and in `--weights`, one engine at a time: the pool each form's
   weights leave and the tenants it holds at max context.
6. With `--screen-ab`: a third engine of `--weights` whose heads take greedy tokens from full
   logits, not the output table's screen (engine.quant.matmul.qgreedy), timed in the same
   rounds; the per-round ratio of `--weights` to it.
7. With `--ahead-ab`: likewise an engine of `--weights` that reads each plain decode step's tokens
   before it dispatches the next call (EngineConfig.decode_ahead off, engine/step/ahead.py).
8. With `--prefetch-ab`: the `--weights` engine again, timed with the kernel's software prefetch
   off (engine.quant.matmul.set_prefetch(0)) in the same rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.engine import decode_throughput
from engine.types import Request, SamplingParams

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "golden_270m.json"
TOP = 5
"""Top logprobs compared per decoded token."""
LOGIT_TOKENS = 1024
"""Token slots of the logit forward (every golden case's prompt and continuation fit)."""


def _decode(engine, requests: list[Request]) -> tuple[dict[str, list[int]], dict[str, list[dict]]]:
    """Every request in one batch until all finish: tokens per request id, and per token its top
    logprobs {id: logprob} (empty where a request asked none)."""
    for r in requests:
        engine.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    tops: dict[str, list[dict]] = {r.request_id: [] for r in requests}
    while engine.has_work():
        for ev in engine.step().events:
            got[ev.request_id] += ev.token_ids
            tops[ev.request_id] += [dict(t) for t in ev.top_logprobs or ()]
    return got, tops


def _greedy(engine, cases: list[dict]) -> tuple[dict[str, list[int]], dict[str, list[dict]]]:
    """Greedy tokens per case, all cases in one batch, and per token its top logprobs {id: logprob}."""
    return _decode(engine, [Request(c["name"], c["prompt_ids"], SamplingParams(
        max_tokens=len(c["generated_ids"]), ignore_eos=True, stop_token_ids=(1,), logprobs=True,
        top_logprobs=TOP)) for c in cases])


def _logprob_difference(a: list[dict], b: list[dict]) -> float:
    """Largest |logprob difference| over the top tokens both runs list at the same step."""
    return max((abs(x[i] - y[i]) for x, y in zip(a, b) for i in x.keys() & y.keys()), default=0.0)


@partial(jax.jit, static_argnames=("cfg",))
def _hidden(cfg, params, kv, rb):
    from engine.model import ragged

    return ragged.forward(cfg, params, kv, rb)[0]


@jax.jit
def _logits(params, h):
    from engine.model.gemma import tied_logits

    return tied_logits(params["embed"], h)


def _case_logits(engine, ids: list[int], at: np.ndarray) -> np.ndarray:
    """Logits [len(at), vocab] at flat positions `at` of `ids`, one forward from an empty cache."""
    from engine.execute.ragged_calls import table_width
    from engine.model.ragged import RaggedBatch

    rc, params = engine.runner.rc, engine.runner.params
    rb = RaggedBatch.build([(ids, 0, [0], [0])], LOGIT_TOKENS, 1, table_width(rc), rc.ring_pages)
    h = _hidden(engine.cfg, params, engine.runner.kv, jax.tree.map(np.asarray, rb))
    rows = np.zeros(64, np.int32)  # one shape for every case (each continuation is <= 64 tokens)
    rows[: len(at)] = at
    return np.asarray(_logits(params, h[jnp.asarray(rows)]))[: len(at)]


def agreement(ref, quant, golden: dict) -> dict:
    cases = golden["cases"]
    near_tie = golden["settings"]["near_tie_margin"]
    a, tops_a = _greedy(ref, cases)
    print("agreement: float32 decoded", flush=True)
    b, tops_b = _greedy(quant, cases)
    print("agreement: quantized decoded", flush=True)
    rows, worst, worst_lp = [], 0.0, 0.0
    for c in cases:
        name, n = c["name"], len(c["generated_ids"])
        ids = c["prompt_ids"] + a[name]
        at = np.arange(len(c["prompt_ids"]) - 1, len(ids) - 1, dtype=np.int32)
        la, lb = _case_logits(ref, ids, at), _case_logits(quant, ids, at)
        diff = float(np.max(np.abs(la - lb)))
        lp = _logprob_difference(tops_a[name], tops_b[name])
        worst, worst_lp = max(worst, diff), max(worst_lp, lp)
        top2 = np.sort(la, axis=1)[:, -2:]
        margins = (top2[:, 1] - top2[:, 0]).tolist()
        first = next((i for i in range(n) if a[name][i] != b[name][i]), None)
        ties = [i for i, m in enumerate(c["margins"]) if m < near_tie]
        upto = ties[0] if ties else n
        print(f"agreement: {name}: first difference {first}, max |logit difference| {diff:.2e}, "
              f"decoding's top-{TOP} logprobs {lp:.2e}", flush=True)
        rows.append({
            "case": name, "tokens": n, "first_difference": first,
            "float32_margin_there": None if first is None else margins[first],
            "smallest_float32_margin": min(margins), "max_abs_logit_difference": diff,
            "max_abs_decode_logprob_difference": lp,
            "golden_steps_compared": upto,
            "float32_equals_golden": a[name][:upto] == c["generated_ids"][:upto],
            "quantized_equals_golden": b[name][:upto] == c["generated_ids"][:upto],
        })
    return {"cases": rows, "identical_cases": sum(r["first_difference"] is None for r in rows),
            "max_abs_logit_difference": worst, "max_abs_decode_logprob_difference": worst_lp}


def llamacpp(python: str, argv: list[str]) -> dict:
    """bench/llamacpp_baseline.py's JSON from a child process of `python` (RuntimeError with its
    stderr when it fails)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([python, "-m", "bench.llamacpp_baseline", *argv], cwd=root, capture_output=True,
                          text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.llamacpp_baseline failed ({proc.returncode}): {proc.stderr[-2000:]}")
    print(proc.stderr.strip(), file=sys.stderr, flush=True)
    return json.loads(proc.stdout)


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def _ratios(name: str, xs: list[float]) -> dict:
    """_spread's median, min and max as `name`_median, ..._min, ..._max."""
    return {f"{name}_{k}": v for k, v in _spread(xs).items() if k != "runs"}


def _greedy_ids(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    got, _ = _decode(engine, [Request(f"sweep-{i}", ids, sp) for i, ids in enumerate(prompts)])
    return [got[f"sweep-{i}"] for i in range(len(prompts))]


def agreement_sweep(ref, quant, per_kind: int, tokens: int, near_tie: float) -> dict:
    """Greedy agreement over `per_kind` prompts of each workload kind (bench/crossover.py's draw,
    at most 512 prompt tokens) x `tokens` tokens: per prompt the first step where the two differ
    and float32's top-1 margin there (a near-tie below `near_tie`); the largest logit difference
    over every position that predicts a float32 token."""
    from bench.crossover import prompt_ids
    from bench.workloads import KINDS

    prompts = [ids for kind in KINDS for ids in prompt_ids(ref.tokenizer, kind, per_kind, 512, 0)[0]]
    a, b = _greedy_ids(ref, prompts, tokens), _greedy_ids(quant, prompts, tokens)
    worst, rows = 0.0, []
    for ids, x, y in zip(prompts, a, b):
        at = np.arange(len(ids) - 1, len(ids) + tokens - 1, dtype=np.int32)
        la, lb = _case_logits(ref, ids + x, at), _case_logits(quant, ids + x, at)
        worst = max(worst, float(np.max(np.abs(la - lb))))
        first = next((i for i in range(tokens) if x[i] != y[i]), None)
        top2 = np.sort(la[first], axis=-1)[-2:] if first is not None else None
        rows.append(None if first is None else {"first_difference": first,
                                                "float32_margin": float(top2[1] - top2[0])})
    differ = [r for r in rows if r is not None]
    print(f"agreement sweep: {len(rows) - len(differ)}/{len(rows)} identical, worst logit difference "
          f"{worst:.2e}", flush=True)
    return {"prompts": len(rows), "tokens": tokens, "identical": len(rows) - len(differ),
            "tokens_equal": sum(r["first_difference"] if r else tokens for r in rows),
            "differences": differ, "near_tie_margin": near_tie,
            "all_differences_near_ties": all(r["float32_margin"] < near_tie for r in differ),
            "max_abs_logit_difference": worst}


NO_PREFETCH = "-no-prefetch"
"""Suffix of an engine name timed with the kernel's software prefetch off (`--prefetch-ab`)."""


@contextlib.contextmanager
def _setting(name: str):
    """The kernel setting engine `name` runs under: its prefetch off for a NO_PREFETCH name."""
    if not name.endswith(NO_PREFETCH):
        yield
        return
    from engine.quant.matmul import set_prefetch

    before = set_prefetch(0)
    try:
        yield
    finally:
        set_prefetch(before)


def speed(engines: dict, batches: tuple[int, ...], reps: int, context: int, new_tokens: int,
          llama: str | None = None) -> dict:
    """Decode tok/s per engine and batch, interleaved over `reps` rounds; with `llama` (a Python
    with llama_cpp), llama.cpp's batch-1 decode on the same prompt in each round too."""
    import tempfile

    from bench.engine import _decode_prompt

    names = list(engines)
    for name in names:  # untimed: compiles each shape
        for b in batches:
            with _setting(name):
                decode_throughput(engines[name], b, context, new_tokens)
    runs: dict[str, dict[int, list[float]]] = {n: {b: [] for b in batches} for n in names}
    if llama:  # the child decodes the batch-1 prompt the engines decode
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as ids:
            json.dump(_decode_prompt(engines[names[0]].tokenizer, context, 0), ids)
        llama_argv = ["--repeats", "1", "--new-tokens", str(new_tokens - 1), "--prompt-ids", ids.name,
                      "--skip-prefill"]
        runs["llama.cpp"] = {1: []}
    for r in range(reps):
        for name in names if r % 2 == 0 else names[::-1]:
            for b in batches:
                with _setting(name):
                    rate = decode_throughput(engines[name], b, context, new_tokens)["tokens_per_s"]
                runs[name][b].append(rate)
        if llama:
            runs["llama.cpp"][1].append(llamacpp(llama, llama_argv)["decode"]["tokens_per_s"])
    if llama:
        Path(ids.name).unlink()
    out = {}
    ref, other = names[:2]
    for b in batches:
        ratio = [q / f for q, f in zip(runs[other][b], runs[ref][b])]
        out[str(b)] = {**{n: _spread(runs[n][b]) for n in runs if b in runs[n]},
                       **_ratios("ratio", ratio)}
        for n in names[2:]:
            vs = [q / f for q, f in zip(runs[other][b], runs[n][b])]
            out[str(b)].update(_ratios(f"{other}_vs_{n}", vs))
        if llama and b == 1:
            for n in names:
                vs = [x / y for x, y in zip(runs[n][1], runs["llama.cpp"][1])]
                out["1"].update(_ratios(f"{n}_vs_llama.cpp", vs))
    return out


def prefill(engines: dict, tokens: int, llama: str | None) -> dict:
    """`tokens`-token prefill tok/s of each engine (bench.engine.prefill_throughput) and llama.cpp's;
    not of a NO_PREFETCH name (the same engine as another: its prefix cache holds the prompts)."""
    from bench.engine import prefill_throughput

    out = {n: prefill_throughput(e, tokens)["tokens_per_s"] for n, e in engines.items()
           if not n.endswith(NO_PREFETCH)}
    if llama:
        got = llamacpp(llama, ["--new-tokens", "1", "--repeats", "3", "--prefill-tokens", str(tokens)])
        out["llama.cpp"] = got["prefill"]["tokens_per_s"]
        out["llama.cpp_info"] = {k: got[k] for k in ("llama_cpp_python", "system_info", "threads")}
    return out


def serving_memory(forms: tuple[str, ...]) -> dict:
    """memory_status of an engine at load_engine's defaults per weights form, each dropped before
    the next loads (their pools are gigabytes)."""
    import gc

    from engine.loader import load_engine
    from engine.memory.budget import memory_status

    out = {}
    for form in forms:
        engine = load_engine(weights=form, progress=False)
        out[form] = memory_status(engine)
        print(f"memory: {form}: {json.dumps(out[form])}", flush=True)
        del engine
        gc.collect()
    return out


def main(argv: list[str] | None = None) -> dict:
    from engine.loader import load_engine
    from engine.model.quant_weights import weight_bytes
    from engine.quant.matmul import kernel_status

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", default="gguf", choices=["gguf", "int8", "bfloat16"])
    p.add_argument("--batches", default="1,32")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--context", type=int, default=32, help="prompt tokens of the speed runs")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--skip-agreement", action="store_true")
    p.add_argument("--sweep-prompts", type=int, default=16,
                   help="prompts per workload kind of the greedy agreement sweep (0: none)")
    p.add_argument("--sweep-tokens", type=int, default=64)
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--llamacpp", metavar="PYTHON", help="a Python with llama_cpp: llama.cpp's batch-1 decode "
                   "in every round and its prefill (bench/llamacpp_baseline.py)")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--memory", action="store_true", help="also /ready's memory block at serve's defaults")
    p.add_argument("--screen-ab", action="store_true", help="also time the quantized engine taking greedy "
                   "tokens from full logits, not the output table's screen (engine.quant.matmul.qgreedy)")
    p.add_argument("--ahead-ab", action="store_true", help="also time the quantized engine reading each "
                   "plain decode step's tokens before dispatching the next (EngineConfig.decode_ahead off)")
    p.add_argument("--prefetch-ab", action="store_true", help="also time the quantized engine with the "
                   "kernel's software prefetch off (engine.quant.matmul.set_prefetch(0))")
    p.add_argument("--out", default="bench-out/quant-engine.json")
    args = p.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    memory = serving_memory(("float32", args.weights)) if args.memory else None
    load = partial(load_engine, max_batch=max(batches), max_context=1024, kv_budget_bytes=512 << 20,
                   speculation=False, progress=False)
    t = time.perf_counter()
    engines = {"float32": load(weights="float32"), args.weights: load(weights=args.weights)}
    if args.screen_ab:
        full = engines[f"{args.weights}-full-logits"] = load(weights=args.weights)
        full.runner.screen = False
    if args.ahead_ab:
        waits = engines[f"{args.weights}-no-ahead"] = load(weights=args.weights)
        waits.ecfg = replace(waits.ecfg, decode_ahead=False)
    if args.prefetch_ab:
        engines[args.weights + NO_PREFETCH] = engines[args.weights]
    result = {"weights": args.weights, "kernel": kernel_status(), "load_s": time.perf_counter() - t,
              "weight_bytes": {n: weight_bytes(e.runner.params) for n, e in engines.items()}}
    print(json.dumps(result), flush=True)
    if not args.skip_agreement:
        golden = json.loads(FIXTURE.read_text())
        pair = list(engines.values())[:2]
        result["agreement"] = agreement(*pair, golden)
        if args.sweep_prompts:
            near_tie = golden["settings"]["near_tie_margin"]
            result["agreement_sweep"] = agreement_sweep(*pair, args.sweep_prompts,
                                                        args.sweep_tokens, near_tie)
        print(json.dumps(result["agreement"], indent=1), flush=True)
    if not args.skip_speed:
        result["decode"] = speed(engines, batches, args.reps, args.context, args.new_tokens, args.llamacpp)
        result["decode_settings"] = {"context": args.context, "new_tokens": args.new_tokens,
                                     "reps": args.reps}
        print(json.dumps(result["decode"], indent=1), flush=True)
        result["prefill_tokens_per_s"] = prefill(engines, args.prefill_tokens, args.llamacpp)
        print(json.dumps(result["prefill_tokens_per_s"], indent=1), flush=True)
    if memory is not None:
        result["serving_memory"] = memory
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":  # pragma: no cover
    from engine.runtime.allocator import restart_with_allocator_settings

    restart_with_allocator_settings()  # as the daemon runs (engine/runtime/allocator.py)
    main()
