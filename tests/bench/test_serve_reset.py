"""`bench serve --url --admin-token`: the daemon's prefix cache is emptied through its admin API
before each HTTP round and the idle phase, as the engine started here has its own emptied; without
a token it is not, the JSON says so and a warning tells why the idle TTFT is low."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest

from cli.main import main as cli
from engine.fake import FakeEngine
from tests.bench.test_serve import STEP_MS, bench
from tests.daemon.helpers import LiveServer

TOKEN = "bench-admin-token"
FLAGS = ("--requests", "4", "--concurrency", "2", "--max-tokens", "3")


class CountingResets(FakeEngine):
    """Records, at each prefix-cache reset, how many requests the daemon had served."""

    def __init__(self) -> None:
        super().__init__(step_delay_s=STEP_MS / 1000.0)
        self.resets: list[int] = []
        self.served = 0

    def reset_prefix_cache(self) -> Future:
        self.resets.append(self.served)
        return super().reset_prefix_cache()

    def _finish(self, seq, reason):  # type: ignore[no-untyped-def]
        self.served += 1
        return super()._finish(seq, reason)


def test_the_admin_token_resets_the_daemons_cache_before_each_phase(
        tmp_path: Path, live: Callable[..., LiveServer], capsys: pytest.CaptureFixture) -> None:
    engine = CountingResets()
    server = live(engine, admin_token=TOKEN)
    result = bench(tmp_path, "--url", server.url, "--admin-token", TOKEN, "--rounds", "2", *FLAGS)
    per_round = engine.resets[1]  # the jobs and the warm-up request(s) of one round
    assert engine.resets == [0, per_round, 2 * per_round] and per_round >= 5  # 2 rounds, then idle
    idle = result["ttft_vs_idle"]
    assert idle["idle_prefix_cache"] == "reset" and idle["prefix_cache_emptied"] is True
    assert result["config"]["admin_token"] == "***"
    assert TOKEN not in (tmp_path / "serve.json").read_text()
    assert "warning" not in capsys.readouterr().err


def test_without_a_token_the_cache_stays_and_the_json_says_so(
        tmp_path: Path, live: Callable[..., LiveServer], capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CROSSOVER_ADMIN_TOKEN", raising=False)
    engine = CountingResets()
    server = live(engine, admin_token=TOKEN)
    result = bench(tmp_path, "--url", server.url, *FLAGS)
    assert engine.resets == []
    idle = result["ttft_vs_idle"]
    assert idle["idle_prefix_cache"] == "not reset" and idle["prefix_cache_emptied"] is False
    err = capsys.readouterr().err
    assert "warning: without --admin-token the daemon at" in err and "idle TTFT may come out low" in err


def test_the_token_comes_from_the_environment_too(
        tmp_path: Path, live: Callable[..., LiveServer], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CROSSOVER_ADMIN_TOKEN", TOKEN)
    engine = CountingResets()
    server = live(engine, admin_token=TOKEN)
    result = bench(tmp_path, "--url", server.url, "--no-idle-ttft", *FLAGS)
    assert engine.resets == [0] and result["config"]["admin_token"] == "***"


def test_a_wrong_token_fails_before_any_load(tmp_path: Path, live: Callable[..., LiveServer],
                                             capsys: pytest.CaptureFixture) -> None:
    engine = CountingResets()
    server = live(engine, admin_token=TOKEN)
    out = tmp_path / "serve.json"
    assert cli(["bench", "serve", "--url", server.url, "--admin-token", "wrong", "--out", str(out),
                *FLAGS]) == 2
    err = capsys.readouterr().err
    assert "/admin/reset_prefix_cache: HTTP 403" in err and "invalid_admin_token" in err
    assert engine.served == 0 and not out.exists()


def test_a_token_without_url_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "serve.json"
    assert cli(["bench", "serve", "--fake", "--admin-token", TOKEN, "--out", str(out), *FLAGS]) == 2
    assert "pass --url too" in capsys.readouterr().err and not out.exists()
