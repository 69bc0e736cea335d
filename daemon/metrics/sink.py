"""`EngineMetrics`: the counters and histograms behind /metrics, fed as a Sink.

On the engine thread it adds each StepStats and RequestResult to
`prometheus_client` metrics registered in one registry (each metric locks
itself, so a scrape from the event loop reads whole values). A "draft" is one
sequence speculating in one step (`proposed / depth` of a step); its `depth`
proposed tokens are draft tokens; `accepted_per_pos[i]` counts drafts accepted
at draft position i (0-based). Token and request counters are per tenant,
counted when a request finishes.

The prefix-cache counters count tokens, as vLLM's: `prefix_cache_queries`
(tokens of admitted sequences looked up) and `prefix_cache_hits` (those found);
the hit rate is the ratio of their rates.

The request-latency histograms and the preemption counter carry vLLM's names
(prefixed `crossover_`) and its `model_name` label. From one finished
`RequestResult` (all unix seconds):

- e2e latency = finish_time - arrival_time, for every finished request
  (aborted ones too, so its count is the sum of `crossover_requests_total`);
- time to first token = first_token_time - arrival_time, when a token came;
- time per output token = (finish_time - first_token_time) / (output_tokens - 1),
  when there were at least two tokens (speculation emits several per step, so
  this is the mean per token, not the time between steps);
- queue time = scheduled_time - arrival_time, when a step ran the request.

    >>> request_times(RequestResult("r", "t", 3, 5, 10.0, 10.5, 12.5, "stop", scheduled_time=10.25))
    {'e2e': 2.5, 'ttft': 0.5, 'tpot': 0.5, 'queue': 0.25}
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from engine.types import RequestResult, StepStats

P = "crossover_"
SPEC = P + "spec_decode_"
MODEL_LABEL = "model_name"
M = TypeVar("M", Counter, Histogram)
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""vLLM's bounds for time to first token."""
TPOT_BOUNDS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
"""vLLM's bounds (from 0.01) with four below: accepted drafts put tokens under 10 ms."""
LATENCY_BOUNDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
"""vLLM's bounds for end-to-end latency."""
QUEUE_BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2) + LATENCY_BOUNDS
"""vLLM's (the e2e bounds) with seven below 0.3 s, where an unsaturated daemon's queue time lies."""

REQUEST_HISTOGRAMS = (  # (request_times key, metric, help, bounds)
    ("e2e", "e2e_request_latency_seconds", "Arrival to finish of each finished request.",
     LATENCY_BOUNDS),
    ("ttft", "time_to_first_token_seconds", "Arrival to first output token.", TTFT_BOUNDS),
    ("tpot", "time_per_output_token_seconds",
     "Mean time per output token after the first, per request.", TPOT_BOUNDS),
    ("queue", "request_queue_time_seconds", "Arrival to the first engine step that ran the request.",
     QUEUE_BOUNDS),
)


def request_times(result: RequestResult) -> dict[str, float]:
    """The latencies one finished request gives (module doc); none is negative."""
    out = {"e2e": result.finish_time - result.arrival_time}
    if result.first_token_time is not None:
        out["ttft"] = result.first_token_time - result.arrival_time
        if result.output_tokens > 1:
            out["tpot"] = (result.finish_time - result.first_token_time) / (result.output_tokens - 1)
    if result.scheduled_time is not None:
        out["queue"] = result.scheduled_time - result.arrival_time
    return {k: max(0.0, v) for k, v in out.items()}


class EngineMetrics:
    """Counters fed from the engine thread (a Sink), registered in `registry`.

    Counter names are given without `_total`; prometheus_client appends it.
    `model_name` labels the request-latency histograms and the preemption
    counter (their series exist, at zero, from the start).
    """

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.model_name = model_name
        reg = self.registry
        self.steps = Counter(P + "engine_steps", "Engine steps run.", registry=reg)
        self.grammar_steps = Counter(P + "grammar_steps",
                                     "Engine steps with constrained rows (structured outputs).",
                                     registry=reg)
        self.grammar_seconds = Counter(P + "grammar_seconds", "Host time steps spent on constrained rows' "
                                       "grammars: drafts checked, token masks computed.", registry=reg)
        self.num_drafts = Counter(SPEC + "num_drafts",
                                  "Drafts proposed (one per speculating sequence per step).",
                                  registry=reg)
        self.num_draft_tokens = Counter(SPEC + "num_draft_tokens", "Draft tokens proposed.",
                                        registry=reg)
        self.num_accepted_tokens = Counter(
            SPEC + "num_accepted_tokens", "Draft tokens accepted and delivered (none past a request's end).",
            registry=reg)
        self.accepted_per_pos = Counter(
            SPEC + "num_accepted_tokens_per_pos",
            "Draft tokens accepted and delivered at each draft position (0-based).", ["position"],
            registry=reg)
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
        self.preemptions = self._model(Counter(
            P + "num_preemptions", "Sequences preempted (KV pages taken back, recomputed later).",
            [MODEL_LABEL], registry=reg))
        self.prefix_queries = self._model(Counter(
            P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission.",
            [MODEL_LABEL], registry=reg))
        self.prefix_hits = self._model(Counter(
            P + "prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).",
            [MODEL_LABEL], registry=reg))
        self.latency = {key: self._model(Histogram(P + name, text, [MODEL_LABEL], buckets=bounds,
                                                   registry=reg))
                        for key, name, text, bounds in REQUEST_HISTOGRAMS}
        """request_times key -> this model's histogram."""

    def _model(self, metric: M) -> M:
        """The child of `metric` for this engine's model."""
        return metric.labels(**{MODEL_LABEL: self.model_name})

    def on_step(self, stats: StepStats) -> None:
        self.steps.inc()
        if stats.constrained_rows:
            self.grammar_steps.inc()
            self.grammar_seconds.inc(stats.grammar_ms / 1000.0)
        if stats.depth > 0:  # rows of several depths (per-tenant rules): each class by its own depth
            self.num_drafts.inc(sum(c.proposed // c.depth for c in stats.row_classes if c.depth)
                                if stats.row_classes else stats.proposed // stats.depth)
        self.num_draft_tokens.inc(stats.proposed)
        self.num_accepted_tokens.inc(stats.accepted)
        for pos, n in enumerate(stats.accepted_per_pos):
            if pos == len(self._per_pos):  # only the engine thread appends
                self._per_pos.append(self.accepted_per_pos.labels(position=str(pos)))
            self._per_pos[pos].inc(n)
        self.batch_size.observe(stats.batch_size)
        self.step_seconds.observe(stats.step_ms / 1000.0)
        self.preemptions.inc(stats.preempted)
        self.prefix_queries.inc(stats.prefix_query_tokens)
        self.prefix_hits.inc(stats.prefix_hit_tokens)

    def on_result(self, result: RequestResult) -> None:
        self.requests.labels(tenant=result.tenant, finish_reason=result.finish_reason).inc()
        self.prompt_tokens.labels(tenant=result.tenant).inc(result.prompt_tokens)
        self.generation_tokens.labels(tenant=result.tenant).inc(result.output_tokens)
        for key, seconds in request_times(result).items():
            self.latency[key].observe(seconds)

    def flush(self) -> None:
        pass
