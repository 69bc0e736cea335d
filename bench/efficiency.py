"""Serving efficiency: served output tokens/s over what the engine's own rates allow.

1. Rates (`EngineRates`): prefill tokens/s and decode tokens/s per batch
   size of the same engine. `measure_rates` measures them in-process with
   `bench.engine`'s `decode_throughput` and `prefill_throughput` (the
   functions of `crossover bench engine`), decoding the served prompts in
   a closed loop (so speculation meets their acceptance); `rates_from_file`
   reads a `crossover bench engine` JSON, for a daemon benched by URL (its
   synthetic prompts overstate speculation's rate).
2. Schedule (`decode_schedule`): the decode steps an ideal closed loop of
   `concurrency` slots needs for the requests sent, in send order: each
   request decodes its output tokens but the first (the prefill pass yields
   that one), a slot takes the next request the step after its request
   finished, and every step decodes one token of every busy slot.
3. Bound (`engine_bound`): ideal seconds = prompt tokens / prefill tokens/s
   + the sum over those decode steps of batch / decode tokens/s at that
   batch (one step's time); bound tokens/s = output tokens / ideal seconds.
   Every prompt token counts as prefilled: a prefix cache that skips some
   can push the served rate past the bound.
4. `efficiency`: served tokens/s / bound tokens/s (1.0: the daemon serves as
   fast as its engine's measured rates allow; less is lost to scheduling,
   HTTP and waiting).
"""

from __future__ import annotations

import json
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METHOD = ("ideal seconds = prompt tokens / prefill tokens/s + sum over the decode steps of an "
          "ideal closed loop of `concurrency` slots (each request decodes its output tokens but "
          "the first, which its prefill yields) of batch / decode tokens/s at that batch; "
          "bound tokens/s = output tokens / ideal seconds")


@dataclass(frozen=True)
class EngineRates:
    """An engine's measured throughput: what the bound is computed from."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: dict[int, float]
    """Batch size -> decode tokens/s at that batch."""
    source: str
    """Where the rates come from, in words."""
    detail: dict[str, Any] = field(default_factory=dict)
    """How they were measured (prompt lengths, tokens decoded, the file)."""

    def decode_at(self, batch: int) -> tuple[float, bool]:
        """(decode tokens/s at `batch`, whether it was measured there).

        Between two measured batch sizes tokens/s is interpolated linearly; outside them
        the nearest measured one is used.

        >>> r = EngineRates(1000.0, {2: 100.0, 6: 200.0}, "example")
        >>> r.decode_at(2), r.decode_at(4), r.decode_at(8)
        ((100.0, True), (150.0, False), (200.0, False))
        """
        rates = self.decode_tokens_per_s
        if batch in rates:
            return rates[batch], True
        below = [b for b in rates if b < batch]
        above = [b for b in rates if b > batch]
        if not below or not above:
            return rates[min(rates, key=lambda b: abs(b - batch))], False
        lo, hi = max(below), min(above)
        return rates[lo] + (rates[hi] - rates[lo]) * (batch - lo) / (hi - lo), False

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 3),
                "decode_tokens_per_s": {str(b): round(v, 3)
                                        for b, v in sorted(self.decode_tokens_per_s.items())},
                **self.detail}


def decode_schedule(output_tokens: Sequence[int], concurrency: int) -> dict[int, int]:
    """Batch size -> decode steps of an ideal closed loop of `concurrency` slots (module doc, 2).

    >>> decode_schedule([10, 10, 10, 10], 2)  # 9 decode tokens each, two at a time
    {2: 18}
    >>> decode_schedule([3, 5, 1], 2)  # 2 and 4 decode tokens side by side, then 2 alone
    {2: 2, 1: 2}
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    waiting = deque(n - 1 for n in output_tokens if n > 1)  # a 1-token request never decodes
    busy: list[int] = []
    steps: Counter[int] = Counter()
    while waiting or busy:
        while waiting and len(busy) < concurrency:
            busy.append(waiting.popleft())
        run = min(busy)  # every slot stays busy until the shortest one finishes
        steps[len(busy)] += run
        busy = [left - run for left in busy if left > run]
    return dict(steps)


def engine_bound(prompt_tokens: Sequence[int], output_tokens: Sequence[int], concurrency: int,
                 rates: EngineRates) -> dict[str, Any]:
    """The ideal time and tokens/s of these requests on an engine with `rates` (module doc, 3)."""
    if len(prompt_tokens) != len(output_tokens):
        raise ValueError(f"{len(prompt_tokens)} prompt counts but {len(output_tokens)} output counts")
    steps = decode_schedule(output_tokens, concurrency)
    prefill_s = sum(prompt_tokens) / rates.prefill_tokens_per_s
    decode_s, used, guessed = 0.0, {}, []
    for batch, n in sorted(steps.items()):
        tps, measured = rates.decode_at(batch)
        decode_s += n * batch / tps
        used[str(batch)] = round(tps, 3)
        if not measured:
            guessed.append(batch)
    ideal_s = prefill_s + decode_s
    out = sum(output_tokens)
    return {"method": METHOD, "concurrency": concurrency, "requests": len(output_tokens),
            "prompt_tokens": sum(prompt_tokens), "output_tokens": out,
            "decode_tokens": sum(steps_b * b for b, steps_b in steps.items()),
            "decode_steps": {str(b): n for b, n in sorted(steps.items())},
            "decode_tokens_per_s_used": used, "batches_not_measured": guessed,
            "prefill_s": round(prefill_s, 4), "decode_s": round(decode_s, 4),
            "ideal_s": round(ideal_s, 4),
            "bound_tokens_per_s": round(out / ideal_s, 3) if ideal_s > 0 else None}


def efficiency(served_tokens_per_s: float | None, prompt_tokens: Sequence[int],
               output_tokens: Sequence[int], concurrency: int, rates: EngineRates,
               engine_only_tokens_per_s: float | None = None) -> dict[str, Any]:
    """The `efficiency` block of `bench serve`'s JSON.

    >>> rates = EngineRates(400.0, {2: 100.0}, "example")
    >>> e = efficiency(20.0, [100] * 4, [10] * 4, 2, rates)  # 1 s prefill + 18 steps of 0.02 s
    >>> e["bound"]["ideal_s"], e["bound_tokens_per_s"], e["ratio"]
    (1.36, 29.412, 0.68)
    """
    bound = engine_bound(prompt_tokens, output_tokens, concurrency, rates)
    limit = bound["bound_tokens_per_s"]

    def ratio(tps: float | None) -> float | None:
        return round(tps / limit, 4) if tps is not None and limit else None

    return {"served_tokens_per_s": served_tokens_per_s, "bound_tokens_per_s": limit,
            "ratio": ratio(served_tokens_per_s),
            "engine_only_ratio": ratio(engine_only_tokens_per_s),
            "bound": bound, "rates": rates.to_json()}


DECODE_GROUPS = 4
"""Decode at batch b is measured on at most this many times b served prompts (`measure_rates`)."""


def measure_rates(engine: Any, batches: Sequence[int], prompt_len: int, new_tokens: int,
                  prefill_len: int, prompts: Sequence[Sequence[int]] = ()) -> EngineRates:
    """Prefill tokens/s and decode tokens/s at each of `batches` of an idle `engine`, with
    `crossover bench engine`'s functions.

    Prefill runs first (the best of three prompts): they are decode's fourth to sixth prompts of
    that length, so afterwards a prefix cache would serve them from memory and overstate the rate.
    `prompts`: decode at batch b runs through up to DECODE_GROUPS * b of these in a closed loop
    of b slots (`_decode_rate`), so speculation meets the acceptance of the requests served
    (`bench.engine`'s own prompts repeat a few words, where n-gram drafts nearly always land).
    """
    from bench.engine import prefill_throughput

    prefill = float(prefill_throughput(engine, prefill_len)["tokens_per_s"])
    decode = {b: _decode_rate(engine, b, prompt_len, new_tokens, prompts) for b in sorted(set(batches))}
    return EngineRates(prefill, decode, "measured in this run on the same engine, after the "
                       "phases (bench.engine.prefill_throughput, then decode_throughput)",
                       {"decode_prompt_tokens": prompt_len, "decode_new_tokens": new_tokens,
                        "prefill_prompt_tokens": prefill_len,
                        "decode_prompts": f"{min(len(prompts), DECODE_GROUPS * max(batches, default=1))} "
                                          "of the served prompts" if prompts else "bench.engine's"})


def _decode_rate(engine: Any, batch: int, prompt_len: int, new_tokens: int,
                 prompts: Sequence[Sequence[int]]) -> float:
    """Decode tokens/s at `batch`: bench.engine's (`prompts` empty), else a closed loop of `batch`
    slots through `prompts` (a slot takes the next prompt when its request ends), counting the
    steps without prefill. A closed loop keeps the mix in flight that serving has: requests whose
    drafts land finish sooner and are replaced, where `batch` requests started together would
    count their fast start alone."""
    from bench.engine import decode_throughput
    from engine.types import Request, SamplingParams

    if not prompts:
        return float(decode_throughput(engine, batch, prompt_len, new_tokens)["tokens_per_s"])
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    todo = deque(list(p) for p in prompts[: DECODE_GROUPS * batch])
    sent, tokens, ms = 0, 0, 0.0

    def send() -> None:
        nonlocal sent
        engine.add_request(Request(f"rate-b{batch}-{sent}", todo.popleft(), sp))
        sent += 1

    for _ in range(min(batch, len(todo))):
        send()
    while engine.has_work():
        out = engine.step()
        if out.stats is not None and out.stats.prefill_tokens == 0:
            tokens += out.stats.decode_tokens
            ms += out.stats.step_ms
        for _ in (e for e in out.events if e.finished and todo):
            send()
    return tokens / (ms / 1e3) if ms else 0.0


def rates_from_file(path: str) -> EngineRates:
    """The rates in a `crossover bench engine` JSON; ValueError saying what is missing."""
    try:
        data = json.loads(Path(path).read_text())
        decode = {int(r["batch"]): float(r["tokens_per_s"]) for r in data["decode"]}
        prefill = float(data["prefill"]["tokens_per_s"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a `crossover bench engine` JSON with decode[].batch, "
                         f"decode[].tokens_per_s and prefill.tokens_per_s ({exc})") from None
    if not decode or prefill <= 0 or min(decode.values()) <= 0:
        raise ValueError(f"{path}: the decode and prefill rates must be positive and not empty")
    return EngineRates(prefill, decode, f"read from {path} (`crossover bench engine`)",
                       {"file": str(path), "model": data.get("model"),
                        "prefill_prompt_tokens": data["prefill"].get("prompt_tokens")})
