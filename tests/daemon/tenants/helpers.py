"""Shared by the tenant tests: add a tenant through the CLI, call the API with its key."""

from __future__ import annotations

import pytest

from cli.main import main as cli
from tests.daemon.helpers import MODEL, LiveServer, http_request

C = "/v1/completions"
SLOW = {"model": MODEL, "prompt": "s" * 30, "max_tokens": 30, "stream": True}


def add_tenant(db_url: str, name: str, *flags: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert cli(["tenants", "add", name, "--db", db_url, *flags]) == 0
    out = capsys.readouterr()
    assert "shown only now" in out.err
    return out.out.strip()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(server: LiveServer, key: str | None, **fields: object) -> tuple[int, dict]:
    headers = bearer(key) if key is not None else None
    r = http_request(server.port, "POST", C, {"model": MODEL, "prompt": "abc", **fields}, headers)
    return r.status, r.json()
