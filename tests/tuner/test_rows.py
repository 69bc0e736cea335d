"""Fits from steps that record their row classes: per-tenant acceptance from mixed batches,
proposer costs of steps that ran several proposers."""

from __future__ import annotations

import random

import pytest

from engine.types import RowClass, StepStats
from tuner.acceptance import fit_acceptance, fit_draft_share
from tuner.model import PerfModel

RATES = {"copy": 0.9, "prose": 0.2}


def _class(rng: random.Random, tenant: str, technique: str, depth: int, rows: int) -> RowClass:
    per_pos = [0] * depth
    for _ in range(rows):
        for i in range(depth):
            if rng.random() >= RATES[tenant]:
                break
            per_pos[i] += 1
    return RowClass(tenant, technique, depth, rows, rows * depth, sum(per_pos), tuple(per_pos))


def _mixed_step(classes: tuple[RowClass, ...], with_classes: bool = True) -> StepStats:
    """The step-level fields as the engine sums them over the classes."""
    depth = max(c.depth for c in classes)
    per_pos = [sum(c.accepted_per_pos[i] for c in classes if i < c.depth) for i in range(depth)]
    rows = sum(c.rows for c in classes)
    return StepStats(batch_size=rows, decode_tokens=rows + sum(per_pos), technique="ngram",
                     depth=depth, proposed=sum(c.proposed for c in classes),
                     accepted=sum(per_pos), accepted_per_pos=tuple(per_pos), step_ms=10.0,
                     tenants=tuple(sorted({c.tenant for c in classes})),
                     row_classes=classes if with_classes else ())


def _steps(with_classes: bool) -> list[StepStats]:
    rng = random.Random(4)
    return [_mixed_step((_class(rng, "copy", "ngram", 4, 3), _class(rng, "prose", "ngram", 2, 3)),
                        with_classes) for _ in range(300)]


def test_tenant_rates_come_from_mixed_batches() -> None:
    """Every step holds both tenants: without row classes no tenant gets rates of its own
    (only single-tenant steps counted), with them each tenant's rate is its own."""
    old = fit_acceptance(_steps(False), {})
    assert "ngram|copy" not in old and "ngram|prose" not in old
    rates = fit_acceptance(_steps(True), {})
    assert rates["ngram|copy"][0] == pytest.approx(0.9, abs=0.03)
    assert rates["ngram|prose"][0] == pytest.approx(0.2, abs=0.04)
    # positions: prose drafted 2, copy 4; position 2 was offered by copy rows only
    assert rates["ngram|copy"][2] == pytest.approx(0.9, abs=0.04)
    assert fit_draft_share(_steps(True), {})["ngram|prose"] == pytest.approx(1.0)


def test_single_tenant_steps_without_classes_still_count() -> None:
    """Older telemetry (no row classes): a step of one tenant counts under it as before."""
    rng = random.Random(1)
    steps = [_mixed_step((_class(rng, "copy", "ngram", 2, 2),), with_classes=False)
             for _ in range(50)]
    assert fit_acceptance(steps, {})["ngram|copy"][0] == pytest.approx(0.9, abs=0.06)


def test_proposer_terms_are_fitted_jointly() -> None:
    """Steps that ran n-gram and MTP rows together record one propose_ms, the sum of both:
    a joint fit recovers each proposer's terms; a fit per step technique could not. The
    forward runs each row at its own depth: rows + proposed token rows."""
    truth = {"ngram": (0.1, 0.02, 0.01), "mtp": (0.5, 0.1, 0.2)}
    rng = random.Random(7)
    steps = []
    for _ in range(400):
        classes = []
        for technique in ("ngram", "mtp"):
            if rng.random() < 0.7:
                depth, n = rng.choice((1, 2, 4)), rng.randint(1, 8)
                classes.append(RowClass("t", technique, depth, n, rng.randint(1, n * depth)))
        if not classes:
            continue
        propose = sum(truth[c.technique][0] + truth[c.technique][1] * c.rows
                      + truth[c.technique][2] * c.rows * c.depth for c in classes)
        depth = max(c.depth for c in classes)
        rows, proposed = sum(c.rows for c in classes), sum(c.proposed for c in classes)
        steps.append(StepStats(batch_size=rows, decode_tokens=rows, technique=classes[0].technique,
                               depth=depth, proposed=proposed, propose_ms=propose,
                               step_ms=10.0 + (rows + proposed) * 0.3 + propose,
                               row_classes=tuple(classes)))
    model = PerfModel.fit(steps)
    for technique, terms in truth.items():
        assert model.propose[technique] == pytest.approx(terms, rel=1e-3, abs=1e-6)
    assert model.target[3] == pytest.approx(0.3, rel=1e-3)


def test_the_fake_engine_under_tenant_rules_fits_exactly() -> None:
    """FakeEngine serving a policy with tenant rules (copy drafts 4 deep, prose 1): every
    tenant's acceptance comes from the mixed batches' row classes, and the model prices each
    mixed step from its rows (each row 1 + its drafts, each class's proposer work) exactly as
    the fake's linear cost does."""
    from engine.fake import FakeCost, FakeEngine, FakeProposer
    from engine.policy import BatchRule, TenantRule, TunedPolicy
    from engine.types import Request, SamplingParams

    engine = FakeEngine(proposers={"ngram": FakeProposer("ngram", (0.9, 0.85, 0.8, 0.75))},
                        cost=FakeCost(per_draft_ms=0.3), max_depth=4,
                        tenant_acceptance={"copy": 1.0, "prose": 0.15})
    engine.set_policy(TunedPolicy((BatchRule(8, "ngram", 2), BatchRule(64)), crossover=8,
                                  tenants=(TenantRule("copy", "ngram", 4), TenantRule("prose", "ngram", 1))))
    steps = []
    for wave in range(6):  # batches of at most 8: every step speculates (crossover 8)
        for i in range(8):
            engine.add_request(Request(f"r{wave}-{i}", engine.tokenizer.encode(f"prompt {i} " * 3),
                                       SamplingParams(max_tokens=48 + 8 * i),
                                       tenant=("copy", "prose")[i % 2]))
        while engine.has_work():
            out = engine.step()
            steps += [out.stats] if out.stats and out.stats.row_classes else []
    mixed = [s for s in steps if len({(c.technique, c.depth) for c in s.row_classes}) > 1]
    assert len(mixed) > 20
    model = PerfModel.fit(steps)
    assert model.acceptance["ngram|copy"][0] == pytest.approx(0.9, abs=0.08)
    assert model.acceptance["ngram|prose"][0] == pytest.approx(0.135, abs=0.08)
    assert model.propose["ngram"][2] == pytest.approx(0.3, rel=1e-3)
    report = model.error_report(mixed)
    assert report.step_ms_median_ape < 1e-3


def test_depth_factors_do_not_mistake_the_tenant_for_the_depth() -> None:
    """Copy rows draft 4 deep, prose rows 2 (per-tenant rules): against pooled rates, depth 4
    would look far better than depth 2 because only the easy tenant ran it. Predicted from
    each class's own tenant rates, both depth factors stay near 1."""
    from tuner.acceptance import fit_depth_factors

    steps = _steps(True)
    rates, share = fit_acceptance(steps, {}), fit_draft_share(steps, {})
    factors = fit_depth_factors(steps, {}, rates, share)["ngram"]
    assert factors[4] == pytest.approx(1.0, abs=0.1)
    assert factors[2] == pytest.approx(1.0, abs=0.15)
