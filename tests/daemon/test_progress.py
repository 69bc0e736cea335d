"""daemon/progress.py: tqdm bars on a terminal, throttled JSON log events under `crossover serve`,
and nothing drawn (informational lines only) anywhere else."""

from __future__ import annotations

import io
import json
import logging

import pytest

from daemon.jsonlog import JsonFormatter
from daemon.progress import JsonProgress, TerminalProgress, reporter
from engine.runtime.progress import Steps, note


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture()
def json_log() -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("test.progress")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger, stream


def test_the_kind_of_reporter_follows_the_stream() -> None:
    assert isinstance(reporter(stream=Tty()), TerminalProgress)
    assert isinstance(reporter(json_events=True, stream=Tty()), TerminalProgress)  # a person watches
    assert isinstance(reporter(json_events=True, stream=io.StringIO()), JsonProgress)
    assert reporter(stream=io.StringIO()) is True  # piped: the engine prints its lines, draws no bar


def test_json_events_are_throttled_per_label_and_always_end(json_log) -> None:
    logger, stream = json_log
    now = [0.0]
    progress = JsonProgress(logger, interval_s=2.0, clock=lambda: now[0])
    for done in range(11):  # 0.5 s apart: one event per 2 s, plus the end
        progress("warmup", done, 10)
        if done < 3:
            progress("convert", done, 10)
        now[0] += 0.5
    note(progress, "engine: loaded")
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    warm = [e for e in events if e.get("label") == "warmup"]
    assert [e["done"] for e in warm] == [0, 4, 8, 10]
    assert warm[-1]["total"] == 10 and warm[-1]["seconds"] == 5.0 and warm[0]["msg"] == "progress"
    assert [e["done"] for e in events if e.get("label") == "convert"] == [0]  # unfinished: no end yet
    assert events[-1]["msg"] == "engine: loaded" and "label" not in events[-1]


def test_a_terminal_gets_one_bar_per_label_closed_at_its_total() -> None:
    stream = Tty()
    progress = TerminalProgress(stream)
    with Steps(progress, "sha256 model.gguf", 300) as bar:
        for _ in range(3):
            bar.advance(100)
    note(progress, "engine: a line above the bars")
    out = stream.getvalue()
    assert "sha256 model.gguf" in out and "100%" in out and "300/300" in out
    assert "engine: a line above the bars\n" in out
    assert progress._bars == {}  # closed at its total


def test_without_a_callback_nothing_is_drawn(capsys: pytest.CaptureFixture) -> None:
    with Steps(True, "work", 3) as bar:
        bar.advance(3)
    note(True, "engine: loaded")
    note(False, "engine: silent")
    assert capsys.readouterr().err == "engine: loaded\n"
