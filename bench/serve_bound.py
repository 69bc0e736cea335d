"""The efficiency bound of `crossover bench serve` (bench/serve.py's module doc, 7): the engine's rates
at the batch sizes the served requests needed, and served tokens/s over the bound they give.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from bench.efficiency import EngineRates, efficiency, measure_rates
from bench.loadgen import Job, Sample
from bench.serve_config import ServeBenchConfig
from bench.serve_stats import CpuMeter, log


def efficiency_block(cfg: ServeBenchConfig, engine: Any, file_rates: EngineRates | None,
                result: dict[str, Any], samples: list[Sample], jobs: list[Job]) -> dict[str, Any]:
    """The `efficiency` block for the served (error-free) samples of the fastest HTTP round."""
    ok = [s for s in samples if s.error is None]
    http = result["http"]
    if not ok:
        return {"ratio": None, "reason": "no request was served without an error"}
    if cfg.rate is None:
        concurrency, how = min(cfg.concurrency, len(ok)), "--concurrency (closed loop)"
    else:
        concurrency, how = max(1, round(http["mean_in_flight"])), "mean requests in flight (open loop)"
    if engine is not None:
        concurrency = min(concurrency, engine.max_batch)
    rates = file_rates
    if rates is None and engine is None:
        return {"served_tokens_per_s": http["output_tokens_per_s"], "ratio": None,
                "reason": "no engine here to measure (--url): pass --engine-rates FILE, the JSON of "
                          "`crossover bench engine` on the daemon's machine and model"}
    if rates is None:
        rates = _measure(cfg, engine, ok, concurrency, jobs)
    block = efficiency(http["output_tokens_per_s"], [s.prompt_tokens for s in ok],
                       [s.output_tokens for s in ok], concurrency, rates,
                       result.get("engine_only", {}).get("output_tokens_per_s"))
    block["bound"]["concurrency_from"] = how
    return block


def _measure(cfg: ServeBenchConfig, engine: Any, ok: list[Sample], concurrency: int,
             jobs: list[Job]) -> EngineRates:
    """Rates of the idle `engine` at the batch sizes an ideal closed loop of `concurrency` runs,
    decoding the served prompts (speculation meets their acceptance), prefilling one of their
    mean length."""
    from bench.efficiency import decode_schedule

    batches = list(decode_schedule([s.output_tokens for s in ok], concurrency)) or [1]
    new_tokens = max(4, min(cfg.max_tokens, 64))
    mean_prompt = round(sum(s.prompt_tokens for s in ok) / len(ok))
    prompt_len = max(2, min(mean_prompt, engine.max_context - new_tokens - 1))
    log(f"measuring the engine's rates: decode at batch {sorted(batches)}, prefill of "
        f"{prompt_len} tokens")
    meter = CpuMeter()
    by_index = {job.index: job for job in jobs}
    prompts = [by_index[s.index].request(engine.tokenizer, "rate").prompt_ids for s in ok
               if s.index in by_index]
    rates = measure_rates(engine, batches, prompt_len, new_tokens, prompt_len, prompts)
    return replace(rates, detail={**rates.detail, "other_processes_cpu_share": meter.share()})
