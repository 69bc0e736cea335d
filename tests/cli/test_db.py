"""`crossover db upgrade|current` through the command module."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from cli.commands import db as db_command
from store import migrate

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "telemetry_rev1.sqlite"


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="crossover db")
    db_command.add_arguments(parser)
    return db_command.run(parser.parse_args(argv))


def test_current_then_upgrade_the_fixture(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "old.db"
    shutil.copyfile(FIXTURE, path)
    assert _run("current", "--db", str(path)) == 1
    out = capsys.readouterr().out
    assert "current:  0001" in out and f"crossover db upgrade --db sqlite:///{path}" in out

    assert _run("upgrade", "--db", str(path)) == 0
    assert f"0001 -> {migrate.head_revision()}" in capsys.readouterr().out
    assert _run("current", "--db", f"sqlite:///{path}") == 0
    assert "up to date" in capsys.readouterr().out


def test_default_database_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setenv("CROSSOVER_DB", str(tmp_path / "env.db"))
    assert _run("upgrade") == 0
    assert migrate.check_schema(str(tmp_path / "env.db")) == migrate.head_revision()
    assert "empty -> " in capsys.readouterr().out


def test_unreachable_database_is_a_user_error(tmp_path: Path) -> None:
    from daemon.user_error import UserError

    with pytest.raises(UserError, match="unable to open"):
        _run("upgrade", "--db", str(tmp_path / "no" / "such" / "dir.db"))


def test_an_action_is_required() -> None:
    with pytest.raises(SystemExit):
        _run()
