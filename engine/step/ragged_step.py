"""One step as ragged calls (engine/execute/ragged_calls.py): every row of the plan, of any kind, in one
forward (EngineCore.step calls `run_ragged_step`).

1. The decode rows: the StepChooser picks a (technique, depth) per row (a tenant rule's, else
   the batch's) and each (technique, depth) group drafts with its proposer. A row verifies its own
   drafts at its own depth, [last token, drafts...], with logits at each of those tokens; a row
   that drafts nothing decodes one token. No row is padded to another's depth.
2. The prefill chunks: each a row of its own tokens after its cached prefix, logits at its last
   token (they give the next token when the chunk reaches the prompt's end).
3. The rows go in one call, decode rows first, unless their tokens pass the largest token
   bucket: then in as few calls as hold them, in that order. Where the call's tokens pass a
   bucket by less than they would pad up to the next, the prefill chunks give up the excess
   to a later step (`fit_step`): a 133-token step runs as 128 tokens, not padded to 256. Where
   no later step would run but for those tokens, the cut must also save a call's fixed cost:
   a lone 81-token prompt runs as one call of 128, not as 64 + 16 + 1.
4. Each row's outputs go to its sequence (`EngineCore._emit`); a row whose own inputs fail is
   dropped alone before the call (engine/step/faults.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from engine.execute import ragged_calls
from engine.execute.penalties import fill_adjust, wants_adjust
from engine.execute.ragged_calls import RaggedRow, table_width, token_buckets, top_in
from engine.execute.sampling import Adjust, SamplingArrays
from engine.execute.sequence import Sequence, Status
from engine.step import ahead
from engine.step.chooser import PLAIN
from engine.step.faults import propose_alone
from engine.types import RowClass
from engine.warmup.warm import max_outputs, max_tokens


@dataclass
class SpecResult:
    """What speculation did in one step (defaults: plain decode)."""

    technique: str = "none"
    """The technique of the most drafting rows."""
    depth: int = 0
    """The verify depth (the deepest row's)."""
    propose_ms: float = 0.0
    """Every proposer's time together."""
    verify_ms: float = 0.0
    per_pos: list[int] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    """Drafts delivered (count_verified)."""
    classes: dict[tuple[str, str, int], list] = field(default_factory=dict)
    """(tenant, technique, depth) -> [rows, proposed, accepted, per_pos] of the verified rows."""
    delivered: int = 0
    """Tokens the decode rows' requests kept (their TokenEvents'): StepStats.decode_tokens."""
    cut: int = 0
    """Tokens the decode rows produced past their requests' ends: StepStats.cut_tokens."""
    plain_rows: int = 0
    """Decode rows of a speculative step that drafted nothing: they decode one token each."""
    grammar_ms: float = 0.0
    """Time spent on constrained rows' grammars: drafts cut, masks computed."""
    constrained_rows: int = 0

    def row_classes(self, decode: list[Sequence]) -> tuple[RowClass, ...]:
        """One RowClass per class of the verified rows, or (plain decode) per tenant of `decode`."""
        classes = dict(self.classes)
        if not classes:
            for s in decode:
                classes.setdefault((s.req.tenant, *PLAIN), [0, 0, 0, []])[0] += 1
        return tuple(RowClass(t, tech, d, n, p, a, tuple(pos))
                     for (t, tech, d), (n, p, a, pos) in sorted(classes.items()))


def run_ragged_step(core, plan, events, finished) -> SpecResult:
    """Run `plan` on `core` (an EngineCore) as ragged calls (module docstring)."""
    fail = core._failer(events, finished)
    decode, propose_ms = _drafted(core, plan.decode, fail, bool(plan.prefill))
    g0 = time.perf_counter()
    decode = [(s, choice, _grammar_drafts(s, d)) for s, choice, d in decode]
    grammar_s = time.perf_counter() - g0
    items = [(s, choice, d, None) for s, choice, d in decode]
    chunks = [(s, n) for s, n in plan.prefill if s.status is Status.RUNNING]
    later = bool(decode) or any(n < s.remaining for s, n in chunks)  # a next step runs anyway
    buckets = tuple(token_buckets(max_tokens(core)))
    lengths = fit_step(sum(1 + len(d) for _, _, d in decode), [n for _, n in chunks], buckets, later)
    lengths = scored_lengths(chunks, lengths, max_outputs(core) - sum(1 + len(d) for _, _, d in decode))
    fitted = {id(s): n for (s, _), n in zip(chunks, lengths, strict=True)}
    items += [(s, None, (), fitted[id(s)]) for s, _ in chunks]
    plan.prefill = [(s, fitted.get(id(s), n)) for s, n in plan.prefill]  # the step's stats count what ran
    rows = []
    for item in items:
        try:
            t = time.perf_counter()
            rows.append((item, _row(core, item), _sampling(core, item)))
            grammar_s += (time.perf_counter() - t) if item[0].matcher is not None else 0.0
        except Exception:
            fail(item[0], "its sampling inputs")
    plan.decode = [item[0] for item, _, _ in rows if item[3] is None]
    spec = SpecResult()
    depth = max((item[1][1] for item, _, _ in rows if item[2]),
                default=0)  # the deepest drafting row's choice
    if depth:
        spec = SpecResult(_most_rows([item for item, _, _ in rows if item[3] is None]), depth, propose_ms,
                          per_pos=[0] * depth)
        spec.plain_rows = sum(1 for item, _, _ in rows if item[3] is None and not item[2])  # decode one token
    spec.grammar_ms = grammar_s * 1e3
    spec.constrained_rows = sum(1 for item, _, _ in rows if item[0].matcher is not None)
    t0 = time.perf_counter()
    calls = _pack(rows, buckets[-1])
    steady = len(calls) == 1 and ahead.steady(core, [item for item, _, _ in rows])
    if not steady:
        core._ahead = None
    for call_rows in calls:
        call = ragged_calls.new_call(core.runner, [r for _, r, _ in call_rows])
        for (_, _, samp), slots in zip(call_rows, call.out_rows):
            _put_sampling(core, call, slots, samp)
        items = [item for item, _, _ in call_rows]
        launched = ahead.take(core, call, items) if steady else None
        launched = launched or ragged_calls.launch(core.runner, call)
        if steady:  # the next step's call goes to the device before this one's tokens are read
            ahead.follow_step(core, items, launched)
        tok, acc, lp = (out.tolist() for out in ragged_calls.fetch(core.runner, launched))  # index lists
        hidden = np.asarray(core.runner.last_hidden, np.float32) if core._keep_hidden else None
        for (item, _, _), slots in zip(call_rows, call.out_rows):
            _update(core, spec, item, slots, tok, acc, lp, hidden, events, finished)
    if depth:
        spec.verify_ms = (time.perf_counter() - t0) * 1e3
    return spec


CALL_TOKENS = 32
"""A call's fixed cost in prompt tokens' worth: each call reads every weight and the output
layer once, so a one-token call costs about what 32 tokens add to a prefill call on a 2-core
CPU. A cut that leaves its tokens to a step of their own pays it again."""


def fit_step(decode_tokens: int, chunks: list[int], buckets: tuple[int, ...],
             later: bool = True) -> list[int]:
    """Prefill chunk lengths cut so that a step of `decode_tokens` decode and verify tokens and
    these chunks ends on a token bucket, where it passes one by fewer tokens than padding up to
    the next would add (the cut tokens cost as much in a later step, padding costs for nothing).
    `later`: a next step runs anyway (decode rows go on, or a chunk leaves prompt tokens behind);
    without one, the cut tokens would make a call of their own, so the excess plus CALL_TOKENS
    must stay under the padding. Chunks are cut from the last one back, each keeping a token;
    a step past the largest bucket (several calls) is left as it is.

    >>> fit_step(7, [126], (16, 32, 64, 128, 256)), fit_step(7, [200], (16, 32, 64, 128, 256))
    ([121], [200])
    >>> (fit_step(24, [30, 20], (16, 64, 128)), fit_step(60, [10, 2], (16, 64, 128)),
    ...  fit_step(70, [1], (16, 64, 128)))
    ([30, 10], [3, 1], [1])
    >>> (fit_step(0, [81], (64, 128), later=False),  # a call of its own
    ...  fit_step(0, [133], (128, 256), later=False))
    ([81], [128])
    >>> fit_step(0, [300], (128, 256))  # past the largest bucket: several calls
    [300]
    """
    n = decode_tokens + sum(chunks)
    up = [b for b in buckets if b >= n]
    down = [b for b in buckets if b < n]
    if not up or not down or n - down[-1] + (0 if later else CALL_TOKENS) >= up[0] - n:
        return list(chunks)
    excess, out = n - down[-1], list(chunks)
    if excess > sum(c - 1 for c in out):
        return out
    for i in reversed(range(len(out))):
        cut = min(excess, out[i] - 1)
        out[i] -= cut
        excess -= cut
    return out


def scored_lengths(chunks: list[tuple[Sequence, int]], lengths: list[int], outputs: int) -> list[int]:
    """`lengths` with the chunks of scored prompts (SamplingParams.prompt_logprobs: an output
    slot at every token) cut so that the step's output slots stay within `outputs`, the most
    its heads compile for (every chunk keeps one token and its one slot).

    >>> from engine.types import Request, SamplingParams
    >>> def seq(k): return type("Seq", (), {"req": Request("r", [1], SamplingParams(prompt_logprobs=k))})
    >>> plain, scored = seq(None), seq(1)
    >>> scored_lengths([(plain, 0), (scored, 0), (scored, 0)], [50, 40, 30], 60)
    [50, 40, 19]
    """
    spare = outputs - len(lengths)
    out = list(lengths)
    for i, (seq, _) in enumerate(chunks):
        if _scored(seq):
            out[i] = min(out[i], 1 + max(spare, 0))
            spare -= out[i] - 1
    return out


def _scored(seq: Sequence) -> bool:
    """Whether `seq`'s prompt is scored: its chunks give an output slot at every token."""
    return seq.req.sampling.prompt_logprobs is not None


def _drafted(core, seqs: list[Sequence], fail, prefill: bool = False) -> tuple[list, float]:
    """(sequence, choice, drafts) per decode row kept, and the proposers' time in ms (`prefill`:
    the step also prefills, see StepChooser.choose)."""
    if not seqs:
        return [], 0.0
    choices = _row_choices(core, seqs, prefill)
    if all(c == PLAIN for c, _ in choices) or len(seqs) > core.runner.rc.spec_max_batch:
        return [(s, PLAIN, []) for s in seqs], 0.0
    t0 = time.perf_counter()
    rows = _propose(core, seqs, choices, fail)
    return rows, (time.perf_counter() - t0) * 1e3


def _row_choices(core, seqs: list[Sequence], prefill: bool = False) -> list[tuple[tuple[str, int], int]]:
    """Each row's (technique, depth) and the depth its proposer drafts at. The drafting depth is
    the chooser's (`prefill`: the step also prefills, see StepChooser.choose) cut to what its
    proposer drafts and to what the context holds for every row (drafting and verifying write
    positions up to num_cached + depth). The row's depth is that, cut further to what its request
    may still keep: a verify row yields its accepted drafts and one token more, so
    max_tokens - num_output - 1 drafts at most."""
    room = core.max_context - 1 - max(s.num_cached for s in seqs)
    out = []
    chosen = core._chooser.choose_rows([s.req.tenant for s in seqs], prefill)
    for seq, (technique, depth) in zip(seqs, chosen, strict=True):
        keeps = 0
        if technique != "none":
            depth = min(depth, room, core.proposers[technique].max_depth)  # e.g. 4 MTP heads
            keeps = min(depth, seq.req.sampling.max_tokens - seq.num_output - 1)
        out.append(((technique, keeps) if keeps > 0 else PLAIN, depth))
    return out


def _propose(core, seqs, choices, fail) -> list[tuple[Sequence, tuple[str, int], list[int]]]:
    """(sequence, its choice, its drafts) per row kept, in batch order: the rows of one technique
    and drafting depth draft in one call, each row keeping as many drafts as its choice's depth;
    a row whose own proposal fails is dropped alone (engine/step/faults.py)."""
    drafted: dict[int, list[int]] = {}
    for technique, depth in dict.fromkeys((c[0], d) for c, d in choices if c != PLAIN):
        group = [s for s, (c, d) in zip(seqs, choices) if c != PLAIN and (c[0], d) == (technique, depth)]
        kept, drafts = propose_alone(core.proposers[technique], group, depth, fail)
        drafted.update((id(s), list(d)) for s, d in zip(kept, drafts))
    return [(s, c, drafted[id(s)][: c[1]] if c != PLAIN else []) for s, (c, _) in zip(seqs, choices)
            if c == PLAIN or id(s) in drafted]


def _grammar_drafts(seq: Sequence, drafts: list[int]) -> list[int]:
    """A constrained row's drafts up to the first its grammar refuses (engine/grammar.py)."""
    if seq.matcher is None or not drafts:
        return drafts
    return drafts[: seq.matcher.drafts_allowed(drafts)]


def accepted_prefix(acc, n: int) -> int:
    """Drafts kept of a row's n: how many of acc[:n] are true before the first false."""
    a = 0
    while a < n and acc[a]:
        a += 1
    return a


def delivered_drafts(accepted: int, kept: int) -> int:
    """Of a verify row's `accepted` drafts, those its request kept beyond the row's one token,
    when it kept `kept` of the 1 + accepted tokens the row produced (a stop, max_tokens or the
    context may end it sooner; a fault keeps none).

    >>> delivered_drafts(3, 4), delivered_drafts(3, 2), delivered_drafts(3, 0)
    (3, 1, 0)
    """
    return max(0, min(accepted, kept - 1))


def count_verified(res: SpecResult, seq: Sequence, choice: tuple[str, int], drafts, accepted: int) -> None:
    """Count one verified row in `res` (its class, per position) and in its sequence: its drafts
    as proposed and `accepted` as accepted, the drafts its request kept (delivered_drafts).

    A draft that verification accepted but the request's end cut off counts as rejected, so
    goodput (decode rows + accepted) is what requests received, and acceptance rates (accepted
    / proposed, the tuner's per-position rates) carry the cost of drafting past a request's
    end: the tokens per step they predict are delivered tokens. Each row's drafts stay proposed
    in full: each took a verify slot."""
    cls = res.classes.setdefault((seq.req.tenant, *choice), [0, 0, 0, [0] * choice[1]])
    for j in range(accepted):
        res.per_pos[j] += 1
        cls[3][j] += 1
    cls[0] += 1
    cls[1] += len(drafts)
    cls[2] += accepted
    res.proposed += len(drafts)
    res.accepted += accepted
    seq.proposed += len(drafts)
    seq.accepted += accepted


def _most_rows(rows) -> str:
    """The technique most of the rows that drafted use (ties: the first by name)."""
    counts: dict[str, int] = {}
    for _, (technique, _), drafts, *_ in rows:
        if drafts:
            counts[technique] = counts.get(technique, 0) + 1
    return max(sorted(counts), key=counts.__getitem__)


def _row(core, item) -> RaggedRow:
    """The call row of a decode row (seq, choice, drafts, None) or a chunk (seq, None, (), n); a
    scored prompt's chunk has an output at every token, checking the token that follows it."""
    seq, _, drafts, n = item
    rc = core.runner.rc
    g, ring, write = core.pool.table_rows(seq.pages, table_width(rc), rc.ring_pages)
    if n is not None and _scored(seq):
        at = seq.num_cached
        nxt = tuple(seq.tokens[at + 1: at + n + 1])
        return RaggedRow(tuple(seq.tokens[at: at + n]), at, g, ring, write, n, nxt)
    tokens = tuple(seq.tokens[seq.num_cached: seq.num_cached + (n or 1)]) + tuple(drafts)
    return RaggedRow(tokens, seq.num_cached, g, ring, write, 1 + len(drafts), tuple(drafts))


def _pack(rows: list, most: int) -> list[list]:
    """`rows` in order, cut into calls of at most `most` tokens (the largest token bucket) each."""
    calls, tokens = [[]], 0
    for row in rows:
        n = len(row[1].tokens)
        if calls[-1] and tokens + n > most:
            calls.append([])
            tokens = 0
        calls[-1].append(row)
        tokens += n
    return [c for c in calls if c]


def _sampling(core, item) -> tuple[dict, dict | None, np.ndarray | None]:
    """A row's sampling settings at its output slots (SamplingArrays host arrays [k]), its logit
    adjustments ([1, 1 + drafts, H]) where it has any, and its grammar's masks ([k, W]) where it is
    constrained: made before the call, so that a row whose settings fail (engine/step/faults.py)
    is dropped alone. A prefill chunk's one output slot (its last, for a scored prompt's chunk)
    matters only at the prompt's end."""
    seq, _, drafts, n = item
    sp, k = seq.req.sampling, (n if n is not None and _scored(seq) else 1 + len(drafts))
    if k > 1 + len(drafts):  # a scored chunk: logprobs at every slot
        samp = SamplingArrays.host(k)
        SamplingArrays.fill(samp, slice(0, k), sp, seq.key)
        samp["want_logprobs"][:] = True
    elif (samp := seq.samp_rows.get(k)) is None:
        samp = SamplingArrays.host(k)
        SamplingArrays.fill(samp, slice(0, k), sp, seq.key)
        seq.samp_rows[k] = samp
    masks = seq.matcher.masks(drafts) if seq.matcher is not None and (item[3] is None or
                                                                      item[3] == seq.remaining) else None
    if not wants_adjust(sp, seq.num_output):
        return samp, None, masks
    one = Adjust.host((1, 1 + len(drafts), core.runner.adjust_width))  # position j: drafts[:j] are output
    fill_adjust(one, 0, seq.tokens, seq.n_prompt, sp, core._stops(sp), drafts)
    return samp, one, masks


def _put_sampling(core, call, slots: slice, prepared: tuple[dict, dict | None, np.ndarray | None]) -> None:
    """A row's `_sampling` arrays into the call's output slots."""
    samp, one, masks = prepared
    for name, buf in samp.items():
        call.samp[name][slots] = buf
    last = slice(slots.stop - 1, slots.stop)  # a scored chunk's slot that draws its next token
    if masks is not None:
        if call.mask is None:
            call.mask = np.full((len(call.out_idx), masks.shape[1]), -1, np.int32)
        call.mask[slots if len(masks) > 1 else last] = masks
    if one is not None:
        if call.adjust is None:
            call.adjust = Adjust.host((len(call.out_idx), 1, core.runner.adjust_width))
        for name, buf in one.items():
            call.adjust[name][slots if buf.shape[1] > 1 else last, 0] = buf[0]


def _update(core, spec: SpecResult, item, slots: slice, tok, acc, lp, hidden, events, finished) -> None:
    """Append a row's outcome to its sequence: a chunk's cached tokens (and at the prompt's end
    its next token), a decode row's token, or a verify row's accepted drafts and one more."""
    seq, choice, drafts, n = item
    at = slots.start
    if n is not None:  # a prefill chunk
        if _scored(seq):
            _score_prompt(core, seq, slots)
        seq.num_cached += n
        if seq.remaining == 0:  # the chunk reached the newest token: its logits give the next one
            at = slots.stop - 1
            seq.hidden = None if hidden is None else hidden[at]
            core._emit(seq, [int(tok[at])], [float(lp[at])], events, finished, slice(at, at + 1))
        return
    a = accepted_prefix(acc[at: at + len(drafts)], len(drafts)) if drafts else 0
    seq.num_cached += 1 + a  # the fed token and the accepted drafts are now valid cache
    if hidden is not None:
        seq.hidden = hidden[at + a]

    def kept(n: int) -> None:  # before the sequence may finish: its result reads seq.accepted
        spec.delivered, spec.cut = spec.delivered + n, spec.cut + (1 + a - n if n else 0)
        if spec.depth:  # a speculative step counts every decode row, plain ones too
            count_verified(spec, seq, choice, drafts, delivered_drafts(a, n))

    core._emit(seq, list(drafts[:a]) + [int(tok[at + a])], [float(x) for x in lp[at: at + a + 1]], events,
               finished, slice(at, at + a + 1), kept)


def _score_prompt(core, seq: Sequence, slots: slice) -> None:
    """A scored prompt's PromptLogprobs at the positions its chunk (output `slots` of the
    latest call, one per token from `seq.num_cached` on) predicts: each next prompt token's
    logprob and the position's most likely tokens."""
    k = seq.req.sampling.prompt_logprobs
    if seq.num_output:  # computed again after a preemption: sent with the first token already
        return
    if seq.prompt_lps is None:
        seq.prompt_lps = [None] * seq.n_prompt
    given = core.runner.last_given
    tops = top_in(core.runner, slots)
    for j in range(slots.stop - slots.start):
        pos = seq.num_cached + j + 1  # the prompt token slot j predicts
        if pos < seq.n_prompt:
            seq.prompt_lps[pos] = (float(given[slots.start + j]), tuple(tuple(t) for t in tops[j][:k]))
