"""`crossover train-heads` on the tiny model: the pipeline runs end to end (progress through a
callback, the file into the user cache), chained MTP heads learn in order, and what it writes
loads back into a lossless MTP proposer."""

from __future__ import annotations

import numpy as np
import pytest

from engine.policy import BatchRule, TunedPolicy
from engine.speculation.drafting import MtpProposer, add_model_proposers
from engine.speculation.heads import DraftHeads
from engine.types import SamplingParams
from tests.engine.conftest import (
    SPEC_RC,
    ByteTokenizer,
    ChatBytes,
    make_engine,
    run_prompts,
)
from training.heads import TrainConfig, train_to_file


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """train_to_file with no --out, the user cache in a temporary directory: (path, heads, config,
    cache, progress calls per label)."""
    engine = make_engine(tiny, ChatBytes())
    tc = TrainConfig(prompts_per_kind=3, gen_tokens=12, max_prompt=48, n_mtp=2, exits=(2,),
                     train_vocab=256, keep_vocab=256, epochs=2, batch=32, holdout=0.3)
    calls: dict[str, list[tuple[int, int]]] = {}
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CROSSOVER_CACHE", str(cache))
        path, heads = train_to_file(engine, tc, None, lambda label, done, total:
                                    calls.setdefault(label, []).append((done, total)))
    return path, heads, tc, cache, calls


@pytest.fixture(scope="module")
def trained(run):
    return run[1], run[2]


def test_the_file_goes_to_the_user_cache_and_progress_to_the_callback(run):
    path, heads, _, cache, calls = run
    assert path == cache / "heads" / "tiny.safetensors" and path.is_file()
    assert DraftHeads.load(path).meta["heldout_agreement"] == heads.meta["heldout_agreement"]
    assert {"warmup: compiling shapes", "train-heads: generating", "train-heads: capturing hidden states",
            "train-heads: mtp head 0", "train-heads: mtp head 1",
            "train-heads: exit after 2 layers"} <= set(calls)
    for label, seen in calls.items():
        dones = [d for d, _ in seen]
        assert dones == sorted(dones) and seen[-1][0] == seen[-1][1] > 0, label  # ends at its total
    assert calls["train-heads: generating"][-1] == (4 * 3, 4 * 3)  # every prompt of every kind


def test_chained_heads_train_and_report_heldout_agreement(trained, tiny):
    heads, tc = trained
    cfg = tiny[0]
    assert heads.chained and len(heads.mtp) == 2 and set(heads.exits) == {2}
    assert heads.mtp[0]["w1"].shape == (2 * cfg.d_model, cfg.d_model)
    assert heads.exits[2]["w1"].shape == (cfg.d_model, cfg.d_model)
    heads.check(cfg)
    agreement = heads.meta["heldout_agreement"]
    assert set(agreement) == {"mtp.0", "mtp.1", "exit.2"}
    assert all(0.0 <= v <= 1.0 for a in agreement.values() for v in a.values())
    assert heads.meta["sequences"] == 4 * tc.prompts_per_kind
    # training moved the heads off their identity start (w2 = 0)
    assert all(float(np.abs(np.asarray(h["w2"])).max()) > 0 for h in heads.mtp)


def test_the_file_round_trips_into_a_lossless_proposer(trained, tiny, tmp_path):
    heads, _ = trained
    path = tmp_path / "heads.safetensors"
    heads.save(path)
    loaded = DraftHeads.load(path)
    assert loaded.chained and loaded.meta["heldout_agreement"] == heads.meta["heldout_agreement"]
    prompts = ["abcabcabc abc", "the cat sat on the mat. the cat"]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = run_prompts(make_engine(tiny, **SPEC_RC), prompts, sp, ByteTokenizer())[0]
    engine = make_engine(tiny, **SPEC_RC)
    add_model_proposers(engine, loaded, vocab_sizes=(0, 128), techniques=("mtp",))
    engine.warmup(progress=False)
    assert isinstance(engine.proposers["mtp"], MtpProposer) and engine.proposers["mtp"].chained
    engine.set_policy(TunedPolicy((BatchRule(64, "mtp", 2),), crossover=64, version=1))
    out, stats = run_prompts(engine, prompts, sp, ByteTokenizer())
    assert out == plain
    assert sum(s.proposed for s in stats if s.technique == "mtp") > 0
    assert engine.compiles_since_warmup() == 0
