"""Inter-token latency of running streams while a long prompt is prefilled.

1. Load the engine in-process (as `crossover bench serve` does): a long
   prompt's chunks ride in the streams' ragged calls, capped while they
   decode (engine/step/ragged_step.py).
2. Start `--streams` greedy requests with short prompts and long outputs;
   once each has produced `--warm-tokens` tokens, send one request with a
   `--prompt-tokens` prompt (max_tokens 1).
3. Step until the streams finish, timing every token each stream receives.
   Report the streams' ITL median and p99 over all their tokens, over the
   tokens received while the long prompt was prefilled (from its send to its
   first token) and over the others, the long prompt's TTFT, and the p99
   during the prefill over the median of all tokens and of the others.

    python -m bench.long_prefill --out bench/results/ragged-steps/long-prefill.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench import print_and_write
from bench.engine import _prompt
from engine.types import Request, SamplingParams


def _ms(values: list[float]) -> dict:
    a = np.asarray(values) * 1e3
    if not a.size:
        return {"n": 0}
    return {"n": int(a.size), "p50": round(float(np.percentile(a, 50)), 1),
            "p99": round(float(np.percentile(a, 99)), 1), "max": round(float(a.max()), 1)}


def measure(engine, streams: int, prompt_tokens: int, warm_tokens: int, stream_tokens: int) -> dict:
    """Steps `engine` through the scenario of the module docstring; the latencies in ms."""
    sp = SamplingParams(max_tokens=stream_tokens, ignore_eos=True)
    for i in range(streams):
        engine.add_request(Request(f"s{i}", _prompt(engine.tokenizer, 24, i), sp))
    last: dict[str, float] = {}
    counts = {f"s{i}": 0 for i in range(streams)}
    itl: list[tuple[float, float]] = []  # (arrival time, gap)
    sent = first = None
    while engine.has_work():
        if sent is None and min(counts.values()) >= warm_tokens:
            engine.add_request(Request("long", _prompt(engine.tokenizer, prompt_tokens, 99),
                                       SamplingParams(max_tokens=1, ignore_eos=True)))
            sent = time.perf_counter()
        out = engine.step()
        now = time.perf_counter()
        for ev in out.events:
            if ev.request_id == "long":
                first = first or now
                continue
            if ev.token_ids:
                if ev.request_id in last:
                    itl.append((now, now - last[ev.request_id]))
                last[ev.request_id] = now
                counts[ev.request_id] += len(ev.token_ids)
    inside = [sent is not None and first is not None and sent < t <= first for t, _ in itl]
    during = [g for (_, g), x in zip(itl, inside) if x]
    whole, window = _ms([g for _, g in itl]), _ms(during)
    outside = _ms([g for (_, g), x in zip(itl, inside) if not x])
    return {"streams": streams, "prompt_tokens": prompt_tokens, "stream_tokens": stream_tokens,
            "long_ttft_ms": None if first is None else round((first - sent) * 1e3, 1),
            "itl_ms": whole, "itl_during_prefill_ms": window, "itl_outside_prefill_ms": outside,
            "p99_over_median": round(whole["p99"] / whole["p50"], 3) if whole["n"] else None,
            "during_p99_over_median": (round(window["p99"] / whole["p50"], 3)
                                       if window["n"] and whole["n"] else None),
            # the median of plain decode steps alone (the prefill's steps weigh in `itl_ms`'s)
            "during_p99_over_outside_median": (round(window["p99"] / outside["p50"], 3)
                                               if window["n"] and outside["n"] else None)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON output file")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--warm-tokens", type=int, default=8,
                    help="tokens each stream has before the long prompt")
    ap.add_argument("--stream-tokens", type=int, default=160, help="output tokens of each stream")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--max-batch", type=int, default=32)
    args = ap.parse_args(argv)
    from engine.loader import load_engine

    engine = load_engine(max_batch=args.max_batch, max_context=args.max_context, speculation=False,
                         progress=False)
    engine.warmup(progress=False)
    from bench.engine import run_each_shape_once

    run_each_shape_once(engine)
    result = {"bench": "long_prefill",
              **measure(engine, args.streams, args.prompt_tokens, args.warm_tokens, args.stream_tokens),
              "compiles_since_warmup": engine.compiles_since_warmup()}
    return print_and_write(result, args.out)


if __name__ == "__main__":
    main()
