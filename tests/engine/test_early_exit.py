"""The compacting early-exit decoder (engine/early_exit.py) on the tiny random model.

What must hold whatever the random adapters predict: never exiting is the plain
forward (tokens and KV); always exiting gives the exit adapter's argmax; with
mixed rows each row's tokens are what a dense per-row reference of the same
exit pattern gives (so compaction keeps rows in their places); propagated K/V is
what the layer's own K/V projection gives; a warmed run compiles nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.compiles import compile_count
from engine.early_exit import NEVER, EarlyExit, kind_index, pow2_bucket, propagate_kv
from engine.heads import DraftHeads, head_logits
from engine.model import KVView, block, embed, rms_norm, unstack_layers

PROMPTS = [[2, 10, 11, 12, 13], [2, 40, 41], [2, 7, 300, 9, 100, 20, 21], [2, 5]]
N = 12


@pytest.fixture(scope="module")
def ee(tiny):
    cfg, params = tiny
    heads = DraftHeads.random(cfg, 0, (2, 4), 128, seed=3, scale=0.5)
    return EarlyExit(cfg, params, heads, exits=(2, 4), exit_vocab=128, page_size=4)


def _empty(cfg, B):
    z = jnp.zeros((B, 0, cfg.n_kv_heads, cfg.head_dim))
    return KVView(z, z, jnp.zeros((B, 0), jnp.int32))


def dense_reference(ee: EarlyExit, seq: list[int], layers_run: list[int]) -> list[int]:
    """Greedy token at each position of one sequence, run densely with no cache: a position that
    exited after k layers keeps its layer-k residual as every upper layer's input (so those layers'
    K/V are propagated from it) and predicts the adapter's argmax over the exit vocabulary."""
    cfg, p = ee.cfg, ee.params
    toks = jnp.asarray([seq], jnp.int32)
    pos = jnp.arange(len(seq), dtype=jnp.int32)[None]
    x = embed(cfg, p, toks)
    frozen = {}
    stop = np.asarray(layers_run)
    for i, lp in enumerate(p["layers"]):
        x, _ = block(cfg, lp, x, pos, _empty(cfg, 1), cfg.is_global(i))
        if i + 1 in ee.exits:
            frozen[i + 1] = x
        for k, xk in frozen.items():
            x = jnp.where(jnp.asarray(stop == k)[None, :, None], xk, x)
    final = rms_norm(x[0], p["final_norm"], cfg.rms_eps)
    out = np.asarray(jnp.argmax(jnp.einsum("td,vd->tv", final, p["embed"]), -1))
    for s, k in enumerate(ee.exits):
        h, top = rms_norm(frozen[k][0], p["final_norm"], cfg.rms_eps), ee.tops[s]
        ex = np.asarray(top["ids"])[np.asarray(jnp.argmax(head_logits(top["head"], h, top["embed_sub"]), -1))]
        out = np.where(stop == k, ex, out)
    return out.tolist()


def _check_rows(ee, run, prompts):
    """Every row's tokens equal the dense reference given its own exit pattern."""
    for i, prompt in enumerate(prompts):
        seq = prompt + run.tokens[i, :-1].tolist()
        stop = [ee.cfg.n_layers] * len(prompt) + run.layers_run[i, 1:].tolist()
        ref = dense_reference(ee, seq, stop)
        assert ref[len(prompt) - 1:] == run.tokens[i].tolist(), f"row {i}"


def test_pow2_bucket_and_kind_index(tiny):
    assert [pow2_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    cfg = tiny[0]  # layers: local, local, global, local, local, global, local
    assert [kind_index(cfg, i) for i in (0, 2, 3, 5, 6)] == [
        ("local", 0), ("global", 0), ("local", 2), ("global", 1), ("local", 4)]


def test_never_exit_is_the_plain_forward_tokens_and_kv(ee):
    plain = ee.run(PROMPTS, N, plain=True)
    never = ee.run(PROMPTS, N, NEVER)
    assert never.tokens.tolist() == plain.tokens.tolist()
    assert (never.layers_run == ee.cfg.n_layers).all()
    for a, b in zip(jax.tree.leaves(never.kv), jax.tree.leaves(plain.kv)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(never.kv.local_k)).sum() > 0  # something was written


def test_always_exit_gives_the_first_adapters_argmax(ee):
    run = ee.run(PROMPTS, N, threshold=0.0)
    assert (run.layers_run[:, 1:] == ee.exits[0]).all()
    assert (run.layers_run[:, 0] == ee.cfg.n_layers).all()  # the prefill's token: the full model
    _check_rows(ee, run, PROMPTS)
    plain = ee.run(PROMPTS, N, plain=True)
    assert run.tokens[:, 1:].tolist() != plain.tokens[:, 1:].tolist()  # lossy: a random adapter differs


def test_mixed_rows_keep_their_places(ee):
    never = ee.run(PROMPTS, N, NEVER)
    # The median confidence of the first adapter splits rows both ways.
    thr = float(np.median(_first_confidences(ee, PROMPTS)))
    run = ee.run(PROMPTS, N, threshold=thr)
    lr = run.layers_run[:, 1:]
    assert (lr == ee.cfg.n_layers).any() and (lr < ee.cfg.n_layers).any()
    steps_mixed = [(col < ee.cfg.n_layers).any() and (col == ee.cfg.n_layers).any() for col in lr.T]
    assert any(steps_mixed)  # some step really compacted a mixed batch
    _check_rows(ee, run, PROMPTS)
    assert run.tokens.tolist() != never.tokens.tolist()


def _first_confidences(ee, prompts):
    """Confidences of the first adapter over the first decode step of each prompt."""
    st, first = ee._prefill(prompts, N)
    from engine.early_exit import _stage
    from engine.kv import Batch

    top = ee.tops[0]
    B = len(prompts)
    batch = Batch(first[:, None].astype(np.int32), st.start, st.n_new, st.gtab, st.ltab)
    k = ee.exits[0]
    out = _stage(ee.cfg, st.ring, 0, k, ee.confidence, False, ee.params["layers"][:k], top, st.kv, batch,
                 None, st.bk, st.bv, np.full(B, B, np.int32), np.zeros(B, np.int32))
    return np.asarray(out[2])


def test_margin_confidence_is_top1_minus_top2(tiny, ee):
    cfg, params = tiny
    heads = DraftHeads.random(cfg, 0, (2, 4), 128, seed=3, scale=0.5)  # the fixture's adapters
    em = EarlyExit(cfg, params, heads, exits=(2, 4), exit_vocab=128, confidence="margin", page_size=4)
    prob, margin = _first_confidences(ee, PROMPTS), _first_confidences(em, PROMPTS)
    assert (margin <= prob + 1e-6).all() and (margin >= 0).all() and (margin < prob).any()
    thr = float(np.median(margin))
    run = em.run(PROMPTS, N, threshold=thr)
    assert (run.layers_run[:, 1:] < cfg.n_layers).any()
    _check_rows(em, run, PROMPTS)


def test_propagated_kv_is_each_layers_own_kv_projection(ee):
    cfg, layers = ee.cfg, ee.params["layers"]
    x = jax.random.normal(jax.random.PRNGKey(5), (3, 2, cfg.d_model))
    pos = jnp.asarray([[4, 5], [0, 1], [9, 10]], jnp.int32)
    lo = ee.exits[0]
    got = propagate_kv(cfg, lo, ee.kvw[lo:], x, pos)
    assert len(got) == cfg.n_layers - lo
    for j, (k, v) in enumerate(got):
        _, (k_ref, v_ref) = block(cfg, layers[lo + j], x, pos, _empty(cfg, 3), cfg.is_global(lo + j))
        np.testing.assert_allclose(np.asarray(k), np.asarray(k_ref), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(v), np.asarray(v_ref), rtol=1e-5, atol=1e-5)


def test_exited_rows_pages_hold_propagated_kv(ee):
    """After an all-exit run, the upper layers' pages at a decoded position hold the K/V
    propagated from the exit layer's residual of that position."""
    run = ee.run(PROMPTS[:1], 4, threshold=0.0)
    cfg, k = ee.cfg, ee.exits[0]
    seq = PROMPTS[0] + run.tokens[0, :-1].tolist()
    x = embed(cfg, ee.params, jnp.asarray([seq], jnp.int32))
    pos = jnp.arange(len(seq), dtype=jnp.int32)[None]
    for i in range(k):  # exact lower layers (their K/V never depend on upper ones)
        x, _ = block(cfg, ee.params["layers"][i], x, pos, _empty(cfg, 1), cfg.is_global(i))
    p = len(seq) - 1  # the newest decoded position
    want = propagate_kv(cfg, k, ee.kvw[k:], x[:, p:p + 1], pos[:, p:p + 1])
    gtab, ltab = run.tables
    ps = ee.page_size
    for j, (kk, _) in enumerate(want):
        kind, idx = kind_index(cfg, k + j)
        if kind == "global":
            page, pool = gtab[0, p // ps], run.kv.global_k
        else:
            page, pool = ltab[0, (p // ps) % ltab.shape[1]], run.kv.local_k
        got = np.asarray(pool[idx, page, p % ps])
        np.testing.assert_allclose(got, np.asarray(kk[0, 0]), rtol=1e-4, atol=1e-5)


def test_a_warmed_run_compiles_nothing(tiny):
    cfg, params = tiny
    heads = DraftHeads.random(cfg, 0, (3,), 64, seed=4, scale=0.5)
    e = EarlyExit(cfg, unstack_layers(params), heads, exits=(3,), exit_vocab=64, page_size=4)
    prompts = [p[:4] for p in PROMPTS[:3]]  # 3 rows: the batch itself pads to a bucket of 4
    mid = float(np.median(_first_confidences(e, prompts)))
    e.warm(3, 4, 6)
    before = compile_count()
    runs = [e.run(prompts, 6, threshold=thr) for thr in (0.0, mid, NEVER)]
    assert compile_count() == before
    lr = runs[1].layers_run[:, 1:]
    assert any(0 < (col < cfg.n_layers).sum() < 3 for col in lr.T)  # a partial exit: small buckets ran


def test_bad_exit_points_are_refused(tiny):
    cfg, params = tiny
    heads = DraftHeads.random(cfg, 0, (3,), 64)
    for exits in ((), (4,), (3, 3)):
        with pytest.raises(ValueError, match="exit points"):
            EarlyExit(cfg, params, heads, exits=exits)
    with pytest.raises(ValueError, match="confidence"):
        EarlyExit(cfg, params, heads, exits=(3,), confidence="entropy")
