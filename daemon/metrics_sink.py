"""`EngineMetrics`: the in-memory counters behind /metrics (a Sink).

On the engine thread it adds each StepStats and RequestResult under one lock
(O(1)); `families()` snapshots them for a scrape. A "draft" is one sequence
speculating in one step (`proposed / depth` of a step); its `depth` proposed
tokens are draft tokens; `accepted_per_pos[i]` counts drafts accepted at
draft position i (0-based). Token and request counters are per tenant,
counted when a request finishes.
"""

from __future__ import annotations

import threading
from collections import Counter

from daemon.exposition import Family, Histogram, histogram_family, single
from engine.types import RequestResult, StepStats

P = "crossover_"
SPEC = P + "spec_decode_"
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class EngineMetrics:
    """Counters fed from the engine thread (a Sink), snapshotted by /metrics."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.steps = 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        self.requests: Counter[tuple[str, str]] = Counter()  # (tenant, finish_reason)
        self.prompt_tokens: Counter[str] = Counter()
        self.generation_tokens: Counter[str] = Counter()
        self.batch_size = Histogram(BATCH_BOUNDS)
        self.step_seconds = Histogram(STEP_SECONDS_BOUNDS)

    def on_step(self, stats: StepStats) -> None:
        with self._lock:
            self.steps += 1
            if stats.depth > 0:
                self.num_drafts += stats.proposed // stats.depth
            self.num_draft_tokens += stats.proposed
            self.num_accepted_tokens += stats.accepted
            for pos, n in enumerate(stats.accepted_per_pos):
                if pos == len(self.accepted_per_pos):
                    self.accepted_per_pos.append(0)
                self.accepted_per_pos[pos] += n
            self.batch_size.observe(stats.batch_size)
            self.step_seconds.observe(stats.step_ms / 1000.0)

    def on_result(self, result: RequestResult) -> None:
        with self._lock:
            self.requests[(result.tenant, result.finish_reason)] += 1
            self.prompt_tokens[result.tenant] += result.prompt_tokens
            self.generation_tokens[result.tenant] += result.output_tokens

    def flush(self) -> None:
        pass

    def families(self) -> list[Family]:
        with self._lock:
            return self._spec_families() + self._request_families() + [
                single(P + "engine_steps_total", "counter", "Engine steps run.", self.steps),
                histogram_family(P + "batch_size", "Sequences per engine step.",
                                 self.batch_size.snapshot()),
                histogram_family(P + "step_duration_seconds", "Wall time of one engine step.",
                                 self.step_seconds.snapshot()),
            ]

    def _spec_families(self) -> list[Family]:
        per_pos = Family(SPEC + "num_accepted_tokens_per_pos_total", "counter",
                         "Draft tokens accepted at each draft position (0-based).")
        for pos, n in enumerate(self.accepted_per_pos):
            per_pos.add(n, {"position": str(pos)})
        return [
            single(SPEC + "num_drafts_total", "counter",
                   "Drafts proposed (one per speculating sequence per step).", self.num_drafts),
            single(SPEC + "num_draft_tokens_total", "counter", "Draft tokens proposed.",
                   self.num_draft_tokens),
            single(SPEC + "num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                   self.num_accepted_tokens),
            per_pos,
        ]

    def _request_families(self) -> list[Family]:
        requests = Family(P + "requests_total", "counter",
                          "Finished requests by tenant and finish reason.")
        for (tenant, reason), n in sorted(self.requests.items()):
            requests.add(n, {"tenant": tenant, "finish_reason": reason})
        prompt = Family(P + "prompt_tokens_total", "counter", "Prompt tokens of finished requests.")
        generation = Family(P + "generation_tokens_total", "counter",
                            "Tokens generated for finished requests.")
        for fam, counts in ((prompt, self.prompt_tokens), (generation, self.generation_tokens)):
            for tenant, n in sorted(counts.items()):
                fam.add(n, {"tenant": tenant})
        return [requests, prompt, generation]

