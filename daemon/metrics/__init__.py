"""`GET /metrics`: Prometheus exposition through `prometheus_client`, unauthenticated like vLLM's.

- `sink`: `EngineMetrics`, a Sink on the engine thread that counts steps,
  drafts and tokens (vLLM's spec-decode names with the `crossover_` prefix),
  finished requests and tokens per tenant, and observes the batch-size and
  step-time histograms — real `prometheus_client` Counters and Histograms;
  per model (`model_name` label, as vLLM), the request histograms (e2e
  latency, time to first token, time per output token, queue time) and the
  preemption counter.
- `collector`: `DaemonCollector`, the values read from the app at scrape time
  (the engine's `status()` gauges, KV cache usage as a fraction, the compile counter, requests in flight in
  the daemon and per tenant, the recorder's dropped rows, retunes by status).
- `endpoint`: one `CollectorRegistry` per app (so apps built side by side in
  tests stay apart) holding both, plus process and platform metrics; the
  route that refreshes the retune counts off the event loop and answers in
  the text format, or OpenMetrics when the Accept header asks for it.
"""
