"""`crossover tenants add|list|revoke`: keys shown once, unique names, limits checked and listed."""

from __future__ import annotations

import json

import pytest

from cli.main import main as cli
from tests.daemon.tenants.helpers import add_tenant


def test_cli_add_list_revoke(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["db", "upgrade", "--db", db_url]) == 0
    capsys.readouterr()
    key = add_tenant(db_url, "team-a", "--max-concurrent", "4", capsys=capsys)
    assert key.startswith("xo-") and len(key) > 40
    assert cli(["tenants", "add", "team-a", "--db", db_url]) == 2  # names are unique
    assert "already exists" in capsys.readouterr().err
    assert cli(["tenants", "add", "default", "--db", db_url]) == 2  # the open-mode tenant
    assert cli(["tenants", "list", "--db", db_url]) == 0
    listing = capsys.readouterr().out
    assert "team-a" in listing and " 4 " in listing and key not in listing
    assert cli(["tenants", "revoke", "team-a", "--db", db_url]) == 0
    assert cli(["tenants", "revoke", "nobody", "--db", db_url]) == 2
    capsys.readouterr()
    assert cli(["tenants", "list", "--json", "--db", db_url]) == 0
    assert '"active": false' in capsys.readouterr().out


def test_cli_refuses_a_database_without_the_schema(db_url: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["tenants", "list", "--db", db_url]) == 2
    assert f"crossover db upgrade --db {db_url}" in capsys.readouterr().err


def test_cli_sets_and_lists_the_token_and_queue_limits(
        db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["db", "upgrade", "--db", db_url]) == 0
    add_tenant(db_url, "team-a", "--max-concurrent", "2", "--max-queued", "0", "--max-tokens",
               "64", capsys=capsys)
    add_tenant(db_url, "team-b", capsys=capsys)
    assert cli(["tenants", "add", "team-c", "--max-tokens", "0", "--db", db_url]) == 2
    assert "max_tokens must be an integer in [1, 2147483647]" in capsys.readouterr().err
    assert cli(["tenants", "add", "team-c", "--max-queued", "-1", "--db", db_url]) == 2
    assert "max_queued must be an integer in [0, 2147483647]" in capsys.readouterr().err
    assert cli(["tenants", "add", "team-c", "--max-concurrent", str(2**31), "--db", db_url]) == 2
    assert "max_concurrent must be an integer in [1, 2147483647]" in capsys.readouterr().err
    assert cli(["tenants", "list", "--db", db_url]) == 0
    header, row_a, row_b = capsys.readouterr().out.splitlines()
    assert header.split()[:5] == ["name", "active", "max_concurrent", "max_queued", "max_tokens"]
    assert row_a.split()[:5] == ["team-a", "yes", "2", "0", "64"]
    assert row_b.split()[:5] == ["team-b", "yes", "-", "-", "-"]
    assert cli(["tenants", "list", "--json", "--db", db_url]) == 0
    views = {v["name"]: v for v in json.loads(capsys.readouterr().out)}
    assert (views["team-a"]["max_queued"], views["team-a"]["max_tokens"]) == (0, 64)
    assert (views["team-b"]["max_queued"], views["team-b"]["max_tokens"]) == (None, None)
