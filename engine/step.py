"""One step's forward calls, assembled from the scheduler's plan (EngineCore.step calls `run_step`).

1. The decode rows: the StepChooser picks a technique for the batch; with
   drafts, one verify call checks [last token, drafts...] per row.
2. Plain decoding with prefill chunks planned (engine/mixed.py): the chunks
   ride in the decode call as a second segment, one forward for both.
3. Chunks not carried (speculation ran, or no decode rows): each runs alone,
   as a mixed call whose decode segment is one padding row where a mixed
   shape fits it (so no prefill shape of its own is compiled for short
   chunks), else in a prefill call of its own.
4. Each row's sampled tokens go to its sequence (`EngineCore._emit`); a row
   whose own inputs fail is dropped alone (engine/faults.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from engine.faults import build_rows, propose_alone
from engine.mixed import new_mixed_calls, run_mixed
from engine.penalties import wants_adjust
from engine.scheduler import StepPlan
from engine.sequence import Sequence, Status


@dataclass
class SpecResult:
    """What speculation did in one step (defaults: plain decode)."""

    technique: str = "none"
    depth: int = 0
    propose_ms: float = 0.0
    verify_ms: float = 0.0
    per_pos: list[int] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    mixed: int = 0
    """Prefill chunks that rode in the decode call."""


def run_step(core, plan: StepPlan, events, finished) -> SpecResult:
    """Run `plan` on `core` (an EngineCore): decode or verify (module docstring), then the chunks."""
    chunks = list(plan.prefill)  # _run_decode takes out those it carries
    spec = _run_decode(core, plan, chunks, events, finished)
    for seq, n in chunks:
        if seq.status is not Status.RUNNING:  # failed earlier in this step
            continue
        calls = _mixed_calls(core, [], [(seq, n)])
        if calls is not None:
            _run_mixed(core, [], [(seq, n)], calls, events, finished)
        else:
            _run_prefill(core, seq, n, events, finished)
    return spec


def _run_decode(core, plan: StepPlan, chunks, events, finished) -> SpecResult:
    seqs = plan.decode
    if not seqs:
        return SpecResult()
    technique, depth = core._chooser.choose(len(seqs))
    # drafting and verifying write positions up to num_cached + depth: keep them in the context
    depth = min(depth, core.max_context - 1 - max(s.num_cached for s in seqs))
    if technique != "none" and depth > 0 and len(seqs) <= core.runner.rc.spec_max_batch:
        depth = min(depth, core.proposers[technique].max_depth)  # e.g. 4 MTP heads
        t0 = time.perf_counter()
        seqs, drafts = propose_alone(core.proposers[technique], seqs, depth, core._failer(events, finished))
        plan.decode = seqs
        propose_ms = (time.perf_counter() - t0) * 1e3
        if any(drafts):
            return _run_speculative(core, seqs, drafts, technique, depth, propose_ms, events, finished)
    if not seqs:
        return SpecResult()
    mixed = _mixed_calls(core, seqs, chunks) if chunks else None
    if mixed is not None:
        plan.decode, carried = _run_mixed(core, seqs, chunks, mixed, events, finished)
        chunks.clear()
        return SpecResult(mixed=carried)
    seqs, c = build_rows(seqs, lambda ss: core.runner.new_call(len(ss), 1, max(s.num_cached + 1 for s in ss)),
                         lambda c, i, s: core._fill_row(c, i, s, 1), core._failer(events, finished))
    plan.decode = seqs
    if not seqs:
        return SpecResult()
    tok, lp = core.runner.run(c)
    _decoded(core, seqs, tok, lp, events, finished)
    return SpecResult()


def _decoded(core, seqs: list[Sequence], tok, lp, events, finished) -> None:
    """Rows 0.. of the latest call decoded one token for each of `seqs`."""
    hidden = core._hidden()
    for i, s in enumerate(seqs):
        s.num_cached += 1
        if hidden is not None:
            s.hidden = hidden[i, 0]
        core._emit(s, [int(tok[i, 0])], [float(lp[i, 0])], events, finished, i)


def _mixed_calls(core, seqs: list[Sequence], chunks):
    """The arrays of a mixed call for `seqs` and the planned chunks, or None (no compiled shape)."""
    if not core.runner.rc.mix_tokens_per_row or any(s.status is not Status.RUNNING for s, _ in chunks):
        return None
    context = max([s.num_cached + 1 for s in seqs] + [s.num_cached + n for s, n in chunks])
    return new_mixed_calls(core.runner, len(seqs), len(chunks), max(n for _, n in chunks), context)


def _run_mixed(core, seqs, chunks, calls, events, finished) -> tuple[list[Sequence], int]:
    """One forward for the decode rows `seqs` (none: one padding row) and every chunk of `chunks`
    (engine/mixed.py); (the decode rows kept, the chunks run). A row whose own inputs fail is
    dropped alone and its segment refilled at the same bucketed shape."""
    d0, p0 = calls
    fail = core._failer(events, finished)
    cd = None
    if seqs:
        seqs, cd = build_rows(seqs, lambda _: core.runner.new_call(*_shape(core, d0)),
                              lambda c, i, s: core._fill_row(c, i, s, 1), fail)
    cd = cd or core.runner.new_call(*_shape(core, d0))
    rows, cp = build_rows(chunks, lambda _: core.runner.new_call(*_shape(core, p0)),
                          lambda c, i, sn: core._fill_row(c, i, sn[0], sn[1]), fail)
    if not rows:  # every chunk failed: the decode rows run alone
        if seqs:
            tok, lp = core.runner.run(cd)
            _decoded(core, seqs, tok, lp, events, finished)
        return seqs, 0
    tok, lp = run_mixed(core.runner, (cd, cp))
    _decoded(core, seqs, tok, lp, events, finished)
    hidden = core._hidden()
    B = cd.tokens.shape[0]
    for j, (seq, n) in enumerate(rows):
        seq.num_cached += n
        if seq.remaining == 0:  # the chunk reached the newest token: its logits give the next one
            seq.hidden = None if hidden is None else hidden[B + j, 0]
            core._emit(seq, [int(tok[B + j, 0])], [float(lp[B + j, 0])], events, finished, B + j)
    return seqs, len(rows)


def _shape(core, c) -> tuple[int, int, int]:
    """(batch, new tokens, context) that `ModelRunner.new_call` pads to `c`'s shape again."""
    return *c.tokens.shape, c.global_table.shape[1] * core.runner.rc.page_size


def _run_speculative(core, seqs, drafts, technique, depth, propose_ms, events, finished) -> SpecResult:
    """Verify [last token, drafts...] per row in one forward; keep the accepted prefix + one."""
    t0 = time.perf_counter()

    def fill(c, i, row):
        s, d = row
        core._fill_row(c, i, s, 1)
        c.tokens[i, 1 : 1 + len(d)] = d
        c.n_new[i] = 1 + len(d)
        c.counter[i] = s.num_cached + 1 + np.arange(c.counter.shape[1])
        if wants_adjust(s.req.sampling, s.num_output):  # position j counts drafts[:j] as output
            core._fill_adjust(c, i, s, d)

    rows, c = build_rows(list(zip(seqs, drafts)), lambda rows: core.runner.new_verify_call(
        len(rows), depth, max(s.num_cached + 1 + depth for s, _ in rows)), fill, core._failer(events, finished))
    if not rows:
        return SpecResult()
    seqs, drafts = [s for s, _ in rows], [d for _, d in rows]
    cand = np.full(c.tokens.shape, -1, np.int32)
    for i, d in enumerate(drafts):
        cand[i, : len(d)] = d
    tok, acc, lp = core.runner.run_verify(c, cand)
    hidden = core._hidden()
    res = SpecResult(technique, depth, propose_ms, (time.perf_counter() - t0) * 1e3, [0] * depth)
    for i, (s, d) in enumerate(zip(seqs, drafts)):
        a = 0
        while a < len(d) and acc[i, a]:
            a += 1
        for j in range(a):
            res.per_pos[j] += 1
        res.proposed += len(d)
        res.accepted += a
        s.proposed += len(d)
        s.accepted += a
        s.num_cached += 1 + a  # the fed token and the accepted drafts are now valid cache
        if hidden is not None:
            s.hidden = hidden[i, a]
        core._emit(s, list(d[:a]) + [int(tok[i, a])], [float(x) for x in lp[i, : a + 1]], events, finished, i)
    return res


def _run_prefill(core, seq: Sequence, n: int, events, finished) -> None:
    if seq.status is not Status.RUNNING:  # failed earlier in this step
        return
    _, c = build_rows([seq], lambda _: core.runner.new_call(1, n, seq.num_cached + n),
                      lambda c, i, s: core._fill_row(c, i, s, n), core._failer(events, finished))
    if c is None:
        return
    tok, lp = core.runner.run(c)
    seq.num_cached += n
    if seq.remaining == 0:  # the chunk reached the newest token: its logits give the next one
        hidden = core._hidden()
        seq.hidden = None if hidden is None else hidden[0, 0]
        core._emit(seq, [int(tok[0, 0])], [float(lp[0, 0])], events, finished, 0)
