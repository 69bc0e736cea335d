"""The request record and its status rule.

A step needs no record type of its own: `Recorder.record_step` takes the
engine's `StepStats` (or any object with its attributes) and the writer reads
the columns off `store.models.Step`. A finished request is the engine's
`RequestResult` plus what only the daemon knows (tenant, status), so it has
this record.
"""

from __future__ import annotations

from dataclasses import dataclass

REQUEST_STATUS_BY_REASON = {"abort": "aborted", "error": "error"}


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """Summary of a finished request (one row of `xo_requests`)."""

    request_id: str
    tenant: str
    prompt_tokens: int
    output_tokens: int
    arrival_time: float
    """When it was queued (unix seconds)."""
    first_token_time: float | None
    finish_time: float
    finish_reason: str
    """"stop", "length", "abort" (or "error" from the daemon)."""
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    preemptions: int = 0
    status: str | None = None
    """"ok", "aborted" or "error"; None derives it from finish_reason."""




def request_status(finish_reason: str, status: str | None = None) -> str:
    """The stored status: `status` when given, else derived from the finish reason.

    >>> request_status("length"), request_status("abort"), request_status("stop", "error")
    ('ok', 'aborted', 'error')
    """
    return status or REQUEST_STATUS_BY_REASON.get(finish_reason, "ok")
