"""Plain dataclasses that cross the engine's boundary (STYLE 5).

The daemon builds `Request`s, hands them to `EngineCore.add_request`, calls
`EngineCore.step()` in its own thread and fans the returned `TokenEvent`s out
to per-request queues; `StepStats` and `RequestResult` go to telemetry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (validated by `validate`)."""

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 0.0
    """0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 turns it off."""
    top_p: float = 1.0
    """Nucleus mass to keep; 1.0 turns it off."""
    seed: int | None = None
    """Same seed, same prompt, same settings -> same output."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the sequence (EOS always does unless ignore_eos)."""
    stop: tuple[str, ...] = ()
    """Strings that end the sequence; the text is cut before the match."""
    logprobs: bool = False
    """Return the log-probability of each chosen token."""
    ignore_eos: bool = False
    """Keep going past the model's own stop tokens (EOS, end of turn); stop_token_ids still apply."""

    def validate(self, max_stop_strings: int = 16, max_top_k: int = 256) -> None:
        """Raise ValueError naming the bad field and value."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or not (0 <= self.top_k <= max_top_k):
            raise ValueError(f"top_k must be an integer in [0, {max_top_k}], got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if len(self.stop) > max_stop_strings:
            raise ValueError(f"at most {max_stop_strings} stop strings, got {len(self.stop)}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    """One generation request as the engine sees it."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    arrival_time: float = field(default_factory=time.time)


@dataclass(frozen=True)
class TokenEvent:
    """New output of one request in one step (several tokens with speculation)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    """Newly decoded text (complete UTF-8 only; stop strings already cut)."""
    logprobs: tuple[float, ...] | None = None
    finished: bool = False
    finish_reason: str | None = None
    """"stop" (EOS, stop id or string), "length" (max_tokens or context) or "abort"."""


@dataclass(frozen=True)
class RequestResult:
    """Summary of a finished request, for telemetry."""

    request_id: str
    tenant: str
    prompt_tokens: int
    output_tokens: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    finish_reason: str
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    preemptions: int = 0


@dataclass(frozen=True)
class StepStats:
    """What one engine step did: the one definition of a step's record.

    Telemetry stores it as one `xo_steps` row (store.models.Step mirrors these
    fields, a test checks) and the tuner reads those rows back as StepStats.
    The engine fills every field; the zero defaults let tests and examples
    name only what matters to them.
    """

    step_id: int = 0
    time: float = 0.0
    """Wall-clock start of the step (unix seconds)."""
    batch_size: int = 0
    """Sequences that produced or consumed tokens this step."""
    prefill_tokens: int = 0
    decode_tokens: int = 0
    """Output tokens the decode batch emitted (one per sequence plus accepted drafts)."""
    technique: str = "none"
    """"none" for plain decode, else the proposer's name."""
    depth: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    """accepted_per_pos[i]: drafts accepted at draft position i (len == depth)."""
    propose_ms: float = 0.0
    verify_ms: float = 0.0
    step_ms: float = 0.0
    kv_pages_used: int = 0
    kv_pages_free: int = 0
    queue_len: int = 0
    policy_version: int = 0
    preempted: int = 0
    """Sequences preempted (pages taken back) this step."""
    tenants: tuple[str, ...] = ()
    """Tenants with a sequence in this step's batch."""

    @property
    def speculating(self) -> float:
        """Sequences that drafted: each offers one draft per position (proposed / depth)."""
        return self.proposed / self.depth if self.depth else 0.0

    @property
    def goodput(self) -> float:
        """Output tokens per second of this step."""
        return self.decode_tokens * 1000.0 / self.step_ms if self.step_ms > 0 else 0.0


@dataclass
class StepOutput:
    """Everything `EngineCore.step()` returns."""

    events: list[TokenEvent]
    stats: StepStats | None
    """None when the step had nothing to do."""
    finished: list[RequestResult]


@dataclass(frozen=True)
class ProposerCapacity:
    """One loaded proposer, as the tuner prices it."""

    resident_bytes: int
    """Accelerator memory it holds whatever the load."""
    bytes_per_draft: int
    """Memory each speculating sequence adds per draft token."""
    max_depth: int
    """Most draft tokens it makes per step (e.g. its MTP heads)."""
    draft_vocabs: tuple[int, ...] = ()
    """Compiled draft vocabularies (MTP heads; empty for the others)."""


@dataclass(frozen=True)
class EngineCapacity:
    """What an engine can run and hold: `capacity()` of EngineCore and FakeEngine."""

    total_pages: int
    """KV pool pages, the share lent to speculation included."""
    usable_pages: int
    """Pages tenants may use under the current pool split."""
    page_size: int
    """Tokens per page."""
    page_bytes: int
    """Accelerator bytes per page (0: unknown)."""
    max_depth: int
    """Deepest draft the engine verifies."""
    verify_depths: tuple[int, ...]
    """Depths verified without padding (1 + depth is a compiled verify size); empty: every
    depth up to max_depth."""
    max_batch: int
    """Most sequences decoded together."""
    spec_max_batch: int
    """Largest batch the engine speculates at."""
    batch_buckets: tuple[int, ...]
    """Compiled batch sizes (a batch runs padded to the next one); empty: unpadded."""
    proposers: dict[str, ProposerCapacity] = field(default_factory=dict)
    """Technique name -> the loaded proposer."""
