"""Goodput counts delivered tokens: a step's decode_tokens, accepted and accepted_per_pos count
only the tokens requests kept, when a max_tokens, a stop id or a stop string ends a request
inside a verify row's accepted drafts (the rest is cut_tokens); the output stays plain decoding's."""

from __future__ import annotations

import pytest

from engine.policy import BatchRule, TunedPolicy
from engine.speculation.proposers import Proposer
from engine.types import Request, SamplingParams
from tests.engine.conftest import SPEC_RC, LetterTokenizer, make_engine, run_requests

TOK = LetterTokenizer()
PROMPTS = [TOK.encode(p) for p in ("abcabcabc", "x y z", "x")]
"""Prompts that the first step prefills together (within the token budget)."""
DEPTH = 4
"""Every decode step of a request runs one verify row of DEPTH drafts that are all accepted:
output token 0 comes from the prefill, decode step s >= 1 gives tokens 5s - 4 .. 5s (the last
one the token after the drafts)."""


class Oracle(Proposer):
    """Drafts the request's plain greedy continuation: greedy verification accepts every draft.
    Loaded in the n-gram proposer's place (a policy names the techniques it knows)."""

    name = "ngram"

    def __init__(self, outputs: dict[str, list[int]]):
        self.outputs = outputs

    def propose(self, seqs, depth):
        return [self.outputs[s.request_id][s.num_output: s.num_output + depth] for s in seqs]


@pytest.fixture(scope="module")
def plain(tiny) -> list[list[int]]:
    """Each prompt's first 30 greedy tokens, decoded plainly."""
    return run_requests(make_engine(tiny, TOK, **SPEC_RC), PROMPTS,
                        SamplingParams(max_tokens=30, ignore_eos=True))[0]


def _speculate(tiny, plain, sps: list[SamplingParams], drafts: bool = True):
    """Run request r<i> (PROMPTS[i], sps[i]) with the oracle's drafts (or without any): (its token
    ids, the decode steps as (stats, tokens their events carried), the results by id)."""
    e = make_engine(tiny, TOK, **SPEC_RC)
    if drafts:
        e.add_proposer(Oracle({f"r{i}": out for i, out in enumerate(plain)}))
        e.set_policy(TunedPolicy(rules=(BatchRule(8, "ngram", DEPTH),), crossover=8, version=1))
    for i, sp in enumerate(sps):
        e.add_request(Request(f"r{i}", PROMPTS[i], sp))
    first = e.step()  # every prompt's prefill: one token each, no decode row
    assert [len(ev.token_ids) for ev in first.events] == [1] * len(sps) and first.stats.decode_tokens == 0
    out = {ev.request_id: list(ev.token_ids) for ev in first.events}
    steps, results = [], {}
    while e.has_work():
        o = e.step()
        assert o.stats.prefill_tokens == 0
        steps.append((o.stats, sum(len(ev.token_ids) for ev in o.events)))
        for ev in o.events:
            out[ev.request_id] += ev.token_ids
        results.update((r.request_id, r) for r in o.finished)
    assert e.pool.used == 0
    return [out[f"r{i}"] for i in range(len(sps))], steps, results


def _check_delivered(steps, results) -> None:
    """Every step's goodput is what its decode rows' events carried: decode_tokens are those
    tokens, one per row plus the delivered drafts, which the requests' results count too."""
    for stats, delivered in steps:
        rows = sum(c.rows for c in stats.row_classes)
        assert stats.decode_tokens == delivered == rows + stats.accepted
        assert sum(stats.accepted_per_pos) == stats.accepted == sum(c.accepted for c in stats.row_classes)
    assert sum(s.accepted for s, _ in steps) == sum(r.accepted_tokens for r in results.values())
    assert sum(s.decode_tokens for s, _ in steps) == sum(r.output_tokens - 1 for r in results.values())


def test_rows_draft_no_further_than_max_tokens(tiny, plain):
    lengths = (8, 13, 4)  # the last decode step of each has room for 1, 1 and 2 drafts, not DEPTH
    out, steps, results = _speculate(tiny, plain,
                                     [SamplingParams(max_tokens=m, ignore_eos=True) for m in lengths])
    assert out == [p[:m] for p, m in zip(plain, lengths)]
    _check_delivered(steps, results)
    decode_steps = [-(-(m - 1) // (DEPTH + 1)) for m in lengths]
    assert [results[f"r{i}"].accepted_tokens for i in range(3)] == [m - 1 - n
                                                                    for m, n in zip(lengths, decode_steps)]
    assert [s.cut_tokens for s, _ in steps] == [0, 0, 0]  # nothing drafted past max_tokens to cut
    # r2 ends in the first decode step, r0 in the next; a step's positions run to its deepest row
    assert [s.proposed for s, _ in steps] == [4 + 4 + 2, 1 + 4, 1]
    assert [s.accepted_per_pos for s, _ in steps] == [(3, 3, 2, 2), (2, 1, 1, 1), (1,)]
    assert [s.decode_tokens for s, _ in steps] == [13, 7, 2]


def _first_repeat_free(out: list[int], width: int) -> int:
    """The first index e >= width of `out` inside a verify row's drafts (not the token after
    them) where out[e - width + 1: e + 1] occurs for the first time."""
    for e in range(width, len(out)):
        piece = out[e - width + 1: e + 1]
        first = next(i for i in range(len(out)) if out[i: i + width] == piece)
        if e % (DEPTH + 1) and first == e - width + 1:
            return e
    raise AssertionError("no such position in the plain output")


def test_a_stop_id_inside_accepted_drafts_ends_the_output_and_its_count(tiny, plain):
    ends = [_first_repeat_free(out, 1) for out in plain]
    sps = [SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(out[e],))
           for out, e in zip(plain, ends)]
    out, steps, results = _speculate(tiny, plain, sps)
    assert out == [p[: e + 1] for p, e in zip(plain, ends)]
    assert all(r.finish_reason == "stop" for r in results.values())
    _check_delivered(steps, results)
    assert sum(s.cut_tokens for s, _ in steps) == sum(DEPTH - (e - 1) % (DEPTH + 1) for e in ends)


def test_a_stop_string_inside_accepted_drafts_ends_the_tokens_where_plain_decoding_does(tiny, plain):
    ends = [_first_repeat_free(out, 2) for out in plain]
    stops = [TOK.decode(out[e - 1: e + 1]) for out, e in zip(plain, ends)]
    sps = [SamplingParams(max_tokens=30, ignore_eos=True, stop=(s,)) for s in stops]
    plain_out, plain_steps, _ = _speculate(tiny, plain, sps, drafts=False)
    assert all(s.decode_tokens == n == s.batch_size and not s.cut_tokens for s, n in plain_steps)
    assert plain_out == [p[: e + 1] for p, e in zip(plain, ends)]
    out, steps, results = _speculate(tiny, plain, sps)
    assert out == plain_out  # the tokens after the one that completes the stop string are dropped
    assert all(r.finish_reason == "stop" for r in results.values())
    _check_delivered(steps, results)
    assert sum(s.cut_tokens for s, _ in steps) == sum(DEPTH - (e - 1) % (DEPTH + 1) for e in ends)
