"""`crossover report --db URL --out DIR`: the findings report (Markdown + PNG) from telemetry.

    crossover report --db crossover.db --out docs/findings
    crossover report --db postgresql+psycopg://u:pw@host/db --out /tmp/r --model gemma3-1b --context 4096

Flags are parsed and checked here; the report is bench.report (imported in
`run`). Exit status 0 on success, 2 for a bad value (an unreachable or
unmigrated database, an unwritable --out, an unknown model or dtype).
"""

from __future__ import annotations

import argparse

from daemon.user_error import UserError
from engine.memory import planner, sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", required=True, help="telemetry database: a SQLAlchemy URL or a SQLite file path")
    p.add_argument("--out", required=True, help="folder for README.md and the figures (created if missing)")
    p.add_argument("--model", default="gemma3-270m",
                   help="model the database was measured on, for the planner "
                        f"({', '.join(planner.MODEL_NAMES)}; "
                        "default: %(default)s)")
    p.add_argument("--context", type=int, default=8192,
                   help="tokens per tenant for tenants displaced and predictions (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="weight dtype for the planner (default: %(default)s)")
    p.add_argument("--kv-dtype", default="bfloat16", help="KV dtype for the planner (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    p.add_argument("--instance", default=None,
                   help="only this daemon instance's rows (default: every instance)")
    p.add_argument("--early-exit", action="append", default=[], metavar="FILE",
                   help="a `crossover bench early-exit` JSON for Q4 (repeatable)")
    p.add_argument("--source-command", default=None,
                   help="the command that produced the database, written into the report")
    p.add_argument("--pool-instance", default=None,
                   help="the instance whose steps are pool-split runs (`crossover bench findings` writes "
                        "'findings-pool'): shown per policy version in Q3, left out of Q1 and Q2")
    p.add_argument("--tenant-instance", default=None,
                   help="the instance whose steps Q1 compares tenants alone and mixed on (`crossover bench "
                        "findings` writes 'findings-tenants'; default: every instance)")
    p.add_argument("--note", default=None, help="a sentence for the report header")
    p.add_argument("--facts", default=None, metavar="FILE",
                   help="a file next to the README with what the measuring command ran (`crossover bench "
                        "findings` writes findings.json), named in the header")


def run(args: argparse.Namespace) -> int:
    if args.model not in planner.MODEL_NAMES:
        raise UserError(f"--model {args.model!r} is not one of {', '.join(planner.MODEL_NAMES)}")
    if args.dtype not in sizes.WEIGHT_BITS:
        raise UserError(f"--dtype {args.dtype!r} is not one of {', '.join(sizes.WEIGHT_BITS)}")
    if args.kv_dtype not in sizes.KV_DTYPE_BYTES:
        raise UserError(f"--kv-dtype {args.kv_dtype!r} is not one of {', '.join(sizes.KV_DTYPE_BYTES)}")
    for flag, value in (("--context", args.context), ("--page-size", args.page_size)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")

    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise UserError("crossover report draws its figures with matplotlib: pip install 'crossover[bench]'")

    from bench.report.build import ReportRequest, build_report
    from bench.report.data import ReportInputError

    req = ReportRequest.from_flags(args)
    try:
        path = build_report(req)
    except ReportInputError as exc:
        raise UserError(str(exc)) from None
    print(f"wrote {path}")
    return 0

