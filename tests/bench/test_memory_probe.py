"""bench/memory_probe.py: the memory report of a warmed engine and of compiled shapes."""

from __future__ import annotations

import json

from bench import memory_probe
from engine.execute.runner import RunnerConfig
from engine.step.core import EngineConfig, EngineCore
from tests.engine.conftest import TINY_RC, ByteTokenizer


def test_process_memory_reads_this_process():
    m = memory_probe.process_memory()
    assert m["rss"] > 10 << 20 and m["mappings"] > 10
    assert m["anon"] + m["file"] == m["rss"] and m["anon"] > 0


def test_serving_report_of_a_tiny_engine(tiny):
    cfg, params = tiny
    # A pool size no other test uses: its executables are compiled here, not found in this
    # process's cache from an earlier test's engine of the same shapes.
    rc = RunnerConfig(**{**TINY_RC.__dict__, "verify_tokens": (2, 3), "spec_max_batch": 2,
                         "global_pages": 203})

    def load():
        return EngineCore(cfg, params, ByteTokenizer(), EngineConfig(runner=rc, token_budget=32,
                                                                      background_warmup=True))

    out = memory_probe.serving(load=load, requests=3)
    json.dumps(out)  # the CLI prints it
    assert out["warmup_finished"] and out["compiles_while_serving"] == 0
    assert out["executables"] > 0 and out["by_function"].get("_forward", 0) >= 1
    b = out["breakdown"]
    assert b["kv_pool"] > 0 and b["weights"] > 0 and sum(b.values()) == out["rss_steady"]
    assert out["limit"] == b["weights"] + out["settings"]["kv_budget_bytes"] + memory_probe.HEADROOM
    assert out["meets_limit"] == (out["rss_steady"] <= out["limit"])
    # each RSS reading is positive; their order is not checked: inside a long test process the
    # heap trim after warmup may return more than this tiny engine added (CI saw loaded < runtime)
    assert min(out["rss_steady"], out["rss_loaded"], out["rss_runtime"]) > 0


def test_executables_report_per_token_count(tiny):
    from engine.execute.runner import ModelRunner

    cfg, params = tiny
    runner = ModelRunner(cfg, params, RunnerConfig(**{**TINY_RC.__dict__, "max_context": 64}))
    out = memory_probe.executables([1, 2, 4], runner=runner, release=True)
    assert [r["tokens"] for r in out["rows"]] == [0, 1, 2, 4]
    assert out["rows"][-1]["mappings"] > out["rows"][0]["mappings"]  # compiled code is mapped
    rows = out["rows"]  # RSS per shape as the rows say (its sign depends on what the test process freed)
    assert out["per_shape_rss"] == (rows[-1]["rss"] - rows[1]["rss"]) / (len(rows) - 2)
