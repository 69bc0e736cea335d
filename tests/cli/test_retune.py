"""`crossover retune --wait` prints the per-tenant decision of the retune's search."""

from __future__ import annotations

from cli.commands.retune import describe

RULES = [{"tenant": "copy-tenant", "technique": "ngram", "depth": 4, "max_batch": 8},
         {"tenant": "code-tenant", "technique": "mtp", "depth": 2, "max_batch": 8},
         {"tenant": "prose-tenant", "technique": "none", "depth": 0, "max_batch": 4}]


def retune(tenants: dict | None) -> dict:
    return {"id": 7, "status": "applied", "chosen_policy_version": 3, "predicted_goodput": 120.0,
            "measured_goodput": 118.5, "error": None,
            "details": {"validation": {"reason": "kept"}, **({"tenants": tenants} if tenants else {})}}


def test_chosen_rules_name_each_tenant_and_the_gain() -> None:
    text = describe(retune({"method": "tpe", "seconds": 0.21, "chosen": True, "gain": 0.094,
                            "margin": 0.03, "rules": RULES}))
    first, second = text.split("\n")
    assert first == ("retune 7: applied, policy v3, predicted 120.0 tokens/s, measured 118.5 "
                     "tokens/s — kept")
    assert second == ("per-tenant rules, +9.4% predicted over the best single-rule policy "
                      "(tpe, 0.21 s): prose-tenant none (up to batch 4); copy-tenant ngram@4, "
                      "code-tenant mtp@2 (up to batch 8)")


def test_rules_weighed_and_not_chosen_say_so() -> None:
    text = describe(retune({"method": "exact", "seconds": 0.02, "chosen": False, "gain": -0.004,
                            "margin": 0.03, "rules": RULES[:1]}))
    assert text.split("\n")[1] == ("per-tenant rules not chosen: -0.4% predicted over the best "
                                   "single-rule policy, margin 3% (exact, 0.02 s)")


def test_without_a_tenant_search_one_line_as_before() -> None:
    assert "\n" not in describe(retune(None))
    assert "\n" not in describe(retune({"method": "skipped", "seconds": 0.0}))


def test_rules_below_the_observed_batch_sizes_follow_the_decision() -> None:
    fill = [{"tenant": "prose-tenant", "technique": "none", "depth": 0, "max_batch": 8},
            {"tenant": "copy-tenant", "technique": "ngram", "depth": 4, "max_batch": 8}]
    text = describe(retune({"method": "exact", "seconds": 0.02, "chosen": False, "gain": 0.0,
                            "margin": 0.03, "rules": [], "fill": fill}))
    assert text.split("\n")[1] == (
        "per-tenant rules not chosen: +0.0% predicted over the best single-rule policy, margin 3% "
        "(exact, 0.02 s); per-tenant rules where the window held none of their rows: prose-tenant none, "
        "copy-tenant ngram@4 (up to batch 8)")
    alone = describe(retune({"method": "skipped", "seconds": 0.0, "fill": fill[:1]}))
    assert alone.split("\n")[1] == ("per-tenant rules where the window held none of their rows: "
                                    "prose-tenant none (up to batch 8)")
