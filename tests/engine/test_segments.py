"""Segmented verifies (engine/segments.py) on the tiny random model: rows that draft nothing decode
as a plain segment beside the drafting rows' verify in one forward. Greedy output, logprobs and
MTP hidden states equal the padded verify's; the shapes compile at warmup (none while serving);
a failed row or whole segment is dropped alone; every page comes back."""

from __future__ import annotations

import pytest

from engine.drafting import add_model_proposers
from engine.heads import DraftHeads
from engine.policy import BatchRule, TenantRule, TunedPolicy
from engine.segments import segment_pairs, segment_shapes
from engine.types import Request, SamplingParams, segment_split
from tests.engine.conftest import SPEC_PROMPTS, SPEC_RC, ByteTokenizer, churn_with_aborts
from tests.engine.conftest import make_engine as _make_engine

TOK = ByteTokenizer()
TENANTS = ("copy", "chat", "code", "chat")
PROMPTS = [SPEC_PROMPTS[i] for i in (0, 1, 3, 4)]
POLICY = TunedPolicy((BatchRule(64, "ngram", 4),), crossover=64, version=3,
                     tenants=(TenantRule("chat"), TenantRule("code", "mtp", 3)))
"""chat (half the rows): no drafts; code: MTP at depth 3; the others: n-gram at depth 4."""
SP = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=True, top_logprobs=2)
SEGMENTED = dict(SPEC_RC, verify_tokens=(2, 5), segment_rows=4)
"""Two plain and two drafting rows: segments (2, 2) at 1 + depth 5. One verify length that segments
and at most 4 rows keep the compiles few (4 segment shapes)."""


def make_engine(tiny, tokenizer=None, **rc):
    """The padded steps' engine (EngineConfig.ragged_steps off): what this module tests."""
    return _make_engine(tiny, tokenizer, ragged_steps=False, **rc)


def _run(engine, sp=SP):
    """(per request: tokens, logprobs, top logprobs), the step stats."""
    for i, p in enumerate(PROMPTS):
        engine.add_request(Request(f"r{i}", TOK.encode(p), sp, tenant=TENANTS[i]))
    out = {f"r{i}": ([], [], []) for i in range(len(PROMPTS))}
    stats = []
    while engine.has_work():
        o = engine.step()
        stats += [o.stats] if o.stats else []
        for ev in o.events:
            toks, lps, tops = out[ev.request_id]
            toks += ev.token_ids
            lps += ev.logprobs or []
            tops += ev.top_logprobs or []
    return [out[f"r{i}"] for i in range(len(PROMPTS))], stats


def _engine(tiny, **rc):
    e = make_engine(tiny, **rc)
    add_model_proposers(e, DraftHeads.random(tiny[0], 8, (3, 6), 128, seed=1, scale=0.3), vocab_sizes=(0,),
                        techniques=("mtp",))
    e.warmup(progress=False)
    e.set_policy(POLICY)
    return e


@pytest.fixture(scope="module")
def segmented(tiny):
    return _engine(tiny, **SEGMENTED)


@pytest.fixture(scope="module")
def padded(segmented):
    """The same engine's run with its segment shapes hidden: every step verifies padded."""
    ready, segmented.runner.segments_ready = segmented.runner.segments_ready, frozenset()
    try:
        return _run(segmented)
    finally:
        segmented.runner.segments_ready = ready


def test_shape_set_is_small_and_bounded():
    from engine.runner import RunnerConfig

    rc = RunnerConfig(batch_buckets=(1, 2, 4, 8, 16, 32), verify_tokens=(2, 3, 5, 9), spec_max_batch=16,
                      context_buckets=(512, 1024), segment_rows=12)
    pairs = segment_pairs(rc)
    assert all(v <= 6 and p + v <= 12 for p, v in pairs) and (8, 4) in pairs and (8, 8) not in pairs
    assert len(pairs) == 12
    shapes = segment_shapes(rc)
    assert {q for _, _, q, _ in shapes} == {5, 9} and {c for *_, c in shapes} == {1024}  # 1 + depth 4 and 8
    assert segment_shapes(RunnerConfig(verify_tokens=(2, 5), segment_rows=0)) == []


def test_segmented_steps_equal_padded_ones(segmented, padded):
    out, stats = _run(segmented)
    want, padded_stats = padded
    assert [o[0] for o in out] == [w[0] for w in want]  # tokens
    for (_, lps, tops), (_, wlps, wtops) in zip(out, want):
        assert lps == pytest.approx(wlps, rel=1e-3, abs=1e-3)  # bfloat16 scoring, other batch shapes
        assert [[t for t, _ in top] for top in tops] == [[t for t, _ in top] for top in wtops]
    seg = [s for s in stats if s.plain_rows]
    assert seg, "no step ran segmented"
    assert not any(s.plain_rows for s in padded_stats)
    buckets = segmented.runner.rc.batch_buckets
    shapes = {s[:3] for s in segment_shapes(segmented.runner.rc)}
    for s in seg:
        rows = sum(c.rows for c in s.row_classes)
        drafting = rows - s.plain_rows
        assert 0 < drafting < rows
        q = 5
        assert segment_split(s.plain_rows, drafting, q, buckets, shapes) is not None
    assert any(c.technique == "mtp" and c.accepted for s in seg for c in s.row_classes)  # hidden states carried
    assert segmented.compiles_since_warmup() == 0
    assert segmented.pool.used == 0 and segmented.pool.free == segmented.pool.total


def test_capacity_lists_the_segment_shapes(segmented):
    cap = segmented.capacity()
    assert cap.segment_shapes and all(len(s) == 3 for s in cap.segment_shapes)
    assert (2, 2, 5) in cap.segment_shapes


def test_a_failed_plain_segment_leaves_the_drafting_rows(segmented, padded, monkeypatch):
    """Every chat row's sampling inputs fail in segmented steps: they are failed alone and the
    drafting rows verify on their own, with the padded run's tokens."""
    fill = segmented._fill_row

    def failing(c, row, seq, n):
        if seq.req.tenant == "chat" and c.tokens.shape[1] == 1 and c.global_table.shape[1] == 128 // 4:
            raise ValueError("bad sampling inputs")
        fill(c, row, seq, n)

    import engine.step as step

    alone, calls = step._alone, []
    monkeypatch.setattr(segmented, "_fill_row", failing)
    monkeypatch.setattr(step, "_alone", lambda *a: calls.append(a) or alone(*a))
    out, stats = _run(segmented)
    assert calls and not calls[0][1] and calls[0][2]  # the plain segment emptied, the drafting one ran
    want = padded[0]
    for i, tenant in enumerate(TENANTS):
        if tenant == "chat":
            assert out[i][0] == want[i][0][: len(out[i][0])]
        else:
            assert out[i][0] == want[i][0]
    assert segmented.pool.used == 0 and segmented.pool.free == segmented.pool.total


def test_leak_with_segments_and_random_aborts(segmented, monkeypatch):
    e = segmented
    e.set_policy(TunedPolicy((BatchRule(64, "ngram", 4),), crossover=64, tenants=(TenantRule("chat"),)))
    add = e.add_request
    steps = []
    step = e.step

    def counted():
        o = step()
        steps.append(o.stats)
        return o

    monkeypatch.setattr(e, "step", counted)

    def with_tenant(req):
        req.tenant = TENANTS[int(req.request_id[1:]) % len(TENANTS)]
        add(req)

    monkeypatch.setattr(e, "add_request", with_tenant)
    done = churn_with_aborts(e, 60, seed=5)
    assert len(done) == 60
    assert any(s and s.plain_rows for s in steps)
    assert e.pool.used == 0 and e.pool.free == e.pool.total


def test_first_runs_run_each_segment_shape_without_compiling(segmented):
    from engine.first_runs import FirstRuns

    runs = FirstRuns(segmented)
    want = [s for k, s in runs.left if k == "segments"]
    assert len(want) == 4  # (1, 1), (1, 2), (2, 1), (2, 2) at 1 + depth 5
    runs.run_all()
    assert not [s for k, s in runs.left if k == "segments"]
    assert segmented.compiles_since_warmup() == 0


def test_the_mapping_budget_counts_the_segment_shapes():
    """24 shapes (12 row pairs, 1 + depth 4 and 8, one context) at MAPS_PER_SEGMENT each; under a
    mapping cap they leave speculation fewer context buckets, never more."""
    from engine.config import GEMMA3_270M
    from engine.loader import MAPS_PER_SEGMENT, VERIFY_TOKENS, estimated_mappings, runner_config

    def rc(rows, limit=None):
        return runner_config(GEMMA3_270M, "float32", 2 << 30, 32, 1024, verify_tokens=VERIFY_TOKENS,
                             spec_max_batch=32, map_limit=limit, segment_rows=rows)

    assert len(segment_shapes(rc(12))) == 24
    assert estimated_mappings(rc(12), False) - estimated_mappings(rc(0), False) == pytest.approx(24 * MAPS_PER_SEGMENT)
    capped, free = rc(12, 60000), rc(0, 60000)
    assert set(capped.spec_contexts) <= set(free.spec_contexts)
    assert estimated_mappings(capped, False) <= 60000
