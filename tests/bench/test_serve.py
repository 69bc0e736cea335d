"""`crossover bench serve` on the fake engine: the JSON's numbers are consistent."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.loadgen import Sample, forget_prefixes
from bench.serve_stats import distribution, ttft_vs_idle
from cli.main import main as cli
from engine.fake import FakeEngine
from tests.bench.conftest import recording_resets
from tests.daemon.helpers import LiveServer

STEP_MS = 4.0


def bench(tmp_path: Path, *flags: str) -> dict[str, Any]:
    out = tmp_path / "serve.json"
    assert cli(["bench", "serve", "--fake", "--fake-step-ms", str(STEP_MS), "--out", str(out),
                *flags]) == 0
    return json.loads(out.read_text())


def check_phase(phase: dict[str, Any], requests: int, max_tokens: int) -> None:
    assert (phase["requests"], phase["errors"]) == (requests, 0), phase["error_examples"]
    assert phase["output_tokens"] == requests * max_tokens  # ignore_eos: exactly what was asked
    assert phase["output_tokens_per_s"] == pytest.approx(
        phase["output_tokens"] / phase["duration_s"], rel=1e-3)
    assert phase["requests_per_s"] == pytest.approx(requests / phase["duration_s"], rel=1e-3)
    for name in ("ttft_ms", "tpot_ms", "latency_ms"):
        d = phase[name]
        assert d["n"] == requests
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (name, d)
    assert phase["ttft_ms"]["p99"] <= phase["latency_ms"]["p99"]
    assert phase["tpot_ms"]["p50"] >= STEP_MS * 0.5  # one fake step (a sleep) per token
    # every token after the first takes a TPOT: latency covers them all
    assert phase["latency_ms"]["mean"] >= phase["tpot_ms"]["mean"] * (max_tokens - 1)


def test_closed_loop_http_and_engine_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    result = bench(tmp_path, "--requests", "12", "--concurrency", "3", "--max-tokens", "8",
                   "--rounds", "2")
    http, engine, rounds = result["http"], result["engine_only"], result["rounds"]
    assert len(rounds) == 2  # each phase reports its fastest round
    assert http["output_tokens_per_s"] == max(r["http_output_tokens_per_s"] for r in rounds)
    assert engine["output_tokens_per_s"] == max(r["engine_only_output_tokens_per_s"] for r in rounds)
    check_phase(http, 12, 8)
    check_phase(engine, 12, 8)
    assert http["prompt_tokens"] == engine["prompt_tokens"] > 12  # the same prompts, both ways
    assert result["http_over_engine"] == pytest.approx(
        http["output_tokens_per_s"] / engine["output_tokens_per_s"], rel=1e-3)
    assert 0 < result["http_over_engine"] < 2
    assert result["engine"] == "FakeEngine" and result["config"]["concurrency"] == 3
    err = capsys.readouterr().err
    assert "http: 12/12 requests done" in err and "round 2 engine only" in err
    assert "http_over_engine" in err
    idle = result["ttft_vs_idle"]  # each request sent again alone, for one token
    assert idle["requests"] == idle["per_request"]["n"] == idle["idle_ttft_ms"]["n"] == 12
    assert idle["prefix_cache_emptied"] is True and "ttft vs idle" in err
    assert idle["loaded_p99_over_idle_p99"] == pytest.approx(
        idle["loaded_ttft_ms"]["p99"] / idle["idle_ttft_ms"]["p99"], rel=1e-2)
    assert idle["loaded_ttft_ms"]["p50"] == pytest.approx(http["ttft_ms"]["p50"], rel=1e-3)


def test_ttft_vs_idle_pairs_each_request_with_itself() -> None:
    loaded = [Sample(0, ttft_s=0.3), Sample(1, ttft_s=0.8), Sample(2, ttft_s=0.5, error="boom"),
              Sample(3, ttft_s=0.9)]
    idle = [Sample(1, ttft_s=0.2), Sample(0, ttft_s=0.1), Sample(2, ttft_s=0.1)]  # 3: never alone
    out = ttft_vs_idle(loaded, idle, True)
    assert out["requests"] == 2  # 2 failed loaded, 3 has no idle TTFT
    assert (out["per_request"]["p50"] == pytest.approx(3.5)
            and out["per_request"]["p99"] == pytest.approx(3.99))
    assert out["loaded_p99_over_idle_p99"] == pytest.approx(0.795 / 0.199, rel=1e-3)
    assert "reason" in ttft_vs_idle(loaded, [], False)


def test_an_idle_phase_without_a_ttft_reports_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    from bench import serve

    async def failed(*_a: Any) -> tuple[list[Sample], bool]:
        return [Sample(0, error="HTTP 503")], True

    monkeypatch.setattr(serve, "_idle_phase", failed)
    result = bench(tmp_path, "--requests", "2", "--concurrency", "2", "--max-tokens", "2", "--no-db")
    assert "no request has both" in result["ttft_vs_idle"]["reason"]
    assert "ttft vs idle: no request has both" in capsys.readouterr().err


def test_no_idle_ttft_skips_the_idle_phase(tmp_path: Path) -> None:
    result = bench(tmp_path, "--requests", "3", "--concurrency", "3", "--max-tokens", "2", "--no-db",
                   "--no-idle-ttft")
    assert "ttft_vs_idle" not in result and result["config"]["idle_ttft"] is False


def test_open_loop_sends_every_request(tmp_path: Path) -> None:
    result = bench(tmp_path, "--requests", "10", "--rate", "200", "--max-tokens", "6",
                   "--mix", "chat=1,code=1", "--no-db")
    check_phase(result["http"], 10, 6)
    check_phase(result["engine_only"], 10, 6)
    assert result["config"]["rate"] == 200 and result["http_over_engine"] > 0


def test_seconds_stop_the_sending_and_the_engine_gets_as_many(tmp_path: Path) -> None:
    result = bench(tmp_path, "--requests", "400", "--concurrency", "2", "--max-tokens", "10",
                   "--seconds", "0.3", "--no-db")
    sent = result["http"]["requests"]
    assert 2 <= sent < 400  # each request takes ~10 steps of 4 ms: far fewer fit in 0.3 s
    check_phase(result["http"], sent, 10)
    check_phase(result["engine_only"], sent, 10)


def test_a_running_daemon_by_url(tmp_path: Path, live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(step_delay_s=STEP_MS / 1000.0))
    result = bench(tmp_path, "--url", server.url, "--requests", "5", "--concurrency", "2",
                   "--max-tokens", "4", "--api-key", "xo-secret")  # open mode ignores it
    check_phase(result["http"], 5, 4)
    assert result["config"]["api_key"] == "***"
    assert "xo-secret" not in (tmp_path / "serve.json").read_text()
    assert "engine_only" not in result and result["http_over_engine"] is None
    assert server.sink.results[-1].output_tokens == 1  # the last one sent alone, for TTFT
    assert result["ttft_vs_idle"]["requests"] == 5 and result["ttft_vs_idle"]["prefix_cache_emptied"] is False


@pytest.mark.parametrize("flags,message", [
    (["--mix", "copy=1,poetry=2"], "unknown prompt kind"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--rate", "-1"], "--rate must be positive"),
    (["--max-context", "40"], "prompts fit max_context 40"),
])
def test_bad_flags_are_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture,
                                   flags: list[str], message: str) -> None:
    out = tmp_path / "x.json"
    assert cli(["bench", "serve", "--fake", "--requests", "2", "--out", str(out), *flags]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_percentiles_interpolate_linearly_between_ranks() -> None:
    seconds = [v / 1000.0 for v in (7, 1, 10, 4, 2, 9, 3, 8, 5, 6)]  # 1..10 ms, unsorted
    got = distribution(seconds + [None])
    assert got == pytest.approx({"n": 10, "mean": 5.5, "p50": 5.5, "p90": 9.1, "p99": 9.91})
    assert all(type(v) in (int, float) for v in got.values())  # plain numbers for the JSON
    assert distribution([0.004]) == {"n": 1, "mean": 4.0, "p50": 4.0, "p90": 4.0, "p99": 4.0}
    assert distribution([None, None]) == {"n": 0, "mean": None, "p50": None, "p90": None,
                                          "p99": None}


def test_read_sse_yields_each_data_chunk_up_to_done() -> None:
    """The SSE parser bench serve and bench tuner share: non-data lines skipped, text counted from
    completions' `text` and chat's `delta.content`, finish, usage and errors kept, [DONE] ends it."""
    import asyncio

    from bench.loadgen import SseChunk, read_sse

    lines = [b": keep-alive\n", b"\n",
             b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n',
             b'data: {"choices": [{"delta": {"content": ""}}, {"delta": {"content": "b"}}]}\n',
             b'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n',
             b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n',
             b'data: {"error": {"message": "boom", "code": "aborted"}}\n',
             b"data: [DONE]\n", b'data: {"choices": [{"text": "after done"}]}\n']

    async def collect() -> list[SseChunk]:
        async def source():
            for line in lines:
                yield line
        return [c async for c in read_sse(source())]

    assert asyncio.run(collect()) == [
        SseChunk(texts=1), SseChunk(texts=1), SseChunk(finished=True),
        SseChunk(usage={"prompt_tokens": 3, "completion_tokens": 2}), SseChunk(error="boom")]


def test_no_prefix_cache_reaches_the_engine_started_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """--no-prefix-cache is what `load_engine` gets (the cache is on without it)."""
    import engine.loader
    from bench.serve import _load_engine
    from cli.commands.bench import _serve_config
    from cli.main import build_parser

    seen: list[bool] = []

    class Loaded:
        def warmup(self, progress: object = None) -> None:
            self.first_runs = self  # bench serve runs each shape once after warmup

        def run_all(self, progress: object = None) -> int:
            return 0

    def load_engine(**kw: object) -> Loaded:
        seen.append(bool(kw["prefix_cache"]))
        return Loaded()

    monkeypatch.setattr(engine.loader, "load_engine", load_engine)
    for flags, expected in (([], True), (["--no-prefix-cache"], False)):
        cfg = _serve_config(build_parser().parse_args(["bench", "serve", *flags]))
        assert cfg.prefix_cache is expected
        _load_engine(cfg)
    assert seen == [True, False]


def test_speculation_reaches_the_engine_started_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine started here loads n-gram only (the starter policy's technique) unless
    --no-speculation, and the engine-only phase serves the starter policy or never speculates."""
    import engine.loader
    from bench.serve import _load_engine, _policy
    from cli.commands.bench import _serve_config
    from cli.main import build_parser
    from engine.speculation.fake_speculation import FakeProposer

    seen: list[tuple[bool, tuple]] = []

    def load_engine(**kw: object) -> FakeEngine:
        seen.append((bool(kw["speculation"]), tuple(kw["model_proposers"])))  # type: ignore[arg-type]
        return FakeEngine(proposers={"ngram": FakeProposer("ngram")})

    monkeypatch.setattr(engine.loader, "load_engine", load_engine)
    policies = []
    for flags in ([], ["--no-speculation"]):
        cfg = _serve_config(build_parser().parse_args(["bench", "serve", *flags]))
        policies.append(_policy(cfg, _load_engine(cfg)))
    assert seen == [(True, ()), (False, ())]
    assert policies[0].choose(2) == ("ngram", 4) and policies[0].crossover == 8
    assert policies[1].choose(2) == ("none", 0)


def test_each_phase_starts_with_the_prefix_cache_emptied(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every phase sends the same prompts: the engine's prefix cache is emptied before each, while
    the engine is idle, so no phase skips the prefill of prompts the one before it sent."""
    from bench import serve

    resets: list[bool] = []
    monkeypatch.setattr(serve, "_load_engine", recording_resets(serve._load_engine, resets))
    bench(tmp_path, "--requests", "4", "--concurrency", "2", "--max-tokens", "4", "--rounds", "2", "--no-db")
    # 2 rounds of an HTTP and an engine-only phase, then the idle-TTFT phase, each on an idle engine
    assert resets == [False] * 5


def test_the_prefix_cache_is_emptied_after_a_leftover_abort() -> None:
    """A closed HTTP stream leaves an abort in the engine's inbox after the phase: the engine
    steps it away and the cache is still emptied (it was once skipped, so the engine-only
    phase found the HTTP phase's prompts cached and ran at twice the speed)."""
    engine = FakeEngine()
    resets: list[bool] = []

    class Pool:
        def reset(self) -> None:
            resets.append(engine.has_work())

    engine.pool = Pool()
    engine.abort("a-request-that-already-finished")
    assert engine.has_work()
    forget_prefixes(engine)
    assert resets == [False]
