"""`bench serve`'s efficiency: served tokens/s over the bound the engine's own rates give, by
hand and end to end on the fake engine; and the shared-prefix workload sent per tenant."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.efficiency import EngineRates, decode_schedule, efficiency, engine_bound, rates_from_file
from cli.main import main as cli
from engine.fake import FakeEngine
from tests.bench.test_serve import STEP_MS, bench, check_phase
from tests.daemon.helpers import LiveServer


def test_the_bound_by_hand() -> None:
    # 4 requests of 100 prompt tokens and 10 output tokens at concurrency 2; prefill 400 tok/s,
    # decode 100 tok/s at batch 2. Prefill: 400 / 400 = 1 s. Decode: each request decodes 9
    # tokens (its prefill yields the first), two at a time: 18 steps of batch 2, each
    # 2 / 100 = 0.02 s, 0.36 s. Ideal 1.36 s for 40 tokens: 29.412 tok/s.
    rates = EngineRates(400.0, {1: 60.0, 2: 100.0}, "by hand")
    got = efficiency(20.0, [100] * 4, [10] * 4, 2, rates, engine_only_tokens_per_s=25.0)
    bound = got["bound"]
    assert bound["decode_steps"] == {"2": 18} and bound["decode_tokens"] == 36
    assert (bound["prefill_s"], bound["decode_s"], bound["ideal_s"]) == pytest.approx((1.0, 0.36, 1.36))
    assert got["bound_tokens_per_s"] == pytest.approx(40 / 1.36, abs=1e-3)
    assert got["ratio"] == pytest.approx(20 * 1.36 / 40, abs=1e-4)  # 0.68
    assert got["engine_only_ratio"] == pytest.approx(25 * 1.36 / 40, abs=1e-4)  # 0.85
    assert got["served_tokens_per_s"] == 20.0
    assert got["rates"]["decode_tokens_per_s"] == {"1": 60.0, "2": 100.0}
    assert bound["batches_not_measured"] == []


def test_a_ragged_tail_decodes_at_smaller_batches() -> None:
    # 3 requests at concurrency 2: 4 and 2 decode tokens side by side (2 steps at batch 2), then
    # the 4-token one goes on with the third's 6 (2 steps at batch 2), then the third alone: 4.
    assert decode_schedule([5, 3, 7], 2) == {2: 4, 1: 4}
    assert decode_schedule([1, 1], 4) == {}  # one token each: the prefills yield them all
    rates = EngineRates(1000.0, {1: 50.0, 2: 80.0}, "by hand")
    bound = engine_bound([10, 20, 30], [5, 3, 7], 2, rates)
    # prefill 60 / 1000 = 0.06 s; decode 4 steps * 2 / 80 + 4 steps * 1 / 50 = 0.1 + 0.08 s
    assert bound["ideal_s"] == pytest.approx(0.24)
    assert bound["bound_tokens_per_s"] == pytest.approx(15 / 0.24, abs=1e-3)
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        decode_schedule([3], 0)


def test_unmeasured_batches_interpolate_and_are_listed() -> None:
    rates = EngineRates(1000.0, {1: 50.0, 4: 110.0}, "by hand")
    assert rates.decode_at(2) == (pytest.approx(70.0), False)
    bound = engine_bound([10, 10], [11, 11], 2, rates)  # 10 steps at batch 2, at 70 tok/s
    assert bound["batches_not_measured"] == [2]
    assert bound["decode_s"] == pytest.approx(10 * 2 / 70.0, abs=1e-4)


def engine_json(path: Path, prefill: float, decode: dict[int, float]) -> Path:
    """A file shaped like `crossover bench engine`'s JSON."""
    path.write_text(json.dumps({
        "model": "fake-reverse", "prefill": {"prompt_tokens": 512, "tokens_per_s": prefill},
        "decode": [{"batch": b, "tokens_per_s": v, "step_ms": 1.0, "steps": 9}
                   for b, v in decode.items()]}))
    return path


def test_rates_from_a_bench_engine_file(tmp_path: Path) -> None:
    rates = rates_from_file(str(engine_json(tmp_path / "e.json", 600.0, {1: 20.0, 8: 120.0})))
    assert rates.prefill_tokens_per_s == 600.0 and rates.decode_tokens_per_s == {1: 20.0, 8: 120.0}
    assert "e.json" in rates.source
    (tmp_path / "bad.json").write_text('{"decode": []}')
    with pytest.raises(ValueError, match="not a `crossover bench engine` JSON"):
        rates_from_file(str(tmp_path / "bad.json"))


def check_efficiency(result: dict, concurrency: int) -> dict:
    """The block is there, positive, and its bound follows from its own rates and steps."""
    eff = result["efficiency"]
    assert eff["served_tokens_per_s"] == result["http"]["output_tokens_per_s"]
    assert 0 < eff["ratio"] and eff["bound_tokens_per_s"] > 0
    assert eff["ratio"] == pytest.approx(eff["served_tokens_per_s"] / eff["bound_tokens_per_s"],
                                         abs=1e-3)
    bound, rates = eff["bound"], eff["rates"]
    assert bound["concurrency"] == concurrency
    assert bound["prompt_tokens"] == result["http"]["prompt_tokens"]
    assert bound["output_tokens"] == result["http"]["output_tokens"]
    used = bound["decode_tokens_per_s_used"]
    for b, tps in rates["decode_tokens_per_s"].items():  # measured rates are used as they are
        assert used.get(b, tps) == tps
    decode_s = sum(n * int(b) / used[b] for b, n in bound["decode_steps"].items())
    ideal = bound["prompt_tokens"] / rates["prefill_tokens_per_s"] + decode_s
    assert bound["ideal_s"] == pytest.approx(ideal, rel=1e-3, abs=1e-3)
    return eff


def test_efficiency_measured_on_the_fake_engine_in_the_same_run(tmp_path: Path) -> None:
    result = bench(tmp_path, "--requests", "8", "--concurrency", "4", "--max-tokens", "6")
    eff = check_efficiency(result, 4)
    assert eff["bound"]["decode_steps"] == {"4": 10}  # two waves of 4, 5 decode tokens each
    assert "measured in this run" in eff["rates"]["source"]
    assert "other_processes_cpu_share" in eff["rates"]  # how busy the machine was meanwhile
    assert set(eff["rates"]["decode_tokens_per_s"]) == {"4"}  # the batch the bound needs
    assert eff["rates"]["decode_prompts"] == "8 of the served prompts"
    # the fake decodes a step of 4 in about STEP_MS: near 4 tokens per STEP_MS
    assert 0.3 < eff["rates"]["decode_tokens_per_s"]["4"] * STEP_MS / 4000 <= 1.05
    assert eff["engine_only_ratio"] > 0
    for phase in ("http", "engine_only"):  # ITL: one gap per token after the first
        assert result[phase]["itl_ms"]["n"] == 8 * 5
        assert 0 < result[phase]["itl_ms"]["p50"] <= result[phase]["itl_ms"]["p99"]
        assert result[phase]["ttft_ms"]["p50"] <= result[phase]["ttft_ms"]["p99"]


def test_efficiency_from_an_engine_rates_file(tmp_path: Path) -> None:
    rates = engine_json(tmp_path / "engine.json", 1e6, {1: 100.0, 4: 400.0})
    result = bench(tmp_path, "--requests", "4", "--concurrency", "2", "--max-tokens", "5",
                   "--engine-rates", str(rates), "--no-db")
    eff = check_efficiency(result, 2)
    assert "engine.json" in eff["rates"]["source"]
    assert eff["bound"]["batches_not_measured"] == [2]  # 200 tok/s, a third of the way to 4
    assert eff["bound"]["decode_tokens_per_s_used"] == {"2": 200.0}
    assert eff["bound"]["decode_s"] == pytest.approx(8 * 2 / 200.0, abs=1e-4)


def test_by_url_the_rates_come_from_a_file_or_there_is_no_ratio(
        tmp_path: Path, live: Callable[..., LiveServer]) -> None:
    server = live(FakeEngine(step_delay_s=STEP_MS / 1000.0))
    flags = ["--url", server.url, "--requests", "4", "--concurrency", "2", "--max-tokens", "4"]
    plain = bench(tmp_path, *flags)
    assert plain["efficiency"]["ratio"] is None and "--engine-rates" in plain["efficiency"]["reason"]
    rates = engine_json(tmp_path / "engine.json", 1e6, {2: 500.0})
    check_efficiency(bench(tmp_path, *flags, "--engine-rates", str(rates)), 2)


def test_shared_prefix_sends_each_tenants_requests_with_its_own_key(tmp_path: Path) -> None:
    db = tmp_path / "serve.db"
    result = bench(tmp_path, "--shared-prefix", "--requests", "8", "--concurrency", "4",
                   "--max-tokens", "4", "--db", f"sqlite:///{db}")
    check_phase(result["http"], 8, 4)
    check_efficiency(result, 4)
    assert result["config"]["max_context"] == 2048  # room for the ~1,000-byte system prompts
    assert result["http"]["prompt_tokens"] > 8 * 1000
    tenants = result["workload"]["tenants"]
    assert tenants["requests"] == {f"prefix-tenant-{i}": 2 for i in range(4)}
    with sqlite3.connect(db) as conn:  # the daemon saw the 4 tenants (and the warm-up request)
        rows = Counter(t for (t,) in conn.execute("SELECT tenant FROM xo_requests"))
    # twice: the load phase, then each request alone (the idle TTFT), each with a warm-up request;
    # the second phase's daemon knew the tenants by their new keys
    assert {t for t in rows} == set(tenants["requests"]) and sum(rows.values()) == 2 * 9
    assert result["ttft_vs_idle"]["requests"] == 8


@pytest.mark.parametrize("flags,message", [
    (["--shared-prefix", "--no-db"], "drop --no-db"),
    (["--engine-rates", "/nonexistent/engine.json"], "--engine-rates"),
    (["--prefix-tokens", "0"], "--prefix-tokens must be >= 1"),
])
def test_bad_efficiency_flags_are_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture,
                                              flags: list[str], message: str) -> None:
    out = tmp_path / "x.json"
    assert cli(["bench", "serve", "--fake", "--requests", "2", "--out", str(out), *flags]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_by_url_tenant_keys_send_each_tenant_as_itself(
        tmp_path: Path, live: Callable[..., LiveServer], db_url: str) -> None:
    from daemon.tenants.admin_ops import create_tenant
    from store.db import session_scope

    server = live(FakeEngine(step_delay_s=STEP_MS / 1000.0), db_url=db_url, open_mode=False)
    names = [f"prefix-tenant-{i}" for i in range(4)]
    with session_scope(server.database.engine) as session:
        keys = {name: create_tenant(session, name, {})[1] for name in names}
    (tmp_path / "keys.json").write_text(json.dumps(keys))
    result = bench(tmp_path, "--url", server.url, "--shared-prefix", "--prefix-tokens", "100",
                   "--requests", "8", "--concurrency", "2", "--max-tokens", "3",
                   "--tenant-keys", str(tmp_path / "keys.json"))
    check_phase(result["http"], 8, 3)
    assert "--tenant-keys" in result["workload"]["tenants"]["sent"]
    served = Counter(r.tenant for r in server.sink.results)
    # 8 and the warm-up, twice: the load phase, then each request alone (the idle TTFT)
    assert set(served) == set(names) and sum(served.values()) == 2 * 9
    assert result["ttft_vs_idle"]["prefix_cache_emptied"] is False  # the daemon at --url keeps its cache


def test_decode_rates_are_measured_on_the_prompts_given() -> None:
    """Speculation's rate depends on what is decoded: bench serve measures decode on its served
    prompts, in a closed loop of `batch` slots (the next prompt starts as a request ends), not on
    the synthetic prompts of `bench engine`, where n-gram drafts nearly always land."""
    from bench.efficiency import measure_rates

    seen: list[list[int]] = []

    class Recording(FakeEngine):
        def add_request(self, req: Any) -> None:
            seen.append(list(req.prompt_ids))
            super().add_request(req)

    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13, 14]]
    rates = measure_rates(Recording(step_delay_s=0.001), [2], 10, 4, 10, prompts)
    assert seen[3:] == prompts  # after the three prefill prompts: each served prompt once
    assert rates.decode_tokens_per_s[2] > 0 and rates.detail["decode_prompts"] == "3 of the served prompts"
