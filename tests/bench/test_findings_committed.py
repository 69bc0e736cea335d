"""The committed findings report regenerates: its database is at the schema head, and the
report command written in its header renders the same body from it."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import shutil
from pathlib import Path

from bench.report.build import ReportRequest, build_report, report_command
from cli.commands import report as report_cli
from store.migrate import current_revision, head_revision

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "docs/findings/README.md"
MACHINE_LINES = ("- **Date**:", "- **Machine**", "- **Packages**:", "- **Database**:")
"""Header lines that name when, where and from which copy of the database the report was made."""


def _committed_command() -> str:
    (line,) = [x for x in REPORT.read_text().splitlines() if x.startswith("- **Report command**: `")]
    return line.removeprefix("- **Report command**: `").removesuffix("`")


def _request(command: str) -> ReportRequest:
    words = shlex.split(command)
    assert words[:2] == ["crossover", "report"], command
    parser = argparse.ArgumentParser()
    report_cli.add_arguments(parser)
    return ReportRequest.from_flags(parser.parse_args(words[2:]))


def test_the_committed_database_is_at_the_schema_head() -> None:
    db = _request(_committed_command()).db
    assert current_revision(db) == head_revision(), f"upgrade it: crossover db upgrade --db {db}"


def test_the_report_command_in_the_header_renders_the_committed_body(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)  # the command's paths are the repository's
    committed = _request(_committed_command())
    assert report_command(committed) == _committed_command()  # every flag that made the header is in it
    copy = tmp_path / "findings.sqlite"
    shutil.copy(committed.db.removeprefix("sqlite:///"), copy)
    out = build_report(dataclasses.replace(committed, db=f"sqlite:///{copy}", out=tmp_path / "report"))

    def body(text: str) -> list[str]:
        return [x for x in text.splitlines() if not x.startswith((*MACHINE_LINES, "- **Report command**"))]

    assert body(out.read_text()) == body(REPORT.read_text())
    figures = sorted(p.name for p in out.parent.glob("*.png"))
    assert figures == sorted(p.name for p in REPORT.parent.glob("*.png"))


def test_the_committed_report_opens_with_verdicts_and_measures_q2_and_q3_in_rounds() -> None:
    text = REPORT.read_text()
    assert text.index("## Verdicts") < text.index("## Answers in short")
    assert "Not measured by this database's run" not in text
    assert "In 3 rounds, ratios formed within each round" in text  # Q2
    assert "In 3 rounds, plain decoding without speculation's memory" in text  # Q3
    assert "Plain decoding turns compute-bound at context 512" in text
