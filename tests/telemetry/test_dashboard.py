"""optuna-dashboard opens the telemetry database and lists the tuner's study."""

from __future__ import annotations

import io
import json

import optuna
import pytest

from store.migrate import check_schema


def test_optuna_dashboard_lists_the_study(db_url: str) -> None:
    dashboard = pytest.importorskip("optuna_dashboard")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="crossover-tuner", storage=db_url)
    study.tell(study.ask(), 1.0)
    app = dashboard.wsgi(db_url)
    status: list[str] = []
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/api/studies", "QUERY_STRING": "",
               "SERVER_NAME": "test", "SERVER_PORT": "80", "wsgi.input": io.BytesIO(),
               "wsgi.url_scheme": "http", "wsgi.errors": io.StringIO()}  # fmt: skip
    body = b"".join(app(environ, lambda s, headers, exc=None: status.append(s)))
    assert status[0].startswith("200")
    names = [s["study_name"] for s in json.loads(body)["study_summaries"]]
    assert names == ["crossover-tuner"]
    check_schema(db_url)  # and crossover still accepts the file
