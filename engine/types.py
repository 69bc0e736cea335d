"""Plain dataclasses that cross the engine's boundary (scheduler, runner, daemon).

The daemon builds `Request`s, hands them to `EngineCore.add_request`, calls
`EngineCore.step()` in its own thread and fans the returned `TokenEvent`s out
to per-request queues; `StepStats` and `RequestResult` go to telemetry.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
from dataclasses import dataclass, field

MAX_TEMPERATURE = 2.0
"""Hottest sampling allowed (as OpenAI)."""
MAX_TOP_K = 256
"""Largest top_k: thresholds are looked up among this many candidates (engine.execute.sampling.CANDIDATES)."""
MAX_STOP_STRINGS = 4
"""Most stop strings per request (as OpenAI)."""
MAX_STOP_CHARS = 200
"""Longest stop string: text that could still become one is held back from the stream."""
MAX_STOP_TOKEN_IDS = 32
"""Most extra stop token ids per request."""
MAX_TOP_LOGPROBS = 20
"""Largest alternatives count a client may name (as OpenAI; engine.execute.sampling.TOP_LOGPROBS)."""
MAX_PENALTY = 2.0
"""Largest presence / frequency penalty, either sign (as OpenAI) and largest repetition penalty."""
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
"""Seeds accepted: any signed or unsigned 64-bit integer (see engine.execute.sequence.request_key)."""


class ParamError(ValueError):
    """A request field out of range: `field` names it, `code` is the OpenAI error code."""

    def __init__(self, field: str, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.field, self.code = field, code


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """An int or float that is a finite float: a bool is not, nor NaN, nor an int too large
    for a float (math.isfinite raises OverflowError on one of 310 digits).
    Example: is_finite_number(10 ** 400) is False; is_finite_number(3) is True."""
    if isinstance(value, float):
        return math.isfinite(value)
    return _is_int(value) and -sys.float_info.max <= value <= sys.float_info.max


_is_number = is_finite_number

FLOAT32_TINY = 1.1754943508222875e-38
"""Smallest normal float32: a sampling value below it (and not 0) would reach the device as 0 or
a subnormal, where a rule such as repetition_penalty > 0 no longer holds."""


def _float32_safe(name: str, value: float) -> None:
    """ParamError when `value` is not 0 but too small in magnitude to stay a normal float32."""
    if value != 0 and abs(value) < FLOAT32_TINY:
        raise _bad(name, f"must be 0 or at least {FLOAT32_TINY:.4g} in magnitude (float32)", value)


def _bad(name: str, rule: str, value: object, code: str = "invalid_value") -> ParamError:
    return ParamError(name, f"{name} {rule}, got {value!r}"[:300], code)


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match (engine/grammar.py): `kind` json (a JSON schema),
    regex, grammar (Lark or GBNF) or choice (a JSON list of strings), its text `spec`, and
    the request field it came from, which an error names."""

    kind: str
    spec: str
    param: str = "response_format"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (validated by `validate`, the one place with the rules)."""

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 0.0
    """0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 (vLLM's spelling) turns it off."""
    top_p: float = 1.0
    """Nucleus mass to keep; 1.0 turns it off."""
    seed: int | None = None
    """Same seed, same prompt, same settings -> same output. Any 64-bit integer, negatives too."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the sequence (EOS always does unless ignore_eos)."""
    stop: tuple[str, ...] = ()
    """Strings that end the sequence; the text is cut before the match."""
    logprobs: bool = False
    """Return the log-probability of each chosen token."""
    top_logprobs: int = 0
    """Most likely tokens listed per output token (0..MAX_TOP_LOGPROBS), with their logprobs."""
    ignore_eos: bool = False
    """Keep going past the model's own stop tokens (EOS, end of turn); stop_token_ids still apply."""
    min_p: float = 0.0
    """Keep tokens at least min_p times as likely as the best one (after temperature); 0 is off."""
    min_tokens: int = 0
    """Output tokens before EOS or a stop token id may be sampled (they are masked until then)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of each token already in the output (OpenAI's, -2..2)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it is already in the output (-2..2)."""
    repetition_penalty: float = 1.0
    """vLLM's: a token of the prompt or output has a positive logit divided by it and a negative
    one multiplied by it; 1 is off, (0, 2]."""
    constraint: Constraint | None = None
    """The output must match it (structured outputs); None: free text."""
    prompt_logprobs: int | None = None
    """Score the prompt: each prompt token's logprob given the tokens before it, with this many
    most likely tokens at each position (0..MAX_TOP_LOGPROBS), on the first TokenEvent; None: off.
    Such a prompt is computed whole (the prefix cache is not read for it)."""

    def validate(self, vocab_size: int | None = None, max_context: int | None = None) -> None:
        """Raise ParamError naming the bad field; token ids and max_tokens are also checked
        against the vocabulary and the context when those are given.

        >>> SamplingParams(seed=-1, top_k=-1).validate()
        >>> SamplingParams(top_p=0.0).validate()
        Traceback (most recent call last):
        ...
        engine.types.ParamError: top_p must be in (0, 1], got 0.0
        """
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", "must be a positive integer", self.max_tokens)
        if max_context is not None and self.max_tokens >= max_context:
            raise _bad("max_tokens", f"must be below the context of {max_context} tokens",
                       self.max_tokens, "context_length_exceeded")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise _bad("temperature", f"must be in [0, {MAX_TEMPERATURE}]", self.temperature)
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise _bad("top_k", f"must be an integer in [-1, {MAX_TOP_K}] (-1 or 0: off)", self.top_k)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", "must be in (0, 1]", self.top_p)
        if self.seed is not None and not (_is_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise _bad("seed", "must be a 64-bit integer", self.seed)
        self._validate_stops(vocab_size)
        if not isinstance(self.logprobs, bool):
            raise _bad("logprobs", "must be a boolean", self.logprobs)
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise _bad("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]", self.top_logprobs)
        if self.prompt_logprobs is not None and not (_is_int(self.prompt_logprobs)
                                                     and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise _bad("prompt_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                       self.prompt_logprobs)
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", "must be a boolean", self.ignore_eos)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise _bad("constraint", "must be an engine.types.Constraint", self.constraint)
        self._validate_adjustments()

    def _validate_adjustments(self) -> None:
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", "must be in [0, 1]", self.min_p)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]",
                       self.min_tokens)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise _bad(name, f"must be in [-{MAX_PENALTY}, {MAX_PENALTY}]", value)
        r = self.repetition_penalty
        if not _is_number(r) or not 0.0 < r <= MAX_PENALTY:
            raise _bad("repetition_penalty", f"must be in (0, {MAX_PENALTY}]", r)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _float32_safe(name, getattr(self, name))

    def _validate_stops(self, vocab_size: int | None) -> None:
        stop, ids = self.stop, self.stop_token_ids
        if not isinstance(stop, tuple) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop", "must be a tuple of strings", stop)
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings", len(stop))
        if any(not 0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise _bad("stop", f"strings must hold 1 to {MAX_STOP_CHARS} characters", stop)
        if not isinstance(ids, tuple) or not all(_is_int(t) for t in ids):
            raise _bad("stop_token_ids", "must be a tuple of integers", ids)
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise _bad("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids", len(ids))
        high = vocab_size if vocab_size is not None else SEED_RANGE[1]
        if any(not 0 <= t < high for t in ids):
            raise _bad("stop_token_ids", f"must be token ids in [0, {high})", ids[:8])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_prompt_ids(ids: object, vocab_size: int | None = None, max_context: int | None = None) -> None:
    """Raise ParamError (field "prompt_ids") unless `ids` is a non-empty list of in-vocabulary
    ids that leaves room for at least one generated token."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ParamError("prompt_ids", "the prompt must be a non-empty list of token ids")
    high = vocab_size if vocab_size is not None else SEED_RANGE[1]
    plain = all(type(t) is int for t in ids)  # the common case, checked fast (min/max in C)
    if not (plain and 0 <= min(ids) and max(ids) < high):
        ok = lambda t: isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < high
        bad = next((t for t in ids if not ok(t)), None)  # numpy integers (benchmarks) are fine
        if bad is not None:
            raise _bad("prompt_ids", f"must be token ids in [0, {high})", bad)
    if max_context is not None and len(ids) >= max_context:
        raise ParamError("prompt_ids", f"the prompt is {len(ids)} tokens; the context holds "
                         f"{max_context} tokens including at least one generated token",
                         "context_length_exceeded")


@dataclass
class Request:
    """One generation request as the engine sees it."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    arrival_time: float = field(default_factory=time.time)

    def validate(self, vocab_size: int | None = None, max_context: int | None = None) -> None:
        """Raise ParamError naming the bad field: the prompt, then the sampling settings, then
        prompt + max_tokens against the context."""
        if not isinstance(self.request_id, str) or not self.request_id:
            raise _bad("request_id", "must be a non-empty string", self.request_id)
        check_prompt_ids(self.prompt_ids, vocab_size, max_context)
        self.sampling.validate(vocab_size, max_context)
        n, m = len(self.prompt_ids), self.sampling.max_tokens
        if max_context is not None and n + m > max_context:
            raise ParamError("max_tokens", f"max_tokens={m} plus the prompt's {n} tokens exceeds the "
                             f"context of {max_context} tokens", "context_length_exceeded")


PromptLogprob = tuple[float, tuple[tuple[int, float], ...]]
"""A prompt token's logprob given the tokens before it, and the most likely (token id, logprob)
pairs at that position, best first."""


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
    """"stop" (EOS, stop id or string), "length" (max_tokens or context), "abort" or "error" (a
    fault ended this request: engine/step/faults.py)."""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    """Per token, the most likely (token id, logprob) pairs, best first (SamplingParams.top_logprobs
    of them); None unless asked for."""
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None
    """On a request's first event when SamplingParams.prompt_logprobs is set: per prompt token its
    PromptLogprob, None for the first token (nothing precedes it)."""


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
    scheduled_time: float | None = None
    """When a step first ran the request (unix seconds; None if it never ran). /metrics reads it
    for queue time; telemetry does not store it."""


@dataclass(frozen=True)
class RowClass:
    """The decode rows of one step that share a tenant and a (technique, depth) choice.

    Technique "none" and depth 0 for rows that did not draft. Stored in
    `xo_steps.row_classes` as a JSON list of objects with these keys (`row_classes_from_json`
    reads them back).
    """

    tenant: str
    technique: str
    depth: int
    rows: int
    """Decode rows of this class in the step."""
    proposed: int = 0
    """Draft tokens its rows proposed (each up to `depth`)."""
    accepted: int = 0  # drafts delivered, as StepStats.accepted
    accepted_per_pos: tuple[int, ...] = ()
    """accepted_per_pos[i]: drafts delivered at draft position i (len == depth)."""


def row_classes_from_json(value: object) -> tuple[RowClass, ...]:
    """The RowClasses of a stored `row_classes` value (None, from rows before it existed: ()).

    >>> row_classes_from_json([{"tenant": "a", "technique": "ngram", "depth": 2, "rows": 1,
    ...                         "proposed": 2, "accepted": 1, "accepted_per_pos": [1, 0]}])
    (RowClass(tenant='a', technique='ngram', depth=2, rows=1, ..., accepted_per_pos=(1, 0)),)
    """
    if value is None:
        return ()
    if isinstance(value, str):  # a driver that hands JSON back as text
        import json

        value = json.loads(value)
    return tuple(RowClass(**{**c, "accepted_per_pos": tuple(c.get("accepted_per_pos", ()))}) for c in value)


@dataclass(frozen=True)
class StepStats:
    """What one engine step did: the one definition of a step's record.

    Telemetry stores it as one `xo_steps` row (store.models.Step mirrors these fields, a test
    checks) and the tuner reads those rows back as StepStats. The engine fills every field; the
    zero defaults let tests and examples name only what matters to them.
    """

    step_id: int = 0
    time: float = 0.0
    """Wall-clock start of the step (unix seconds)."""
    batch_size: int = 0
    """Sequences that produced or consumed tokens this step."""
    prefill_tokens: int = 0
    decode_tokens: int = 0
    """Goodput: output tokens the decode rows delivered, those their TokenEvents carry (decode
    rows + accepted); what verification produced past a request's end is `cut_tokens`."""
    technique: str = "none"
    """"none" for plain decode, else the proposer's name."""
    depth: int = 0
    proposed: int = 0
    accepted: int = 0
    """Drafts delivered: min(accepted drafts, tokens kept - 1) per verify row; one its request's
    end cut off counts as rejected (engine.step.ragged_step.count_verified says why)."""
    accepted_per_pos: tuple[int, ...] = ()
    """accepted_per_pos[i]: drafts delivered at draft position i (len == depth)."""
    propose_ms: float = 0.0
    verify_ms: float = 0.0
    step_ms: float = 0.0
    kv_pages_used: int = 0
    kv_pages_free: int = 0
    queue_len: int = 0
    policy_version: int = 0
    preempted: int = 0
    """Sequences preempted (pages taken back) this step."""
    sampled_rows: int = 0
    """Rows of the batch (of batch_size) that sample (temperature > 0): each pays a top-k/top-p sort."""
    prefix_hit_tokens: int = 0
    """Tokens of the sequences admitted this step found in the prefix cache (not computed)."""
    prefix_query_tokens: int = 0
    """Tokens of the sequences admitted this step (their prompt, plus output after a preemption):
    hit rate = prefix_hit_tokens / prefix_query_tokens, 0 and 0 with the prefix cache off."""
    tenants: tuple[str, ...] = ()
    """Tenants with a sequence in this step's batch."""
    row_classes: tuple[RowClass, ...] = ()
    """The decode rows by (tenant, technique, depth), one RowClass each; empty without decode
    rows. With rows of several techniques the step-level fields sum theirs: technique is that
    of the most drafting rows, depth the verify depth (the deepest row's)."""
    grammar_ms: float = 0.0
    """Host time the step spent on constrained rows' grammars (drafts checked, masks computed)."""
    constrained_rows: int = 0
    """Rows of the batch whose output follows a grammar (structured outputs)."""
    plain_rows: int = 0
    """Decode rows of a speculative step that drafted nothing and decoded one token each beside
    the verify rows (engine/step/ragged_step.py); 0 in a step without drafts."""
    cut_tokens: int = 0
    """Output tokens decode rows computed past their requests' ends (stop, max_tokens, context)."""

    @property
    def speculating(self) -> float:
        """Sequences that drafted: each offers one draft per position (proposed / depth)."""
        return self.proposed / self.depth if self.depth else 0.0

    @property
    def goodput(self) -> float:
        """Output tokens delivered per second of this step."""
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
    """Deepest draft the engine verifies (any depth up to it, each row at its own)."""
    max_batch: int
    """Most sequences decoded together."""
    spec_max_batch: int
    """Largest batch the engine speculates at."""
    proposers: dict[str, ProposerCapacity] = field(default_factory=dict)
    """Technique name -> the loaded proposer."""
    backend: str = ""
    """The platform the engine computes on ("cpu", "tpu", "gpu"; "" unknown)."""


def pow2_bucket(n: float) -> int:
    """The power of two at or above `n` (1 for n <= 1): the batch buckets that exploration's
    backoff, the traffic's per-bucket tenant mix and the bench's drift fit group steps by.

    >>> [pow2_bucket(b) for b in (0, 1, 2, 3, 17, 32)]
    [1, 1, 2, 4, 32, 32]
    """
    return 1 << max(0, int(n) - 1).bit_length()
