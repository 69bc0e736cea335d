"""Decode ahead (engine/step/ahead.py): a plain decode step dispatches the next step's call before
its own tokens reach the host. The tokens are those of steps that wait for every call, greedy and
seeded samples alike, through page growth, ring wraps and the prefix cache; newcomers, aborts and
rows at their ends drop or skip the call ahead without a lost page. A call goes ahead only where
its rows stay inside their pages (page size 4 here: about a third of the steps)."""

from __future__ import annotations

import pytest

from engine.execute.runner import RunnerConfig
from engine.step import ahead
from engine.step.core import EngineConfig, EngineCore
from engine.types import Request, SamplingParams
from tests.engine.conftest import TINY_RC, ByteTokenizer, run_requests

TOK = ByteTokenizer()
PROMPTS = ["abcabcabc", "the cat sat on the mat", "x", "def f(x):\n    return x"]


def _engine(tiny, prefix_cache=True, decode_ahead=True):
    rc = RunnerConfig(**{**TINY_RC.__dict__, "fast_output": False})
    e = EngineCore(tiny[0], tiny[1], TOK, EngineConfig(runner=rc, token_budget=32, prefix_cache=prefix_cache,
                                                       decode_ahead=decode_ahead))
    e.warmup(progress=False)
    return e


@pytest.fixture
def taken(monkeypatch):
    """Counts of `ahead.take`: [calls it dropped or found none, calls it handed over]."""
    counts = [0, 0]
    real = ahead.take

    def counting(core, call, items):
        got = real(core, call, items)
        counts[got is not None] += 1
        return got

    monkeypatch.setattr(ahead, "take", counting)
    return counts


def _pages_back(e):
    e.pool.drop_cached()
    assert e.pool.used == 0 and e.pool.free == e.pool.total


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_tokens_equal_waiting_for_every_call(tiny, taken, prefix_cache):
    """Greedy and seeded sampled rows of different lengths (rows at their max_tokens skip the call
    ahead), decoding past page boundaries and around the ring: the tokens of an engine that waits
    for every call, with most steps taken from calls dispatched ahead."""
    ids = [TOK.encode(p) for p in PROMPTS]
    sps = [SamplingParams(max_tokens=40, ignore_eos=True),
           SamplingParams(max_tokens=33, temperature=0.9, seed=7, ignore_eos=True)]
    e = _engine(tiny, prefix_cache)
    got = [run_requests(e, ids, sp)[0] for sp in sps]
    assert taken[1] > 5, taken  # steps whose rows stayed inside their pages went ahead
    _pages_back(e)
    e2 = _engine(tiny, prefix_cache, decode_ahead=False)
    want = [run_requests(e2, ids, sp)[0] for sp in sps]
    assert got == want
    assert all(len(t) == sp.max_tokens for toks, sp in zip(got, sps) for t in toks)


def _step_until_ahead(e, limit=100):
    for _ in range(limit):
        e.step()
        if e._ahead is not None:
            return
    raise AssertionError("no call went ahead")


def test_newcomer_and_abort_while_ahead(tiny, taken):
    """A request that arrives while a call is ahead is admitted at the next step as before (the call
    ahead dropped; its tokens as alone), an aborted one ends with "abort", and every page returns."""
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    e = _engine(tiny)
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for i, p in enumerate(PROMPTS[:3]):
        e.add_request(Request(f"r{i}", TOK.encode(p), sp))
    _step_until_ahead(e)
    e.add_request(Request("new", TOK.encode(PROMPTS[3]), sp))
    e.abort("r1")
    ahead_of_r0 = e._ahead

    def collect(o) -> None:
        for ev in o.events:
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
            if ev.finished:
                reasons[ev.request_id] = ev.finish_reason

    collect(e.step())
    assert e._seqs["new"].num_cached > 0 and e._ahead is not ahead_of_r0  # prefilled now, the call dropped
    while e.has_work():
        collect(e.step())
    assert reasons["r1"] == "abort" and reasons["new"] == "length" and reasons["r0"] == "length"
    _pages_back(e)
    alone = _engine(tiny, decode_ahead=False)
    want, _ = run_requests(alone, [TOK.encode(PROMPTS[3])], sp)
    assert out["new"] == want[0]
    assert taken[1] > 0


def test_stop_and_logprob_rows_run_as_before(tiny, taken):
    """Rows that stop on a token, or want logprobs, give the tokens and logprobs of an engine that
    waits for every call; a batch with a logprob row never goes ahead."""
    ids = [TOK.encode(p) for p in PROMPTS]
    stop = SamplingParams(max_tokens=30, stop_token_ids=(TOK.encode("a", add_bos=False)[0],))
    lps = SamplingParams(max_tokens=12, logprobs=True, top_logprobs=2, ignore_eos=True)
    e, plain = _engine(tiny), _engine(tiny, decode_ahead=False)
    assert _events(e, ids, stop) == _events(plain, ids, stop)
    before = list(taken)
    assert _events(e, ids, lps) == _events(plain, ids, lps)
    assert taken[1] == before[1]
    _pages_back(e)


def _events(e, ids, sp) -> dict:
    """Each request's (token ids, logprobs, top logprobs, finish reason) per event."""
    for i, p in enumerate(ids):
        e.add_request(Request(f"r{i}", p, sp))
    out: dict[str, list] = {}
    while e.has_work():
        for ev in e.step().events:
            out.setdefault(ev.request_id, []).append((ev.token_ids, ev.logprobs, ev.top_logprobs,
                                                      ev.finish_reason))
    return out
