"""crossover telemetry: record types, the buffered recorder, retention and queries.

    records    StepRecord / RequestRecord (field names of engine StepStats / RequestResult)
    recorder   Recorder: O(1) record_*, batched writes from its own thread
    retention  raw steps -> per-minute rollups; pruning
    queries    aggregates shared by the tuner, /metrics and dashboards
    bench      `crossover bench telemetry`
See README.md beside this file for the schema, the views and example SQL.
"""
