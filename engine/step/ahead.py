"""Decode ahead: the next plain decode call dispatched before this one's tokens reach the host.

A plain decode step's host work (reading the tokens, appending them, stop rules, events, the
next plan, the next call's arrays and its dispatch) otherwise runs while the device idles
between two calls. When a step decodes plainly and its rows must go on, `follow_step` builds
the next step's call now, with each row's token slot fed on the device from this call's output
slot (engine.execute.ragged_calls.follow), and dispatches it; the device runs it right after
this call while the host finishes this step. The next step takes it (`take`) when the call it
builds for itself is the same call: the same rows at the same positions, pages and sampling
settings; else it is dropped and the step dispatches its own call.

A call goes ahead only where the next plan needs nothing of the pool for its rows (no block
to register, page to take or ring entry to ready: `Scheduler.settled_decode`), so that the pool's
bookkeeping keeps its order against the step's messages (a prefix-cache reset among them) and the
call writes only positions its rows have not cached, into pages they hold now. A dropped call is
harmless: every later call runs after it on the device, and a page freed meanwhile is rewritten
by whoever gets it next.

A step follows only when every row decodes plainly and will decode again (no drafts, prefill,
grammar, logit adjustment or logprobs; no row at its max_tokens or the context's end), the
scheduler holds no waiting request, and the chooser cannot draft for the batch
(StepChooser.plain_only), so that the next step's own plan is most likely this one. A request
that arrives meanwhile is admitted as before: its prefill joins the next step's call, which
is then not the call ahead (dropped: one call's work lost per such arrival).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import numpy as np

from engine.execute import ragged_calls
from engine.execute.penalties import wants_adjust
from engine.execute.ragged_calls import OUTPUT_BUCKETS, TOKEN_BUCKETS, Launched, RaggedCall
from engine.execute.runner import bucket
from engine.execute.sequence import Sequence


@dataclass
class Ahead:
    """A call dispatched for the next step, and its rows' sequences."""

    seqs: list[Sequence]
    launched: Launched


def steady(core, items) -> bool:
    """Whether a step of `items` ((sequence, choice, drafts, chunk)) is one call of plain decode rows
    whose draws `follow_step` can feed to the next call: its output bucket is its token bucket
    (1, 2, 4, 8, 16, 32, 64 ... rows), so the call's shape is what it would be anyway."""
    n = len(items)
    if not n or not core.ecfg.decode_ahead or core.runner.mesh is not None:
        return False
    if bucket(n, OUTPUT_BUCKETS) != bucket(n, TOKEN_BUCKETS):
        return False
    if not core._chooser.plain_only(n):  # the next step may draft
        return False
    for seq, _, drafts, chunk in items:
        sp = seq.req.sampling
        if (chunk is not None or drafts or seq.matcher is not None or sp.logprobs or sp.top_logprobs
                or sp.prompt_logprobs is not None or _adjusts(sp, seq)):
            return False
    return True


def take(core, call: RaggedCall, items) -> Launched | None:
    """The call dispatched ahead for this step, when it is `call` (module docstring); None
    otherwise. Either way nothing stays ahead."""
    ahead, core._ahead = core._ahead, None
    if ahead is None or len(ahead.seqs) != len(items) or any(
            item[0] is not seq for seq, item in zip(ahead.seqs, items)):
        return None
    mine = ahead.launched.call  # its batch holds each row's position and pages
    same = (_same_batch(mine.batch, call.batch) and np.array_equal(mine.out_idx, call.out_idx)
            and np.array_equal(mine.cand, call.cand) and np.array_equal(mine.counter, call.counter)
            and mine.samp.keys() == call.samp.keys()
            and all(np.array_equal(mine.samp[k], call.samp[k]) for k in call.samp)
            and mine.mask is None and call.mask is None and mine.adjust is None and call.adjust is None)
    return ahead.launched if same else None


def follow_step(core, items, launched: Launched) -> None:
    """Dispatch the next step's call of `items`' rows after `launched` (this step's), when they all
    go on (module docstring); sets `core._ahead`."""
    seqs = [item[0] for item in items]
    if core.scheduler.waiting or not core._inbox.empty():
        return
    for seq in seqs:
        sp = seq.req.sampling
        if seq.num_output + 2 > sp.max_tokens or seq.num_cached + 2 >= core.max_context:
            return  # this step's token may be its last
    starts = [seq.num_cached + 1 for seq in seqs]
    if not all(core.scheduler.settled_decode(seq, start) for seq, start in zip(seqs, starts)):
        return  # the next plan takes or frees pages: after the step's messages, as always
    rows = [_next_row(core, seq, start) for seq, start in zip(seqs, starts)]
    call = ragged_calls.new_call(core.runner, rows)
    call.samp = launched.call.samp  # the same rows, each with the settings it had (read-only now)
    core._ahead = Ahead(seqs, ragged_calls.follow(core.runner, call, launched))


def _next_row(core, seq: Sequence, start: int) -> ragged_calls.RaggedRow:
    """The decode row of `seq` once `start` positions are cached; its token comes from the device."""
    rc = core.runner.rc
    g, ring, write = core.pool.table_rows(seq.pages, ragged_calls.table_width(rc), rc.ring_pages)
    return ragged_calls.RaggedRow((0,), start, g, ring, write)


def _adjusts(sp, seq: Sequence) -> bool:
    """Whether the row's logits are adjusted in this step or the next (penalties, banned ids)."""
    return wants_adjust(sp, seq.num_output) or wants_adjust(sp, seq.num_output + 1)


def _same_batch(a, b) -> bool:
    """Two RaggedBatches alike in everything but their token ids (`a`'s may be on the device)."""
    la, lb = jax.tree.leaves(replace(a, tokens=None)), jax.tree.leaves(replace(b, tokens=None))
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))
