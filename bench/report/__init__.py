"""`crossover report --db URL --out DIR`: the four open questions answered from telemetry.

Modules: `build` (orchestration, header, output folder), `data` (reading the
database), `stats` (Wilson and delta-method intervals, the crossover rule),
`measured` (Q1, Q2 measured), `planned` (Q2 predicted, Q3, Q4, MoE),
`pool` (Q3 measured end to end: runs under each pool split), `early` (Q4's
`--early-exit` files), `roofline` (the step-time model and chip peaks behind
the predictions), `summary` (a paragraph per question), `figures` (PNGs).

Import from the modules themselves (`bench.report.build.build_report`): this package
re-exports nothing, so its modules can name each other (`from bench.report import figures`)
without a circle through this file.
"""
