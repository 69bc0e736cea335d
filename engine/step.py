"""One step's forward calls, assembled from the scheduler's plan (EngineCore.step calls `run_step`).

1. The decode rows: the StepChooser picks a (technique, depth) per row (a
   tenant rule's, else the batch's); the rows are grouped by that choice and
   each group drafts with its proposer at its depth. With any drafts, one
   verify call at the deepest group's depth checks [last token, drafts...]
   per row, rows with fewer or no drafts padded (candidate -1), each row
   accepting its own prefix, so every row stays lossless. Where rows draft
   nothing and `engine.types.segment_split` says it pays, they decode as a
   plain segment of the same forward instead (engine/segments.py).
2. The prefill chunks: short ones side by side as the rows of one call
   (engine/prefill_groups.py), the others each in a prefill call of its own.
3. Each row's sampled tokens go to its sequence (`EngineCore._emit`); a row
   whose own inputs fail is dropped alone (engine/faults.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from engine.faults import build_rows, propose_alone
from engine.penalties import wants_adjust
from engine.prefill_groups import run_group, split_groups
from engine.runner import bucket
from engine.scheduler import StepPlan
from engine.segments import new_segment_calls, run_segmented
from engine.sequence import Sequence, Status
from engine.types import RowClass, segment_split

PLAIN = ("none", 0)


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
    classes: dict[tuple[str, str, int], list] = field(default_factory=dict)
    """(tenant, technique, depth) -> [rows, proposed, accepted, per_pos] of the verified rows."""
    plain_rows: int = 0
    """Rows verified as a plain segment beside the drafting rows (engine/segments.py)."""

    def row_classes(self, decode: list[Sequence]) -> tuple[RowClass, ...]:
        """One RowClass per class of the verified rows, or (plain decode) per tenant of `decode`."""
        classes = dict(self.classes)
        if not classes:
            for s in decode:
                classes.setdefault((s.req.tenant, *PLAIN), [0, 0, 0, []])[0] += 1
        return tuple(RowClass(t, tech, d, n, p, a, tuple(pos))
                     for (t, tech, d), (n, p, a, pos) in sorted(classes.items()))


def run_step(core, plan: StepPlan, events, finished) -> SpecResult:
    """Run `plan` on `core` (an EngineCore): decode or verify (module docstring), then the chunks."""
    spec = _run_decode(core, plan, events, finished)
    groups, chunks = split_groups(core.runner.rc, list(plan.prefill), core.runner.usable is None)
    for group in groups:
        run_group(core, group, events, finished)
    for seq, n in chunks:
        _run_prefill(core, seq, n, events, finished)
    return spec


def _run_decode(core, plan: StepPlan, events, finished) -> SpecResult:
    seqs = plan.decode
    if not seqs:
        return SpecResult()
    choices = _row_choices(core, seqs)
    if any(c != PLAIN for c in choices) and len(seqs) <= core.runner.rc.spec_max_batch:
        t0 = time.perf_counter()
        rows = _propose(core, seqs, choices, core._failer(events, finished))
        plan.decode = seqs = [s for s, _, _ in rows]
        propose_ms = (time.perf_counter() - t0) * 1e3
        if any(d for _, _, d in rows):
            return _run_speculative(core, plan, rows, propose_ms, events, finished)
    if not seqs:
        return SpecResult()
    seqs, c = build_rows(seqs, lambda ss: core.runner.new_call(len(ss), 1, max(s.num_cached + 1 for s in ss)),
                         lambda c, i, s: core._fill_row(c, i, s, 1), core._failer(events, finished))
    plan.decode = seqs
    if not seqs:
        return SpecResult()
    tok, lp = core.runner.run(c)
    _decoded(core, seqs, tok, lp, events, finished)
    return SpecResult()


def _row_choices(core, seqs: list[Sequence], prefill: bool = False) -> list[tuple[str, int]]:
    """Each row's (technique, depth): the chooser's (`prefill`: the step also prefills, see
    StepChooser.choose), cut to what its proposer drafts and to what the context holds
    (drafting and verifying write positions up to num_cached + depth)."""
    room = core.max_context - 1 - max(s.num_cached for s in seqs)
    out = []
    for technique, depth in core._chooser.choose_rows([s.req.tenant for s in seqs], prefill):
        if technique != "none":
            depth = min(depth, room, core.proposers[technique].max_depth)  # e.g. 4 MTP heads
        out.append((technique, depth) if depth > 0 else PLAIN)
    return out


def _propose(core, seqs, choices, fail) -> list[tuple[Sequence, tuple[str, int], list[int]]]:
    """(sequence, its choice, its drafts) per row kept, in batch order: each (technique, depth)
    group drafts in one call; a row whose own proposal fails is dropped alone (engine/faults.py)."""
    drafted: dict[int, list[int]] = {}
    for choice in dict.fromkeys(c for c in choices if c != PLAIN):
        group = [s for s, c in zip(seqs, choices) if c == choice]
        kept, drafts = propose_alone(core.proposers[choice[0]], group, choice[1], fail)
        drafted.update((id(s), list(d)) for s, d in zip(kept, drafts))
    return [(s, c, drafted[id(s)] if c != PLAIN else []) for s, c in zip(seqs, choices)
            if c == PLAIN or id(s) in drafted]


def _decoded(core, seqs: list[Sequence], tok, lp, events, finished) -> None:
    """Rows 0.. of the latest call decoded one token for each of `seqs`."""
    hidden = core._hidden()
    for i, s in enumerate(seqs):
        s.num_cached += 1
        if hidden is not None:
            s.hidden = hidden[i, 0]
        core._emit(s, [int(tok[i, 0])], [float(lp[i, 0])], events, finished, i)


def _run_speculative(core, plan: StepPlan, rows, propose_ms, events, finished) -> SpecResult:
    """Verify [last token, drafts...] per row at the deepest drafting group's depth, in one
    padded forward or, where rows draft nothing and a compiled shape fits, as two segments
    (engine/segments.py); each row keeps its accepted prefix + one. `rows`: (sequence, choice,
    drafts)."""
    t0 = time.perf_counter()
    depth = max(c[1] for _, c, d in rows if d)
    fail = core._failer(events, finished)

    def fill(c, i, row):
        s, _, d = row
        core._fill_row(c, i, s, 1)
        c.tokens[i, 1 : 1 + len(d)] = d
        c.n_new[i] = 1 + len(d)
        c.counter[i] = s.num_cached + 1 + np.arange(c.counter.shape[1])
        if wants_adjust(s.req.sampling, s.num_output):  # position j counts drafts[:j] as output
            core._fill_adjust(c, i, s, d)

    out = _segmented(core, rows, depth, fill, fail)
    if out is None:
        rows, c = build_rows(rows, lambda rows: core.runner.new_verify_call(
            len(rows), depth, max(s.num_cached + 1 + depth for s, _, _ in rows)), fill, fail)
        if not rows:
            plan.decode = []
            return SpecResult()
        tok, acc, lp = core.runner.run_verify(c, _candidates(c, [d for _, _, d in rows]))
        out = [(*row, tok[i], acc[i], lp[i], i) for i, row in enumerate(rows)], 0
    done, plain_rows = out
    plan.decode = [r[0] for r in done]
    if not done:
        return SpecResult()
    hidden = core._hidden()
    res = SpecResult(_most_rows(done), depth, propose_ms, (time.perf_counter() - t0) * 1e3, [0] * depth,
                     plain_rows=plain_rows)
    for s, choice, d, tok, acc, lp, row in done:
        a = accepted_prefix(acc, len(d))
        count_verified(res, s, choice, d, a)
        s.num_cached += 1 + a  # the fed token and the accepted drafts are now valid cache
        if hidden is not None:
            s.hidden = hidden[row, a]
        core._emit(s, list(d[:a]) + [int(tok[a])], [float(x) for x in lp[: a + 1]], events, finished, row)
    return res


def accepted_prefix(acc, n: int) -> int:
    """Drafts kept of a row's n: how many of acc[:n] are true before the first false."""
    a = 0
    while a < n and acc[a]:
        a += 1
    return a


def count_verified(res: SpecResult, seq: Sequence, choice: tuple[str, int], drafts, accepted: int) -> None:
    """Count one verified row, `accepted` of its drafts kept, in `res` (its class, per position)
    and in its sequence."""
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


def _candidates(c, drafts) -> np.ndarray:
    """[B, q] drafts to verify per row of `c`, -1 where there is none (a padded or plain row)."""
    cand = np.full(c.tokens.shape, -1, np.int32)
    for i, d in enumerate(drafts):
        cand[i, : len(d)] = d
    return cand


def _segmented(core, rows, depth: int, fill, fail):
    """Run `rows` as a segmented verify when `engine.types.segment_split` says so and its shape is
    compiled: ((sequence, choice, drafts, tokens, accepted, logprobs, row of the call) per row
    kept, in batch order; plain rows kept), else None (the caller pads)."""
    runner = core.runner
    if not runner.segments_ready:
        return None
    q = bucket(1 + depth, runner.rc.verify_tokens)
    plain, drafting = [r for r in rows if not r[2]], [r for r in rows if r[2]]
    spec_buckets = tuple(b for b in runner.rc.batch_buckets if b <= runner.rc.spec_max_batch)
    split = segment_split(len(plain), len(drafting), q, spec_buckets, {s[:3] for s in runner.segments_ready})
    context = max(s.num_cached + 1 + depth for s, _, _ in rows)
    if not split or new_segment_calls(runner, *split, q, context) is None:
        return None
    make = lambda k: new_segment_calls(runner, *split, q, context)[k]  # noqa: E731  (a refill after a failure)
    plain, cp = build_rows(plain, lambda _: make(0), lambda c, i, r: core._fill_row(c, i, r[0], 1), fail)
    drafting, cv = build_rows(drafting, lambda _: make(1), fill, fail)
    if not plain or not drafting:  # a whole segment failed: the other runs alone, as it would padded
        return _alone(core, plain, drafting, cp, cv)
    (tok, lp), (vtok, acc, vlp) = run_segmented(runner, cp, cv, _candidates(cv, [d for _, _, d in drafting]))
    out = [(*r, tok[i], (), lp[i], i) for i, r in enumerate(plain)]
    out += [(*r, vtok[j], acc[j], vlp[j], split[0] + j) for j, r in enumerate(drafting)]
    order = {id(r[0]): i for i, r in enumerate(rows)}
    return sorted(out, key=lambda r: order[id(r[0])]), len(plain)


def _alone(core, plain, drafting, cp, cv):
    """The segment left when every row of the other failed its inputs, run as a call of its own."""
    if drafting:
        tok, acc, lp = core.runner.run_verify(cv, _candidates(cv, [d for _, _, d in drafting]))
        return [(*r, tok[j], acc[j], lp[j], j) for j, r in enumerate(drafting)], 0
    if plain:
        tok, lp = core.runner.run(cp)
        return [(*r, tok[i], (), lp[i], i) for i, r in enumerate(plain)], len(plain)
    return [], 0


def _most_rows(rows) -> str:
    """The technique most of the rows that drafted use (ties: the first by name)."""
    counts: dict[str, int] = {}
    for _, (technique, _), drafts, *_ in rows:
        if drafts:
            counts[technique] = counts.get(technique, 0) + 1
    return max(sorted(counts), key=counts.__getitem__)


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
