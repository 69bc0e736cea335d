"""Prefill groups: short prompts' chunks prefilled side by side, one row each, in one call.

A prefill call costs a fixed ~35 ms on this CPU (as a batch-1 decode step: the output head and
the weights streamed once) plus ~1 ms a token. Measured on Gemma 3 270M, float32, context
512: one 32-token chunk alone takes 68 ms; 4 and 8 of them as the rows of one call take 139
and 241 ms, not 272 and 544. Two 128-token chunks gain little (261 ms together, 272 apart), so
only chunks of at most `group_tokens` (32) whose context fits
GROUP_MAX_CONTEXT are grouped: up to `RunnerConfig.prefill_rows` of them (padded to a batch
bucket) per call, at one context bucket (a 32-token chunk alone takes 66 ms at context 64 and
64 ms at 512: padding the context costs little, and each bucket is more executables). The rest
run alone, as before. While the background warmup
still compiles plain shapes, a chunk runs alone (padded to a compiled shape).
"""

from __future__ import annotations

from engine.faults import build_rows
from engine.sequence import Sequence, Status

GROUP_CHUNK = 32
"""Chunks of at most this many tokens are grouped, where it is a prefill bucket (see group_tokens)."""
GROUP_MAX_CONTEXT = 512
"""Largest context bucket grouped calls compile for (short prompts are what groups serve)."""

Chunk = tuple[Sequence, int]


def group_tokens(rc) -> int:
    """The chunk bucket grouped rows pad to: GROUP_CHUNK where it is a prefill bucket, else the
    smallest."""
    return GROUP_CHUNK if GROUP_CHUNK in rc.prefill_buckets else rc.prefill_buckets[0]


def group_contexts(contexts: tuple[int, ...]) -> tuple[int, ...]:
    """The one context bucket grouped calls compile for: the smallest that holds
    GROUP_MAX_CONTEXT, else the largest. Example: group_contexts((64, 128, 512, 2048)) == (512,);
    group_contexts((32, 128)) == (128,)."""
    return tuple([c for c in contexts if c >= GROUP_MAX_CONTEXT] or list(contexts[-1:]))[:1]


def group_shapes(batches: tuple[int, ...], chunk: int, contexts: tuple[int, ...],
                 rows: int) -> list[tuple[int, int, int]]:
    """(batch, chunk, context) of every grouped call: batch buckets from 2 up to `rows`, the
    group chunk (`group_tokens`), group_contexts. Example: group_shapes((1, 2, 4, 8,
    16), 32, (64, 2048), 8) == [(2, 32, 2048), (4, 32, 2048), (8, 32, 2048)]."""
    return [(b, chunk, c) for b in batches if 1 < b <= rows for c in group_contexts(contexts)]


def split_groups(rc, chunks: list[Chunk], compiled: bool) -> tuple[list[list[Chunk]], list[Chunk]]:
    """(groups of 2+ chunks to run as one call each, chunks to run alone), in `chunks`' order.
    `compiled`: every plain shape is compiled (the runner pads to nothing)."""
    shapes = group_shapes(rc.batch_buckets, group_tokens(rc), rc.context_buckets, rc.prefill_rows)
    if not shapes or not compiled:
        return [], list(chunks)
    most, top = max(s[0] for s in shapes), min(shapes[0][2], GROUP_MAX_CONTEXT)
    short = [(s, n) for s, n in chunks if n <= group_tokens(rc) and s.num_cached + n <= top]
    groups = [short[i : i + most] for i in range(0, len(short), most)]
    groups = [g for g in groups if len(g) > 1]
    grouped = {id(s) for g in groups for s, _ in g}
    return groups, [(s, n) for s, n in chunks if id(s) not in grouped]


def run_group(core, group: list[Chunk], events, finished) -> None:
    """Prefill `group`'s chunks as the rows of one call; a row whose chunk reaches its prompt's
    end yields the sequence's first token, as a prefill call of its own would."""
    n_of = {id(s): n for s, n in group}
    live = [s for s, _ in group if s.status is Status.RUNNING]  # a row may have failed this step
    context = group_contexts(core.runner.rc.context_buckets)[0]  # every row pads up to it
    seqs, c = build_rows(live, lambda ss: core.runner.new_call(len(ss), group_tokens(core.runner.rc), context),
                         lambda c, i, s: core._fill_row(c, i, s, n_of[id(s)]), core._failer(events, finished))
    if c is None:
        return
    tok, lp = core.runner.run(c)
    hidden = None
    for i, s in enumerate(seqs):
        s.num_cached += n_of[id(s)]
        if s.remaining == 0:  # the chunk reached the newest token: its logits give the next one
            hidden = core._hidden() if hidden is None else hidden
            s.hidden = None if hidden is None else hidden[i, 0]
            core._emit(s, [int(tok[i, 0])], [float(lp[i, 0])], events, finished, i)
