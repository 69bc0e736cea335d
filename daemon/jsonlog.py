"""Structured logs: one JSON object per line on stderr.

`log_event(logger, "request", status=200, ...)` puts the keyword fields next
to the standard ones (ts, level, logger, msg).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, Any

_FIELDS_ATTR = "crossover_fields"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(getattr(record, _FIELDS_ATTR, {}))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str = "info", stream: IO[str] | None = None) -> None:
    """Send every log record to `stream` (stderr) as JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").disabled = True


def log_event(logger: logging.Logger, msg: str, level: int = logging.INFO, **fields: Any) -> None:
    logger.log(level, msg, extra={_FIELDS_ATTR: fields})


def ms_since(start: float) -> float:
    """Milliseconds since `start` (a time.monotonic() value), rounded to 0.1."""
    return round((time.monotonic() - start) * 1000.0, 1)
