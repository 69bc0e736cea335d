"""`crossover plan`, run in-process through cli.main.main."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from engine.config import GEMMA3_270M
from engine.memory.planner import GiB, MiB, device_profile, make_plan


def run_plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_human_table_270m(capsys):
    rc, out, _ = run_plan(capsys, "--device", "tpu-v6e-1", "--model", "gemma3-270m")
    expected = make_plan(GEMMA3_270M, device_profile("tpu-v6e-1"), "bfloat16", "bfloat16", 8192)
    assert rc == 0
    assert "gemma3-270m on tpu-v6e-1" in out
    assert "global 3.00 KiB (3 layers) + local 15.00 KiB (15 layers, window 512)" in out
    assert "31.73 MiB paged + windowed, 144.00 MiB naive" in out
    assert f"{expected.tenants} paged + windowed vs {expected.naive_tenants} naive" in out
    assert "activation reserve 2.12 GiB" in out
    assert "bfloat16 511.36 MiB" in out


def test_human_table_27b_does_not_fit(capsys):
    rc, out, _ = run_plan(capsys, "--device", "tpu-v6e-1", "--model", "gemma3-27b")
    assert rc == 1
    assert "does not fit: weights 50.31 GiB (bfloat16) > usable 28.70 GiB" in out
    assert "short by 21.61 GiB" in out


def test_json_output(capsys):
    rc, out, _ = run_plan(capsys, "--device", "cpu", "--budget", "4GiB", "--model", "gemma3-270m",
                          "--context", "4096", "--json")
    data = json.loads(out)
    assert rc == 0
    assert data["device"]["usable_bytes"] == 4 * GiB
    assert (data["kv_global_bytes_per_token"], data["kv_local_bytes_per_token"]) == (3072, 15360)
    assert data["context_len"] == 4096
    assert data["fits"] is True
    assert data["pools"]["tenants"] == data["tenants"] > data["naive_tenants"]
    assert data["weight_bytes_by_dtype"]["bfloat16"] == 2 * GEMMA3_270M.param_count()


@pytest.mark.parametrize(("budget", "expected"), [
    ("512MiB", 512 * MiB), ("2e9", 2_000_000_000), ("1.5GB", 1_500_000_000),
    ("8 gib", 8 * GiB),
])
def test_budget_sizes(capsys, budget, expected):
    rc, out, _ = run_plan(capsys, "--device", "cpu", "--budget", budget, "--json")
    assert json.loads(out)["device"]["usable_bytes"] == expected
    assert rc in (0, 1)


def test_moe_and_speculation(capsys):
    rc, out, _ = run_plan(capsys, "--device", "h200", "--model", "26B/4B", "--speculation",
                          "2GiB", "--json")
    data = json.loads(out)
    assert rc == 0
    assert (data["total_params"], data["active_params"]) == (26_000_000_000, 4_000_000_000)
    assert data["speculation_bytes"] == 2 * GiB and data["tenants_displaced"] >= 1
    assert "gemma3-12b" in data["notes"][0]
    rc, out, _ = run_plan(capsys, "--model", "26B/4B", "--layers", "30")
    assert "MoE attention shape from gemma3-12b: 30 layers" in out


@pytest.mark.parametrize(("argv", "named", "choices"), [
    (["--device", "tpu-v9"], "'tpu-v9'", "cpu, tpu-v6e-1, h200"),
    (["--model", "gemma4"], "'gemma4'", "gemma3-270m"),
    (["--model", "26B/40B"], "'26B/40B'", "active"),
    (["--dtype", "int3"], "'int3'", "float32, bfloat16, int8, int4"),
    (["--kv-dtype", "fp8"], "'fp8'", "bfloat16"),
    (["--device", "cpu", "--budget", "8 gigs"], "'8 gigs'", "GiB"),
    (["--context", "0"], "'0'", "--context"),
    (["--context", "-5"], "'-5'", "--context"),
    (["--context", "lots"], "'lots'", "--context"),
    (["--page-size", "0"], "'0'", "--page-size"),
    (["--model", "gemma3-1b", "--layers", "3"], "'gemma3-1b'", "MoE"),
    (["--device", "tpu-v6e-1", "--budget", "40GiB"], "40.00 GiB", "28.70 GiB"),
])
def test_bad_values_exit_2_naming_the_value(capsys, argv, named, choices):
    rc, out, err = run_plan(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert err.startswith("crossover plan: error:")
    assert named in err and choices in err


def test_per_technique_memory_and_tenants_displaced(capsys):
    rc, out, _ = run_plan(capsys, "--device", "cpu", "--budget", "8GiB", "--dtype", "float32",
                          "--kv-dtype", "float32", "--context", "4096", "--json")
    assert rc == 0
    plan = json.loads(out)
    costs = {t["technique"]: t for t in plan["techniques"]}
    assert set(costs) == {"ngram", "mtp", "early_exit", "draft"}
    assert costs["ngram"]["resident_bytes"] == 0
    # 4 chained heads of 3 x 640^2 + 640 float32 weights, slices of 8192 + 32768 embedding rows
    # (+ int32 ids)
    assert costs["mtp"]["resident_bytes"] == 4 * (3 * 640 * 640 + 640) * 4 + (8192 + 32768) * (640 * 4 + 4)
    verify = 8 * 2 * 3 * 256 * 4  # 8 verify slots x K+V x 3 global layers x head_dim x float32
    assert costs["ngram"]["per_sequence_bytes"] == verify
    assert costs["draft"]["per_sequence_bytes"] > verify  # its own KV: 4 local layers over the window
    for c in costs.values():
        total = c["resident_bytes"] + c["speculating"] * c["per_sequence_bytes"]
        assert c["tenants_displaced"] == -(-total // plan["sequence_bytes"])
    rc, text, _ = run_plan(capsys, "--device", "cpu", "--budget", "8GiB")
    assert "per technique" in text and "displaces" in text


def test_the_split_in_bytes_and_tenants(capsys):
    rc, out, _ = run_plan(capsys, "--device", "cpu", "--budget", "8GiB", "--context", "4096", "--technique",
                          "mtp", "--draft-vocabs", "8192,32768", "--split", "0.25", "--json")
    plan = json.loads(out)
    assert rc == 0 and plan["technique"] == "mtp" and plan["split"]["share"] == 0.25
    assert plan["speculation_bytes"] == next(t["resident_bytes"] for t in plan["techniques"]
                                             if t["technique"] == "mtp")
    assert plan["split"]["tenants"] < plan["split"]["tenants_unsplit"] == plan["tenants"]
    rc, text, _ = run_plan(capsys, "--device", "cpu", "--budget", "8GiB", "--split", "0.25")
    assert "pool split" in text and "lends" in text and "draft model's KV" in text
    assert main(["plan", "--split", "1.5"]) == 2 and "--split" in capsys.readouterr().err


def test_weights_gguf_counts_the_served_blocks(capsys):
    rc, out, _ = run_plan(capsys, "--device", "cpu", "--weights", "gguf", "--context", "4096", "--json")
    plan = json.loads(out)
    f32 = make_plan(GEMMA3_270M, device_profile("cpu"), "float32", "bfloat16", 4096)
    assert rc == 0 and plan["weight_dtype"] == "gguf" and plan["weight_bytes"] == 256_080_384
    assert plan["pool_bytes"] == f32.pool_bytes + f32.weight_bytes - 256_080_384
    mtp = next(t for t in plan["techniques"] if t["technique"] == "mtp")  # float32 heads, Q8_0 slices
    assert mtp["resident_bytes"] == 4 * (3 * 640**2 + 640) * 4 + (8192 + 32768) * (640 + 20 * 2 + 4)
    rc, _, err = run_plan(capsys, "--model", "gemma3-27b", "--weights", "gguf")
    assert rc == 2 and "--weights gguf" in err
    rc, _, err = run_plan(capsys, "--weights", "gguf", "--dtype", "bfloat16")
    assert rc == 2 and "--dtype bfloat16 contradicts --weights gguf" in err


def test_the_default_is_what_the_daemon_serves_and_the_gain_over_float32_shows(capsys):
    """On cpu the default model plans its GGUF's blocks, with the tenants they gain over float32 at
    the context; elsewhere (and with a --dtype) the dtype, as the daemon serves there."""
    rc, out, _ = run_plan(capsys, "--device", "cpu", "--context", "4096", "--json")
    plan = json.loads(out)
    f32 = make_plan(GEMMA3_270M, device_profile("cpu"), "float32", "bfloat16", 4096)
    assert rc == 0 and plan["weight_dtype"] == "gguf" and plan["float32_tenants"] == f32.tenants
    assert plan["tenants"] > f32.tenants
    _, text, _ = run_plan(capsys, "--device", "cpu", "--context", "4096")
    gained = f"+{plan['tenants'] - f32.tenants} tenants at 4096 tokens: float32 weights (1022.71 MiB) "
    assert gained + f"leave room for {f32.tenants}" in text
    _, text, _ = run_plan(capsys, "--device", "cpu", "--context", "4096", "--weights", "float32")
    assert "chosen       float32" in text and "vs float32" not in text
    for argv in (("--device", "tpu-v6e-1"), ("--device", "cpu", "--dtype", "bfloat16")):
        _, out, _ = run_plan(capsys, *argv, "--json")
        assert json.loads(out)["weight_dtype"] == "bfloat16"
