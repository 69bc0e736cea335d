"""Fault containment inside one engine step: what a sequence's own fault may take down.

A fault is attributed to a sequence when its own host-side work raises: its
admission, its row of sampling inputs, its proposal, its detokenization or
stop rules. `EngineCore` then ends that sequence alone (finish_reason
"error", pages freed) through a `fail(seq, what)` callback and the step goes
on for the rest. A fault no sequence owns (the forward call) is not caught
here: it leaves `step()` and the caller runs `EngineCore.recover()`.

    >>> rows, out = build_rows([1, 2, 3], lambda items: [], lambda out, i, x: out.append(10 // (x - 2)),
    ...                        lambda x, what: print("failed", x, "in", what))
    failed 2 in its sampling inputs
    >>> rows, out
    ([1, 3], [-10, 10])
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from engine.types import Request, RequestResult


def build_rows(items: list, new_call: Callable[[list], Any], fill: Callable[[Any, int, Any], None],
               fail: Callable[[Any, str], None]) -> tuple[list, Any]:
    """(items kept, their call): `new_call(items)` makes the arrays, `fill(call, row, item)` writes
    one row. An item whose row raises is failed (`fail(item, what)`) and the call is made again
    without it; ([], None) when none is left."""
    while items:
        call = new_call(items)
        for i, item in enumerate(items):
            try:
                fill(call, i, item)
            except Exception:
                fail(item, "its sampling inputs")
                items = items[:i] + items[i + 1 :]
                break
        else:
            return items, call
    return [], None


def propose_alone(proposer: Any, seqs: list, depth: int,
                  fail: Callable[[Any, str], None]) -> tuple[list, list[list[int]]]:
    """(sequences kept, their drafts). When the batch's proposal raises, each sequence proposes
    alone and those that raise again are failed; if none does, the fault is nobody's own and the
    first exception propagates."""
    try:
        return seqs, proposer.propose(seqs, depth)
    except Exception as exc:
        fault = exc
    kept, drafts = [], []
    for s in seqs:
        try:
            d = proposer.propose([s], depth)[0]
        except Exception:
            fail(s, f"its {proposer.name} proposal")
            continue
        kept.append(s)
        drafts.append(d)
    if len(kept) == len(seqs):
        raise fault
    return kept, drafts


def unadmitted(req: Request, reason: str) -> RequestResult:
    """The result of a request that never became a sequence."""
    return RequestResult(request_id=req.request_id, tenant=req.tenant, prompt_tokens=len(req.prompt_ids),
                         output_tokens=0, arrival_time=req.arrival_time, first_token_time=None,
                         finish_time=time.time(), finish_reason=reason)
