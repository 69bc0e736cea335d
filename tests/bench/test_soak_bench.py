"""`crossover bench soak` end to end on the fake engine (a `crossover serve` child, short
timeouts from the environment), and its audit's pieces on inputs that must fail them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.soak import log_findings, run_soak, within
from bench.soak_clients import bad_cases, parse_answer
from bench.soak_daemon import SoakConfig
from bench.soak_run import percentile

pytestmark = pytest.mark.xdist_group("soak-bench")

SHORT = {"CROSSOVER_HEADER_TIMEOUT_S": "3", "CROSSOVER_BODY_TIMEOUT_S": "3",
         "CROSSOVER_STREAM_WRITE_TIMEOUT_S": "2", "CROSSOVER_STREAM_IDLE_TIMEOUT_S": "3",
         "CROSSOVER_TUNER_VALIDATION_S": "2"}


def test_the_soak_on_the_fake_engine_passes_every_check(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SHORT.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "soak.json"
    # the fake engine's phases last a fraction of a second: their TTFT ratio is noise, not a finding
    cfg = SoakConfig(requests=300, well_formed=60, hostile=10, engine_hostile=2, fake=True, ttft_ratio=100.0,
                     work_dir=str(tmp_path))
    result = run_soak(cfg, str(out), note=lambda line: None)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    failed = {name: c for name, c in result["checks"].items() if not c["passed"]}
    assert not failed, failed
    checks = result["checks"]
    assert checks["load"]["requests"] >= 300 and checks["load"]["hostile_peak_at_once"] == 12
    assert checks["telemetry_rows"]["rows"] == checks["telemetry_rows"]["engine_finished"] >= 120
    assert checks["search_process_killed"]["killed_retune"]["status"] in ("failed", "applied", "rejected")
    # every bad input was sent and refused as documented; slowloris and idle sockets were closed
    names = {case.name for case in bad_cases("m", "k", "t", 4096, 1 << 20)}
    assert names <= set(result["bad_inputs"])
    assert result["soak"]["statuses"] == {"200": 60} and result["baseline"]["statuses"] == {"200": 60}
    assert Path(checks["no_traceback_in_log"]["copy"]).exists()


def test_a_bad_config_names_its_flag() -> None:
    with pytest.raises(ValueError, match="--well-formed must be >= 1"):
        SoakConfig(well_formed=0).check()


def test_the_log_check_finds_a_traceback_and_counts_levels(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    log.write_text("\n".join([
        json.dumps({"level": "info", "msg": "request"}),
        json.dumps({"level": "warning", "msg": "client stopped reading"}),
        json.dumps({"level": "error", "msg": "retune 1 failed",
                    "exc": "Traceback (most recent call last):\n  File ..."}),
        "not json"]) + "\n")
    found = log_findings(log)
    assert found["tracebacks"] == 1
    assert found["levels"] == {"info": 1, "warning": 1, "error": 1, "not_json": 1}
    assert found["messages"]["error"] == ["retune 1 failed"]


def test_levels_and_percentiles() -> None:
    assert within(100, 105, 0.05) and not within(100, 106, 0.05) and not within(100, 94, 0.05)
    assert percentile([], 99) is None and percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(map(float, range(1, 101))), 99) == 99.0


def test_a_raw_answer_is_parsed_and_a_closed_socket_is_status_0() -> None:
    raw = parse_answer(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n\r\n{\"error\": {}}")
    assert (raw.status, raw.headers["content-type"], raw.body) == (400, "application/json", b'{"error": {}}')
    assert parse_answer(b"").status == 0
