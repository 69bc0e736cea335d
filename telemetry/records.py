"""Telemetry record types: mirrors of the engine's `StepStats` and `RequestResult`.

telemetry never imports engine/; the field names here are kept identical to the
engine's (a test checks), so the daemon converts with
`StepRecord(**dataclasses.asdict(stats))` — or skips converting:
`Recorder.record_step` accepts any object with these attributes, such as a
`StepStats` itself, and reads them on its own thread.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

REQUEST_STATUS_BY_REASON = {"abort": "aborted", "error": "error"}


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one engine step did (one row of `xo_steps`)."""

    step_id: int
    time: float
    """Wall-clock start of the step (unix seconds)."""
    batch_size: int
    """Sequences that produced or consumed tokens this step."""
    prefill_tokens: int
    decode_tokens: int
    """Output tokens emitted this step (what goodput counts)."""
    technique: str
    """"none" for plain decode, else the proposer's name."""
    depth: int
    proposed: int
    accepted: int
    accepted_per_pos: tuple[int, ...]
    """accepted_per_pos[i]: drafts accepted at draft position i (len == depth)."""
    propose_ms: float
    verify_ms: float
    step_ms: float
    kv_pages_used: int
    kv_pages_free: int
    queue_len: int
    policy_version: int
    preempted: int = 0
    tenants: tuple[str, ...] = ()
    """Tenants with a sequence in this step's batch."""


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


STEP_FIELDS = tuple(f.name for f in fields(StepRecord))
REQUEST_FIELDS = tuple(f.name for f in fields(RequestRecord))


def request_status(finish_reason: str, status: str | None = None) -> str:
    """The stored status: `status` when given, else derived from the finish reason.

    >>> request_status("length"), request_status("abort"), request_status("stop", "error")
    ('ok', 'aborted', 'error')
    """
    return status or REQUEST_STATUS_BY_REASON.get(finish_reason, "ok")
