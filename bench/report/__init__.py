"""`crossover report --db URL --out DIR`: the four open questions answered from telemetry.

Modules: `build` (orchestration, header, output folder), `data` (reading the
database), `stats` (Wilson and delta-method intervals, the crossover rule),
`measured` (Q1, Q2 measured), `planned` (Q2 predicted, Q3, Q4, MoE),
`roofline` (the step-time model and chip peaks behind the predictions),
`summary` (one line per question), `figures` (matplotlib PNGs).
"""

from bench.report.build import ReportRequest, build_report
from bench.report.data import ReportInputError
from bench.report.planned import PlanInputs

__all__ = ["PlanInputs", "ReportInputError", "ReportRequest", "build_report"]
