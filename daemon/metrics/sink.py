"""`EngineMetrics`: the counters and histograms behind /metrics, fed as a Sink.

On the engine thread it adds each StepStats and RequestResult to
`prometheus_client` metrics registered in one registry (each metric locks
itself, so a scrape from the event loop reads whole values). A "draft" is one
sequence speculating in one step (`proposed / depth` of a step); its `depth`
proposed tokens are draft tokens; `accepted_per_pos[i]` counts drafts accepted
at draft position i (0-based). Token and request counters are per tenant,
counted when a request finishes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.types import RequestResult, StepStats

P = "crossover_"
SPEC = P + "spec_decode_"
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class EngineMetrics:
    """Counters fed from the engine thread (a Sink), registered in `registry`.

    Counter names are given without `_total`; prometheus_client appends it.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        reg = self.registry
        self.steps = Counter(P + "engine_steps", "Engine steps run.", registry=reg)
        self.num_drafts = Counter(SPEC + "num_drafts",
                                  "Drafts proposed (one per speculating sequence per step).",
                                  registry=reg)
        self.num_draft_tokens = Counter(SPEC + "num_draft_tokens", "Draft tokens proposed.",
                                        registry=reg)
        self.num_accepted_tokens = Counter(SPEC + "num_accepted_tokens", "Draft tokens accepted.",
                                           registry=reg)
        self.accepted_per_pos = Counter(
            SPEC + "num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based).", ["position"], registry=reg)
        self._per_pos: list[Counter] = []  # children of accepted_per_pos, by position
        self.requests = Counter(P + "requests", "Finished requests by tenant and finish reason.",
                                ["tenant", "finish_reason"], registry=reg)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests.",
                                     ["tenant"], registry=reg)
        self.generation_tokens = Counter(P + "generation_tokens",
                                         "Tokens generated for finished requests.", ["tenant"],
                                         registry=reg)
        self.batch_size = Histogram(P + "batch_size", "Sequences per engine step.",
                                    buckets=BATCH_BOUNDS, registry=reg)
        self.step_seconds = Histogram(P + "step_duration_seconds", "Wall time of one engine step.",
                                      buckets=STEP_SECONDS_BOUNDS, registry=reg)

    def on_step(self, stats: StepStats) -> None:
        self.steps.inc()
        if stats.depth > 0:
            self.num_drafts.inc(stats.proposed // stats.depth)
        self.num_draft_tokens.inc(stats.proposed)
        self.num_accepted_tokens.inc(stats.accepted)
        for pos, n in enumerate(stats.accepted_per_pos):
            if pos == len(self._per_pos):  # only the engine thread appends
                self._per_pos.append(self.accepted_per_pos.labels(position=str(pos)))
            self._per_pos[pos].inc(n)
        self.batch_size.observe(stats.batch_size)
        self.step_seconds.observe(stats.step_ms / 1000.0)

    def on_result(self, result: RequestResult) -> None:
        self.requests.labels(tenant=result.tenant, finish_reason=result.finish_reason).inc()
        self.prompt_tokens.labels(tenant=result.tenant).inc(result.prompt_tokens)
        self.generation_tokens.labels(tenant=result.tenant).inc(result.output_tokens)

    def flush(self) -> None:
        pass
