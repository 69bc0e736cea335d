"""Tensor parallelism (engine/model/sharding.py): output over a mesh of N devices equals one device.

XLA_FLAGS=--xla_force_host_platform_device_count must be set before jax is
imported, so the multi-device checks run in a fresh Python process with the flag set and
print their findings as JSON. The real 270M runs its golden prompts over 2
devices (its 4 query heads split, its one KV head replicated); 4 devices are
checked on the tiny model, whose KV heads replicate there too. The tiny model's
one-device reference runs in the test's own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]

TINY_ENGINE = dict(verify_tokens=(3,), spec_max_batch=8, max_batch=8, max_chunk=16, max_context=128)
"""The tiny engine of the check at every N: one batch for all prompts, n-gram drafts of depth 2."""


def _layout(engine) -> dict:
    """Where the engine's first layer, embedding and KV pool live."""
    lp = engine.runner.params["layers"][0]
    spec = lambda a: str(getattr(a.sharding, "spec", "single device"))
    return {"q": spec(lp.get("q", lp.get("qkv"))), "k": spec(lp.get("k", lp.get("qkv"))),
            "embed_shards": len({str(s.index) for s in engine.runner.params["embed"].addressable_shards}),
            "kv_shards": len({str(s.index) for s in engine.runner.kv.global_k.addressable_shards})}


def run_tiny(tiny, n: int) -> dict:
    """The tiny engine at tensor_parallel=n, warmed up: SPEC_PROMPTS decoded plainly, then with
    n-gram speculation; the outputs, what compiled after warmup, and the layout."""
    from engine.policy import BatchRule, TunedPolicy
    from engine.runtime.compiles import compile_count
    from engine.types import SamplingParams
    from tests.engine.conftest import SPEC_PROMPTS, make_engine, run_prompts

    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    e = make_engine(tiny, tensor_parallel=n, **TINY_ENGINE)
    e.warmup(progress=False)
    before = compile_count()
    plain = run_prompts(e, SPEC_PROMPTS, sp)[0]
    e.set_policy(TunedPolicy(rules=(BatchRule(64, "ngram", 2),), crossover=64, version=1))
    spec, stats = run_prompts(e, SPEC_PROMPTS, sp)
    e.close()
    return {"plain": plain, "spec": spec, "compiles": compile_count() - before,
            "ngram_steps": sum(s.technique == "ngram" for s in stats), **_layout(e)}


_TINY = """
import gc, json, jax
from engine.runtime.compiles import enable_persistent_cache, trim_heap
from tests.engine.conftest import make_engine
from tests.engine.test_sharding import TINY_ENGINE, _layout, run_tiny
from tests.engine.tiny import init_random_params, tiny_config

enable_persistent_cache()  # as load_engine does: a rerun loads the shapes instead of compiling them
cfg = tiny_config()  # 4 query heads, 2 KV heads: split at N=2, replicated at N=4
tiny = (cfg, init_random_params(cfg, jax.random.PRNGKey(0)))
# N=1 here only places the weights (no shape compiles): the test runs N=1 in its own process.
out = {"devices": len(jax.devices()), "1": _layout(make_engine(tiny, tensor_parallel=1, **TINY_ENGINE))}
for n in (2, 4):
    out[str(n)] = run_tiny(tiny, n)
    # N=4's warmup starts from empty caches (a shape it misses compiles, and is counted), and
    # N=2's executables give back their memory mappings (XLA:CPU maps each compiled shape).
    jax.clear_caches()
    gc.collect()
    trim_heap()
print("RESULT " + json.dumps(out))
"""


_GOLDEN = """
import json, sys, time
from pathlib import Path
from engine.loader import load_engine
from engine.types import Request, SamplingParams

t0 = time.time()
golden = json.loads(Path("tests/fixtures/golden_270m.json").read_text())
engine = load_engine(dtype="float32", max_batch=16, max_context=1024, progress=False, speculation=False,
                     tensor_parallel=int(sys.argv[1]))
got = {c["name"]: [] for c in golden["cases"]}
for c in golden["cases"]:
    sp = SamplingParams(max_tokens=len(c["generated_ids"]), ignore_eos=True, stop_token_ids=(1,))
    engine.add_request(Request(c["name"], c["prompt_ids"], sp))
while engine.has_work():
    for ev in engine.step().events:
        got[ev.request_id] += ev.token_ids
print("RESULT " + json.dumps({"got": got, "golden": golden, "seconds": time.time() - t0,
                              "kv_shards": len({str(s.index)
                                                for s in engine.runner.kv.global_k.addressable_shards}),
                              "embed_shards": len({str(s.index) for s in
                                                   engine.runner.params["embed"].addressable_shards})}))
"""


def _run(script: str, devices: int, timeout: int, *argv: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", script, *argv], check=False, cwd=ROOT, env=env,
                       capture_output=True,
                       text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_tiny_model_output_over_2_and_4_devices_equals_one_device(tiny):
    r = _run(_TINY, 4, 900)
    assert r["devices"] == 4
    assert r["1"]["q"] == "single device" and r["1"]["embed_shards"] == 1  # N=1: the fused, unsplit layout
    # The one-device reference in this process: most of its shapes are those of the other tiny-engine
    # tests, which the persistent compilation cache holds for a one-device process only (a process
    # with 4 host devices compiles them again).
    # The in-memory caches go first, so that a shape the warmup misses compiles here (and is
    # counted) even if an earlier test in this process compiled it.
    jax.clear_caches()
    one = run_tiny(tiny, 1)
    assert len({tuple(t) for t in one["plain"]}) > 1 and all(len(t) == 12 for t in one["plain"])
    assert one["q"] == "single device" and one["embed_shards"] == 1
    assert one["compiles"] == 0
    for n in ("2", "4"):
        assert r[n]["plain"] == one["plain"], n
        assert r[n]["spec"] == one["plain"], n  # n-gram verification stays lossless over the mesh
        assert r[n]["ngram_steps"] > 0
        assert r[n]["compiles"] == 0, n
        assert r[n]["q"] == "P(None, 'tp')"
        assert r[n]["embed_shards"] == int(n)  # vocabulary split
    assert r["2"]["k"] == "P(None, 'tp')" and r["2"]["kv_shards"] == 2  # 2 KV heads over 2
    assert r["4"]["k"] == "P()" and r["4"]["kv_shards"] == 1  # 2 KV heads: replicated over 4


def test_more_devices_than_present_is_refused():
    import jax

    from engine.model.sharding import make_mesh, per_device_fraction

    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        make_mesh(len(jax.devices()) + 1)
    assert per_device_fraction(4, 2) == 0.5 and per_device_fraction(1, 2) == 1.0


def test_plan_counts_weights_and_kv_per_device():
    from engine.config import GEMMA3_4B, GEMMA3_270M
    from engine.memory.planner import device_profile, make_plan, per_device_params

    dev = device_profile("tpu-v6e-1")
    one, two = (make_plan(GEMMA3_270M, dev, "bfloat16", "bfloat16", 4096, tensor_parallel=n) for n in (1, 2))
    assert two.weight_bytes < 0.6 * one.weight_bytes  # embedding, heads and MLP split; norms not
    assert two.sequence_bytes == one.sequence_bytes  # 1 KV head: replicated on each device
    assert two.tenants >= one.tenants and two.tensor_parallel == 2
    assert per_device_params(GEMMA3_270M, 1) == GEMMA3_270M.param_count()
    one, four = (make_plan(GEMMA3_4B, dev, "bfloat16", "bfloat16", 8192, tensor_parallel=n) for n in (1, 4))
    assert four.sequence_bytes == one.sequence_bytes // 4  # 4 KV heads: one per device
    assert four.tenants > 4 * one.tenants - 4
    with pytest.raises(ValueError):
        make_plan(GEMMA3_4B, dev, "bfloat16", "bfloat16", 8192, tensor_parallel=0)


def _check_golden(n: int) -> None:
    """The golden test's comparison (tests/engine/golden/test_golden.py) at tensor_parallel=n."""
    r = _run(_GOLDEN, n, 1200, str(n))
    near_tie = r["golden"]["settings"]["near_tie_margin"]
    assert r["embed_shards"] == n and r["kv_shards"] == 1  # vocabulary split; the 1 KV head replicated
    for c in r["golden"]["cases"]:
        ties = [i for i, x in enumerate(c["margins"]) if x < near_tie]
        k = ties[0] if ties else len(c["generated_ids"])
        assert k >= 32 and r["got"][c["name"]][:k] == c["generated_ids"][:k], c["name"]
    print(f"\ngolden prompts at tensor_parallel={n}: {r['seconds']:.0f}s in the subprocess")


@pytest.mark.slow
def test_real_270m_golden_prompts_over_2_devices_equal_transformers():
    _check_golden(2)


def test_a_tensor_parallel_below_one_is_refused():
    # the flag and CROSSOVER_TENSOR_PARALLEL: tests/cli/test_serve.py
    from daemon.settings import Settings, SettingsError

    with pytest.raises(SettingsError):
        Settings(tensor_parallel=0)