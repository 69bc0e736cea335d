"""The capacity side of the objective (tuner.capacity): what a pool split costs tenants and
buys a draft model, on synthetic telemetry, and the split decision it flips."""

from __future__ import annotations

import dataclasses

import pytest

from engine.policy import BatchRule, TunedPolicy
from engine.types import EngineCapacity, ProposerCapacity, StepStats
from tuner import exact
from tuner.capacity import Capacity, held_share, served_batches, under_split
from tuner.config import TunerConfig
from tuner.model import PerfModel
from tuner.objective import evaluate
from tuner.space import SearchSpace
from tuner.split import solve_splits
from tuner.traffic import Traffic, observe

# a memory-bound accelerator: a step costs 20 ms and little more per row; the draft model
# accepts 0.6 then 0.4 (0.84 drafted tokens a step per held sequence, less than the one
# page per page of context it costs: tuner.capacity's a < ratio)
MODEL = PerfModel(target=(20.0, 0.05, 0.0, 0.02, 0.0), acceptance={"draft": (0.6, 0.4)},
                  propose={"draft": (0.5, 0.02, 0.02)})
CAP = Capacity(total_pages=400, page_size=16, max_depth=2, max_batch=32,
               proposers={"draft": (0, 0)}, lent_kv={"draft": 1.0})
SPACE = SearchSpace.build(TunerConfig(ranges=(4, 64), max_pool_split=0.5, pool_split_step=0.05), CAP)
PAGE_STEP = 25  # pages a running sequence holds (400 tokens)


def steps(batch: int, queue: int, free: int, n: int = 50) -> list[StepStats]:
    """Decode steps at `batch` with `queue` waiting and `free` tenant pages left."""
    return [StepStats(batch_size=batch, decode_tokens=batch, step_ms=20.0, queue_len=queue,
                      kv_pages_used=batch * PAGE_STEP, kv_pages_free=free) for _ in range(n)]


def light() -> Traffic:
    """Two sequences at a time, the pool mostly free."""
    return observe(steps(2, 0, 350), [], quantile=1.0)


def memory_bound() -> Traffic:
    """16 long sequences fill the 400 pages; 8 more wait for room."""
    return observe(steps(16, 8, 0), [], quantile=1.0)


def draft(split: float) -> TunedPolicy:
    return TunedPolicy((BatchRule(64, "draft", 2),), crossover=64, pool_split=split)


def test_observe_reads_the_footprint_and_the_queue_the_pool_causes() -> None:
    bound = memory_bound()
    assert bound.pages_per_sequence == PAGE_STEP and bound.queue_per_step == {16: 8.0}
    # an engine that does not report its pages: its queue is not taken for the pool's
    quiet = [dataclasses.replace(s, kv_pages_used=0) for s in steps(16, 8, 0)]
    assert observe(quiet, [], quantile=1.0).queue_per_step == {}


def test_the_lender_holds_the_longer_sequences_too() -> None:
    """Footprints of 10 and 40 pages (mean 25): lending 2 x 25 pages per batch of two would
    hold the short one and lose the long one, so the draft's share is priced at the 0.9
    quantile of the footprint."""
    mixed = observe([StepStats(batch_size=1, decode_tokens=1, step_ms=20.0, kv_pages_used=p,
                               kv_pages_free=300) for p in (10, 40) * 25], [], quantile=1.0)
    assert mixed.pages_per_sequence == 25 and mixed.pages_per_sequence_high == 40
    policy = dataclasses.replace(draft(0.0), pool_split=0.1)  # 40 lent pages, one for verify slots
    assert evaluate(policy, MODEL, mixed, CAP).held_share == pytest.approx(39 / 40)
    assert evaluate(policy, MODEL, dataclasses.replace(mixed, pages_per_sequence_high=0.0),
                    CAP).held_share == 1.0


def test_the_pool_admits_fewer_as_the_split_grows_and_the_traffic_is_remapped() -> None:
    bound = memory_bound()
    assert served_batches(bound, CAP, 0.0) == {16: 16}  # 400 pages / 25: the 8 waiting stay
    assert served_batches(bound, CAP, 0.25) == {16: 12}
    roomy = dataclasses.replace(CAP, total_pages=1000)
    assert served_batches(bound, roomy, 0.0) == {16: 24}  # room for the waiting ones too
    assert served_batches(bound, dataclasses.replace(roomy, max_batch=20), 0.0) == {16: 20}
    moved = under_split(bound, CAP, 0.25)
    assert moved.batch_weights == {12: 1.0} and sum(moved.token_shares().values()) == pytest.approx(1.0)
    assert moved.tokens_per_step == {12: 12.0} and moved.queue_per_step == {}
    calm = light()
    assert under_split(calm, CAP, 0.5) is calm  # the pool holds the demand: nothing moves


def test_the_draft_drafts_for_the_rows_its_lent_pages_hold() -> None:
    assert held_share(lent_pages=50, ratio=1.0, per_sequence=25.0, batch=4) == 0.5
    assert held_share(lent_pages=50, ratio=0.5, per_sequence=25.0, batch=4) == 1.0
    assert held_share(lent_pages=0, ratio=1.0, per_sequence=25.0, batch=4) == 0.0
    # the fitted share (measured under another split) is replaced by what this split holds
    fitted = dataclasses.replace(MODEL, draft_share={"draft": 0.2})
    at = {s: evaluate(draft(s), fitted, light(), CAP) for s in (0.0, 0.05, 0.15)}
    assert at[0.0].held_share == 0.0 and at[0.15].held_share == 1.0
    assert 0 < at[0.05].held_share < 1
    assert at[0.0].goodput < at[0.05].goodput < at[0.15].goodput


def test_a_split_that_binds_the_pool_costs_goodput_even_without_a_draft_model() -> None:
    """n-gram needs no lent pages: on the memory-bound traffic every page lent is a smaller
    batch. The objective before the capacity model scored every split the same."""
    cap = dataclasses.replace(CAP, proposers={"ngram": (0, 0)}, lent_kv={})
    model = dataclasses.replace(MODEL, acceptance={"ngram": (0.5,)})
    never = TunedPolicy((BatchRule(64),), crossover=0)
    scores = [evaluate(dataclasses.replace(never, pool_split=s), model, memory_bound(), cap)
              for s in (0.0, 0.25, 0.5)]
    assert [e.admitted for e in scores] == [16, 12, 8]
    assert scores[0].goodput > scores[1].goodput > scores[2].goodput
    assert all(e.feasible for e in scores)  # the pool binds at any split: priced, not forbidden
    best = solve_splits(SearchSpace.build(TunerConfig(ranges=(4, 64), max_pool_split=0.5), cap),
                        model, memory_bound(), cap)
    # the smallest split holding n-gram's verify slots (16 sequences x 2 drafts: 2 pages)
    assert best is not None and best.choose(16) == ("ngram", 2) and best.pool_split == 0.05
    more = evaluate(dataclasses.replace(best, pool_split=0.25), model, memory_bound(), cap)
    assert more.goodput < evaluate(best, model, memory_bound(), cap).goodput


def test_light_load_lends_what_the_draft_needs_memory_bound_lends_less() -> None:
    light_best = solve_splits(SPACE, MODEL, light(), CAP)
    bound_best = solve_splits(SPACE, MODEL, memory_bound(), CAP)
    assert light_best is not None and bound_best is not None
    # light: the smallest split that holds both sequences (50 pages + a verify-slot page)
    assert light_best.choose(2) == ("draft", 2) and light_best.pool_split == 0.15
    assert evaluate(light_best, MODEL, light(), CAP).held_share == 1.0
    assert bound_best.pool_split < light_best.pool_split
    # and the memory-bound choice is the better one there: lending the light load's split
    # would shrink the batch from 16 to 13 for drafts on a third of it
    lent = evaluate(dataclasses.replace(light_best, pool_split=light_best.pool_split), MODEL,
                    memory_bound(), CAP)
    assert lent.admitted < evaluate(bound_best, MODEL, memory_bound(), CAP).admitted
    assert evaluate(bound_best, MODEL, memory_bound(), CAP).goodput > lent.goodput


def test_the_decision_flips_with_capacity_not_with_the_batch() -> None:
    """The same 24 sequences wanting to run, in a pool that holds them all: the split goes
    back up to what the draft needs, so the memory-bound choice came from the pool binding.
    And a draft whose KV is not lent (lent_kv empty) never lends: the split buys it nothing."""
    roomy = dataclasses.replace(CAP, total_pages=4000)
    bound = memory_bound()
    roomy_best = solve_splits(SearchSpace.build(TunerConfig(ranges=(4, 64), max_pool_split=0.5,
                                                            pool_split_step=0.05), roomy),
                              MODEL, bound, roomy)
    assert roomy_best is not None and roomy_best.choose(24)[0] == "draft"
    assert roomy_best.pool_split > solve_splits(SPACE, MODEL, bound, CAP).pool_split
    assert evaluate(roomy_best, MODEL, bound, roomy).held_share == 1.0
    free = dataclasses.replace(CAP, lent_kv={})  # only its verify slots' page: split 0.05
    assert solve_splits(SearchSpace.build(TunerConfig(ranges=(4, 64), max_pool_split=0.5), free),
                        MODEL, light(), free).pool_split == 0.05


def test_a_draft_that_pays_for_its_pages_lends_on_a_memory_bound_load_too() -> None:
    """The model's stated condition: drafted tokens per held sequence above the pages it costs
    per tenant page (a > ratio) make lending pay even where the pool binds."""
    strong = dataclasses.replace(MODEL, acceptance={"draft": (0.95, 0.95)})
    assert solve_splits(SPACE, strong, memory_bound(), CAP).pool_split > 0.0
    cheap = dataclasses.replace(CAP, lent_kv={"draft": 0.25})  # a draft a quarter the size
    assert solve_splits(SPACE, MODEL, memory_bound(), cheap).pool_split > 0.0


def test_capacity_from_the_engine_names_the_lent_kv_techniques() -> None:
    proposers = {"draft": ProposerCapacity(0, 0, 4), "mtp": ProposerCapacity(1, 2, 2)}
    cap = Capacity.from_engine(EngineCapacity(100, 100, 16, 0, 4, 24, 16, proposers=proposers))
    assert dict(cap.lent_kv) == {"draft": 1.0} and cap.max_batch == 24
    assert (cap.max_depth, cap.spec_max_batch, cap.depths) == (4, 16, ())  # every depth to 4
    assert cap.proposer_depths == {"draft": 4, "mtp": 2}


def test_the_split_solve_matches_brute_force_over_splits() -> None:
    for traffic in (light(), memory_bound()):
        best = solve_splits(SPACE, MODEL, traffic, CAP)
        cells = [("none", 0), ("draft", 1), ("draft", 2)]
        scores = [evaluate(TunedPolicy((BatchRule(4, *a), BatchRule(64, *b)), x, s), MODEL, traffic, CAP)
                  for a in cells for b in cells for x in SPACE.crossovers for s in SPACE.pool_splits()]
        brute = max(e.goodput for e in scores if e.feasible)
        assert evaluate(best, MODEL, traffic, CAP).goodput == pytest.approx(brute, rel=1e-9)


def test_the_pool_that_runs_out_first_bounds_admission_and_the_draft() -> None:
    """Global pages grow with the context, a sliding-window ring holds at most 33 pages a
    sequence: sequences of 62 pages (31 in each) fill the 132-page ring at 4 while the
    458 global pages would hold 14. Counted as one pool of 590 they would seem to fit 9."""
    two = dataclasses.replace(CAP, total_pages=590, pools=((458, 0), (132, 33)))
    bound = dataclasses.replace(memory_bound(), pages_per_sequence=62.0, pages_per_sequence_high=62.0)
    assert served_batches(bound, two, 0.0) == {16: 4}
    assert served_batches(bound, dataclasses.replace(two, pools=()), 0.0) == {16: 9}
    # split 0.25: the ring keeps 99 pages (3 sequences) and lends 33, less its part of the 3
    # verify-slot pages: about one sequence of 31 of the 3 in the batch
    ev = evaluate(draft(0.25), MODEL, bound, two)
    assert ev.admitted == 3 and ev.held_share == pytest.approx((33 - 3 * 132 / 590) / 31 / 3)


def test_the_splits_solves_share_what_a_split_does_not_change(monkeypatch) -> None:
    """tuner.exact.SolveCache: at every split, the solve with the cache all splits share equals
    the solve alone (a lent technique and one that is not, a light and a memory-bound load),
    and where the split moves no batch size (light) the cells it does not touch are priced
    once, not once per split."""
    cap = dataclasses.replace(CAP, proposers={"draft": (0, 0), "ngram": (0, 0)})
    model = dataclasses.replace(MODEL, acceptance={"draft": (0.6, 0.4), "ngram": (0.5, 0.3)})
    space = SearchSpace.build(TunerConfig(ranges=(4, 64), max_pool_split=0.5), cap)
    real, calls = exact.evaluate, []
    monkeypatch.setattr(exact, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    for traffic in (light(), memory_bound()):
        cache, alone, shared, found = exact.SolveCache(), 0, 0, 0
        for split in space.pool_splits():
            at = dataclasses.replace(cap, priced_split=split)
            one = dataclasses.replace(space, max_pool_split=split, pool_split_step=split or 1.0)
            moved = under_split(traffic, cap, split)
            calls.clear()
            single = exact.solve_ranked(one, model, moved, at)
            alone += len(calls)
            calls.clear()
            both = exact.solve_ranked(one, model, moved, at, cache=cache)
            shared += len(calls)
            assert both == single
            found += single is not None
        assert found > 1
        if all(under_split(traffic, cap, s) is traffic for s in space.pool_splits()):
            # light: no split moves its batch sizes, so n-gram's cells on it are priced once
            # (a probe of a larger batch may still move: its cells are priced again)
            assert shared < 0.8 * alone, (shared, alone)
