"""crossover telemetry: record types, the buffered recorder, retention and queries.

    records    a request's stored status (records are the engine's StepStats / RequestResult)
    writer     records -> rows, with the step columns read off store.models.Step
    recorder   Recorder: O(1) record_*, batched writes from its own thread
    retention  raw steps -> per-minute rollups; pruning
    rowclasses a step's drafts per row class (tenant, technique, depth), as readers count them
    queries    aggregates that dashboards read (policy/retune history: store.history)
See README.md beside this file for the schema, the views and example SQL.
"""
