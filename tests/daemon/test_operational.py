"""Operational edges in-process: /metrics behind the admin token; engine exception text goes to the
log, never to a client."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from engine.fake import FakeEngine
from engine.types import StepOutput
from tests.daemon.helpers import MODEL, LiveServer, parse_sse

SECRET = "device-0x7f3a kernel fault at /opt/secret/path.py"
"""What the broken engine raises: nothing of it may reach a client."""


class BrokenEngine(FakeEngine):
    def step(self) -> StepOutput:
        if self.has_work():
            raise RuntimeError(SECRET)
        return super().step()


def test_metrics_can_be_put_behind_the_admin_token(live: Callable[..., LiveServer]) -> None:
    server = live(admin_token="adm1n", metrics_require_admin=True)
    assert server.get("/metrics").status == 401
    r = server.get("/metrics", {"Authorization": "Bearer not-it"})
    assert r.status == 403 and r.json()["error"]["code"] == "invalid_admin_token"
    r = server.get("/metrics", {"Authorization": "Bearer adm1n"})
    assert r.status == 200 and b"crossover_engine_steps_total" in r.data
    open_metrics = live(admin_token="adm1n")  # the default: anyone may scrape, as in vLLM
    assert open_metrics.get("/metrics").status == 200


@pytest.mark.parametrize("stream", [False, True])
def test_engine_exception_text_is_logged_not_returned(
        stream: bool, live: Callable[..., LiveServer], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    server = live(BrokenEngine())
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "abc", "stream": stream})
    if stream:
        assert r.status == 200
        error = parse_sse(r.data)[-2]["error"]
    else:
        assert r.status == 500
        error = r.json()["error"]
    assert (error["code"], error["type"]) == ("engine_error", "server_error")
    texts = [r.data.decode(), server.get("/health").data.decode(), server.get("/ready").data.decode()]
    texts.append(server.post("/v1/completions", {"model": MODEL, "prompt": "abc"}).data.decode())
    for text in texts:
        assert "secret" not in text and "RuntimeError" not in text and "0x7f3a" not in text, text
    assert any(rec.getMessage() == "engine error" for rec in caplog.records)  # names the request
    logged = [f"{rec.getMessage()} {rec.exc_info[1] if rec.exc_info else ''} "
              f"{getattr(rec, 'crossover_fields', '')}" for rec in caplog.records]
    assert any(SECRET in line for line in logged)  # the text is in the server log
