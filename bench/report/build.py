"""`crossover report`: a Markdown findings report with figures, from a telemetry database.

1. Check the output folder (created if missing; it must be writable) and the
   database (reachable, at the schema head) — `ReportInputError` naming the
   bad value otherwise.
2. Read the raw steps and requests once (bench/report/data.py).
3. Read back `crossover bench findings`' runs (verdicts.read_rounds: Q1 by sequence, Q2 and Q3 in rounds).
4. Write the sections, each with its figures and the query behind every number, then the verdict table
   and the answers that open the report (verdicts.py; summary.py: a paragraph, a figure and a source per
   question): Q1 acceptance (measured.py, q1_sequences.py), Q2 crossover measured (q2_rounds.py,
   measured.py) and predicted (planned.py), Q3 memory against goodput (q3_rounds.py, pool.py) and the
   projection for larger models (planned.py), Q4 early exit with compaction and the mixture-of-experts
   verdict (planned.py).
5. Write DIR/README.md: date, machine, database URL (password hidden), the
   command that made the report and, when given, the one that made the data.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.report import q1_sequences, q2_rounds, q3_rounds
from bench.report.data import ReportInputError, Telemetry, open_database, read_telemetry, shown_url
from bench.report.early import EarlyExitFileError, load_runs
from bench.report.early import section as early_section
from bench.report.measured import q1_section, q2_measured_section
from bench.report.planned import PlanInputs, q2_predicted_section, q3_section, q4_section
from bench.report.summary import summary
from bench.report.verdicts import read_rounds, table

README = "README.md"


@dataclass(frozen=True)
class ReportRequest:
    """What to report on and where."""

    db: str
    """SQLAlchemy URL or SQLite file path of the telemetry database."""
    out: Path
    """Folder the README and figures are written to."""
    plan: PlanInputs = field(default_factory=PlanInputs)
    instance: str | None = None
    """Only this daemon instance's rows (None: every instance's)."""
    source_command: str | None = None
    """The command that produced the database, written in the report when given."""
    early_exit: tuple[Path, ...] = ()
    """`crossover bench early-exit` JSON files whose results Q4 shows (they are not telemetry)."""
    tenant_instance: str | None = None
    """The instance whose steps Q1's alone-vs-mixed comparison uses (None: every instance)."""
    pool_instance: str | None = None
    """The instance whose steps are pool-split runs (`crossover bench findings`' Q3): shown per
    policy version in Q3 and left out of Q1 and Q2."""
    note: str | None = None
    """Free text for the header (e.g. that the machine was shared while measuring)."""
    facts: str | None = None
    """A file next to the README with what the measuring command ran, named in the header."""

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> ReportRequest:
        """The report `crossover report`'s parsed flags ask for."""
        return cls(db=args.db, out=Path(args.out), instance=args.instance,
                   source_command=args.source_command, pool_instance=args.pool_instance, note=args.note,
                   facts=args.facts, tenant_instance=args.tenant_instance,
                   early_exit=tuple(Path(f) for f in args.early_exit),
                   plan=PlanInputs(model=args.model, context=args.context, weight_dtype=args.dtype,
                                   kv_dtype=args.kv_dtype, page_size=args.page_size))


def prepare_out(out: Path) -> Path:
    """Create `out` if needed and prove it writable; ReportInputError naming it otherwise."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ReportInputError(f"--out {str(out)!r} is not a writable folder "
                               f"({exc.strerror or exc})") from None
    return out


def report_command(req: ReportRequest) -> str:
    """The `crossover report` command line that reproduces this report (password hidden)."""
    p, default = req.plan, PlanInputs()
    parts = ["crossover", "report", "--db", shown_url(req.db), "--out", str(req.out)]
    for flag, value, base in (("--model", p.model, default.model), ("--context", p.context, default.context),
                              ("--dtype", p.weight_dtype, default.weight_dtype),
                              ("--kv-dtype", p.kv_dtype, default.kv_dtype),
                              ("--page-size", p.page_size, default.page_size)):
        if value != base:
            parts += [flag, str(value)]
    if req.instance is not None:
        parts += ["--instance", req.instance]
    if req.pool_instance is not None:
        parts += ["--pool-instance", req.pool_instance]
    if req.tenant_instance is not None:
        parts += ["--tenant-instance", req.tenant_instance]
    for path in req.early_exit:
        parts += ["--early-exit", str(path)]
    for flag, text in (("--source-command", req.source_command), ("--note", req.note),
                       ("--facts", req.facts)):
        if text is not None:
            parts += [flag, text]
    return shlex.join(parts)


PACKAGES = ("crossover", "jax", "jaxlib", "numpy", "sqlalchemy", "matplotlib", "optuna")
"""Distributions whose versions the header lists."""


def _proc_field(path: str, key: str) -> str | None:
    """The value of the first `key: value` line of a /proc file (None off Linux)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        return None
    return None


def machine_facts() -> dict:
    """CPU model, cores, RAM, OS, Python and package versions of this machine."""
    from importlib import metadata

    mem = _proc_field("/proc/meminfo", "MemTotal")
    ram = f"{int(mem.split()[0]) / 2**20:.1f} GiB" if mem and mem.split()[0].isdigit() else "unknown"
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {"host": platform.node(), "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor()
            or platform.machine(), "cores": os.cpu_count(), "ram": ram, "os": platform.platform(),
            "python": platform.python_version(), "packages": versions}


def machine() -> str:
    """This machine in one line (machine_facts)."""
    f = machine_facts()
    return f"{f['host']}: {f['cpu']}, {f['cores']} cores, {f['ram']} RAM, {f['os']}, Python {f['python']}"


def versions() -> str:
    return ", ".join(f"{k} {v}" for k, v in machine_facts()["packages"].items())


def _utc(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def header(req: ReportRequest, t: Telemetry, revision: str | None) -> list[str]:
    techs = ", ".join(f"{k} ({v} steps)" for k, v in sorted(t.techniques.items())) or "none"
    src = (f"`{req.source_command}`" if req.source_command else
           "not recorded (the database does not store it; pass `--source-command` to name it)")
    p = req.plan
    return [
        "# crossover findings: the four open questions", "",
        ("Made from a telemetry database alone (plus the memory planner). Measured numbers come from the "
        "database; anything from the planner or the roofline model is labelled PREDICTION or PROJECTION."),
        "", f"- **Date**: {_utc(time.time())}",
        f"- **Machine** (where this report was made): {machine()}",
        f"- **Packages**: {versions()}",
        f"- **Database**: `{shown_url(req.db)}` (schema revision {revision or '?'})"
        + (f", instance `{req.instance}`" if req.instance is not None else ", every instance"),
        f"- **Report command**: `{report_command(req)}`",
        f"- **Command that produced the database**: {src}",
        *([f"- **Note**: {req.note}"] if req.note else []),
        *([f"- **What ran** (every run's policy version, technique, split, wall time): `{req.facts}`"]
          if req.facts else []),
        (f"- **Data**: {t.steps} raw steps from {_utc(t.first_time)} to {_utc(t.last_time)}, {t.requests} "
        f"requests; instances: {', '.join(repr(x) for x in sorted(t.instances)) or 'none'}; tenants: "
        f"{', '.join(sorted(t.tenants)) or 'none'}; techniques: {techs}. {t.rollup_minutes} per-minute "
        "rollups of older steps exist and are not used (they keep no tenants or per-step times)."
        + (f" Counted apart: {sum(r.steps for r in t.pool_runs.values())} steps of {len(t.pool_runs)} "
           f"pool-split runs (policy versions) of instance `{t.pool_instance}`, shown in Q3 only."
           if t.pool_instance else "")),
        (f"- **Planner inputs**: model {p.model} (the database does not record the served model), "
        f"{p.weight_dtype} weights, {p.kv_dtype} KV, context {p.context} tokens, page {p.page_size}."), "",
    ]


def build_report(req: ReportRequest) -> Path:
    """Write `req.out`/README.md and its figures; return the README's path."""
    from store.migrate import current_revision

    try:
        early = load_runs(tuple(req.early_exit))
    except EarlyExitFileError as exc:
        raise ReportInputError(str(exc)) from None
    out = prepare_out(Path(req.out))
    engine = open_database(req.db)
    try:
        telemetry = read_telemetry(engine, req.instance, req.pool_instance, req.tenant_instance)
        rounds = read_rounds(engine)
    finally:
        engine.dispose()
    revision = current_revision(req.db)
    body = q1_section(telemetry, out) + q1_sequences.section(rounds.q1, out)
    q2 = q2_measured_section(telemetry, out)
    body += q2[:2] + q2_rounds.section(rounds.q2, out) + q2[2:]
    body += q2_predicted_section(telemetry, req.plan, out)
    q3 = q3_section(telemetry, req.plan, out)
    body += q3[:2] + q3_rounds.section(rounds.q3, out) + q3[2:]
    body += q4_section(telemetry, out, early_section(early, out))
    # the answers come first but are written last: they show the figures the sections drew
    lines = (header(req, telemetry, revision) + table(rounds, telemetry, req.plan, early)
             + summary(telemetry, req.plan, early, out, rounds) + body)
    path = out / README
    path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return path
