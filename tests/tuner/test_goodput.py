"""The tuner reads goodput as delivered tokens: steps recorded where max_tokens cuts accepted
drafts off count only what the requests received, and the model fitted on them predicts it."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from engine.fake import FakeCost, FakeEngine, FakeProposer
from engine.policy import BatchRule, TunedPolicy
from engine.types import Request, SamplingParams
from store.db import session_scope
from tests.tuner import synth
from tuner.data import read_steps
from tuner.model import PerfModel


def test_a_model_fitted_on_cut_drafts_predicts_the_tokens_requests_received(db: Engine) -> None:
    # every draft is accepted; a request of 6 tokens gets 1 + 3 in its first step and 2 of the
    # next step's 4: 3 tokens per row delivered, where counting accepted drafts would say 4
    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram", (1.0,))}, cost=FakeCost(), max_batch=8,
                        max_depth=3)
    engine.set_policy(TunedPolicy((BatchRule(8, "ngram", 3),), crossover=8))
    for i in range(64):
        engine.add_request(Request(f"r{i}", engine.tokenizer.encode("abcdefghij"),
                                   SamplingParams(max_tokens=6, ignore_eos=True)))
    stats, received = [], 0
    while engine.has_work():
        out = engine.step()
        stats.append(out.stats)
        received += sum(len(ev.token_ids) for ev in out.events)
    synth.write(db, stats)
    with session_scope(db) as s:
        steps = read_steps(s, 0.0)
    rows = sum(c.rows for s in steps for c in s.row_classes)
    assert sum(s.decode_tokens for s in steps) == received == 64 * 6 and rows == 128
    assert sum(s.cut_tokens for s in steps) == 64 * 2
    model = PerfModel.fit(steps)
    assert model.expected_tokens_per_seq("ngram", 3) == pytest.approx(received / rows, abs=0.1)
