"""`crossover bench findings --quick`: the whole pipeline (fake engine -> telemetry -> report) in seconds."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from bench.findings import INSTANCE, POOL_INSTANCE, TENANT_INSTANCE
from bench.findings_config import REFERENCE_EXIT, FindingsConfig, default_early_exit, parse_size
from cli.main import main
from store.db import make_engine, session_scope
from store.models import Policy, Step

FIGURES = ("q1_acceptance.png", "q2_goodput_measured.png", "q3_pool.png", "q4_early_exit.png", "q4_moe.png")


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> tuple[Path, str, str]:
    tmp = tmp_path_factory.mktemp("findings")
    url, out = f"sqlite:///{tmp / 'findings.db'}", tmp / "report"  # a new file: the command migrates it
    assert main(["bench", "findings", "--db", url, "--out", str(out), "--quick",
                 "--note", "shared machine, test run"]) == 0
    return out, (out / "README.md").read_text(), url


def test_report_answers_every_question_with_a_figure(findings):
    out, text, _ = findings
    answers = text.split("## Answers in short")[1].split("\n## Q1.")[0]
    for q in ("Q1", "Q2", "Q3", "Q4"):
        part = answers.split(f"### {q}.")[1].split("\n### ")[0]
        assert "Source:" in part and "](q" in part, q  # a paragraph, a figure and where its numbers come from
    for heading in ("## Q1.", "## Q2.", "## Q3.", "## Q4.", "### Measured end to end",
                    "### Mixture of experts",
                    "### PREDICTED for TPU v6e-1 and H200"):
        assert heading in text, heading
    for name in FIGURES:
        assert f"]({name})" in text, name
        size = (out / name).stat().st_size
        assert 1000 < size < 200_000, (name, size)
    assert "crossover bench findings --db" in text and "--quick" in text  # the command that made the database
    assert "shared machine, test run" in text and "**Packages**" in text and "cores" in text
    assert "Engines: main: fake-reverse (fake), max batch 8" in text and "A pool split withholds" in text
    facts = json.loads((out / "findings.json").read_text())
    assert facts["machine"]["cores"] and facts["runs"] and set(facts["seconds"]) >= {"q1", "q2", "q3"}


def test_every_phase_is_in_one_database_with_its_policies(findings):
    out, text, url = findings
    runs = json.loads((out / "findings.json").read_text())["runs"]
    db = make_engine(url)
    try:
        with session_scope(db) as s:
            per_instance = dict(s.execute(select(Step.instance, func.count()).group_by(Step.instance)).all())
            versions = {(i, v) for i, v in s.execute(select(Policy.instance, Policy.version))}
            stepped = set(s.execute(select(Step.instance, Step.policy_version).distinct()).all())
            splits = {(p.instance, p.version): p.body["pool_split"] for p in s.scalars(select(Policy))}
    finally:
        db.dispose()
    cfg = FindingsConfig.quick_config("x", "y")
    rounds = range(1, cfg.rounds + 1)
    expected = {TENANT_INSTANCE, f"{TENANT_INSTANCE}-sampled", *(f"{POOL_INSTANCE}-r{r}" for r in rounds),
                *(f"{INSTANCE}-c{c}-r{r}" for c in cfg.contexts for r in rounds)}
    assert set(per_instance) == expected and min(per_instance.values()) > 0
    assert len(versions) == len(runs) and stepped <= versions  # every step names a stored policy
    draft_q3 = sorted(splits[(r["instance"], r["version"])] for r in runs if r["phase"] == "q3"
                      and r["technique"] == "draft")
    assert draft_q3 == [0.25] * cfg.rounds + [0.5] * cfg.rounds
    table = text.split("### Measured end to end")[1].split("\n### ")[0]
    assert "| draft@2 | 0.25 |" in table and "| draft@2 | 0.5 |" in table and "| none@0 | 0 |" in table


def test_quick_config_and_sizes():
    cfg = FindingsConfig.quick_config("sqlite://", "out")
    assert cfg.quick and cfg.max_batch >= max(cfg.batches)
    with pytest.raises(ValueError, match="splits"):
        FindingsConfig(db="x", splits=(0.75,))
    assert parse_size("256MiB") == 256 << 20
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")


def test_default_early_exit_takes_the_reference_alone_whatever_the_file_times(tmp_path):
    assert default_early_exit(tmp_path) == []
    ref, old, new = (tmp_path / n for n in (REFERENCE_EXIT, "older.json", "newer.json"))
    for p in (ref, old, new):
        p.write_text("{}")
    now = time.time()
    os.utime(old, (now - 600, now - 600))
    os.utime(ref, (now - 300, now - 300))
    assert default_early_exit(tmp_path) == [str(ref)]


@pytest.mark.parametrize("flags, expect",
                         [(["--splits", "0.9"], "splits"), (["--kv-budget", "lots"], "not a size"),
                                           (["--early-exit", "no-such.json"], "no-such.json")])
def test_bad_flags_exit_2_naming_them(flags, expect, tmp_path, capsys):
    db = tmp_path / "never.db"
    assert main(["bench", "findings", "--db", str(db), "--out", str(tmp_path / "r"), "--quick", *flags]) == 2
    err = capsys.readouterr().err
    assert "crossover bench: error: bench findings:" in err and expect in err
    assert not db.exists()  # refused before anything was measured


def test_a_later_phases_run_appends_to_the_same_database(findings):
    out, _, url = findings
    before = json.loads((out / "findings.json").read_text())["runs"]
    assert main(["bench", "findings", "--db", url, "--out", str(out), "--quick", "--phases", "q3"]) == 0
    facts = json.loads((out / "findings.json").read_text())
    assert [r["phase"] for r in facts["runs"]] == ["q3"] * 12 and facts["earlier"][0]["runs"] == before
    assert min(r["version"] for r in facts["runs"]) == max(r["version"]
                                                           for r in before) + 1  # versions continue
    text = (out / "README.md").read_text()
    assert ("--note 'shared machine, test run'; then crossover bench findings" in text
            and "--phases q3" in text)
    table = text.split("### Measured end to end")[1].split("\n### ")[0]
    assert table.count("| draft@2 | 0.25 |") == 6  # both commands' pool runs (3 rounds each) are there
