"""The stored status of a finished request.

Telemetry has no record types of its own: `Recorder.record_step` takes the
engine's `StepStats` and `Recorder.record_request` its `RequestResult` (or any
object with their attributes), and the writer reads the columns off the
table models. The one column a record does not carry is a request's status,
derived here from its finish reason (an object may also carry `status`).
"""

from __future__ import annotations

REQUEST_STATUS_BY_REASON = {"abort": "aborted", "error": "error"}


def request_status(finish_reason: str, status: str | None = None) -> str:
    """The stored status: `status` when given, else derived from the finish reason.

    >>> request_status("length"), request_status("abort"), request_status("stop", "error")
    ('ok', 'aborted', 'error')
    """
    return status or REQUEST_STATUS_BY_REASON.get(finish_reason, "ok")
