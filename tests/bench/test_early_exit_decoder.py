"""The compacting early-exit decoder (bench/early_exit_decoder.py) on the tiny random model.

What must hold whatever the random adapters predict: never exiting is the plain
forward (tokens and KV) with either K/V fill; always exiting gives the exit adapter's
argmax; with mixed rows each row's tokens are what a dense per-row reference of the
same exit pattern gives (so compaction keeps rows in their places); propagated K/V is
what the layer's own K/V projection gives; recompute-later's catch-up leaves the pages
exactly as the full model writes them; a warmed run compiles nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.early_exit_decoder import NEVER, EarlyExit, kind_index, pending_bucket, pow2_bucket, propagate_kv
from bench.early_exit_ops import stage
from engine.model.gemma import KVView, block, embed, rms_norm, unstack_layers
from engine.runtime.compiles import compile_count
from engine.speculation.heads import DraftHeads, head_logits

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


def dense_reference(ee: EarlyExit, seq: list[int], layers_run: list[int],
                    propagated: bool = True) -> list[int]:
    """Greedy token at each position of one sequence, run densely with no cache: a position that
    exited after k layers predicts the adapter's argmax over the exit vocabulary; with `propagated`
    it keeps its layer-k residual as every upper layer's input (so those layers' K/V are propagated
    from it), else the upper layers run on it as in the full model (recompute later)."""
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
        for k, xk in frozen.items() if propagated else ():
            x = jnp.where(jnp.asarray(stop == k)[None, :, None], xk, x)
    final = rms_norm(x[0], p["final_norm"], cfg.rms_eps)
    out = np.asarray(jnp.argmax(jnp.einsum("td,vd->tv", final, p["embed"]), -1))
    for s, k in enumerate(ee.exits):
        h, top = rms_norm(frozen[k][0], p["final_norm"], cfg.rms_eps), ee.tops[s]
        ex = np.asarray(top["ids"])[np.asarray(jnp.argmax(head_logits(top["head"], h, top["embed_sub"]), -1))]
        out = np.where(stop == k, ex, out)
    return out.tolist()


def _check_rows(ee, run, prompts, propagated=True):
    """Every row's tokens equal the dense reference given its own exit pattern."""
    for i, prompt in enumerate(prompts):
        seq = prompt + run.tokens[i, :-1].tolist()
        stop = [ee.cfg.n_layers] * len(prompt) + run.layers_run[i, 1:].tolist()
        ref = dense_reference(ee, seq, stop, propagated)
        assert ref[len(prompt) - 1:] == run.tokens[i].tolist(), f"row {i}"


def test_pow2_bucket_and_kind_index(tiny):
    assert [pow2_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert [pending_bucket(n) for n in (0, 1, 2, 3, 4)] == [0, 1, 2, 4, 4]
    cfg = tiny[0]  # layers: local, local, global, local, local, global, local
    assert [kind_index(cfg, i) for i in (0, 2, 3, 5, 6)] == [
        ("local", 0), ("global", 0), ("local", 2), ("global", 1), ("local", 4)]


@pytest.mark.parametrize("fill", ["propagate", "recompute"])
def test_never_exit_is_the_plain_forward_tokens_and_kv(ee, fill):
    plain = ee.run(PROMPTS, N, plain=True)
    never = ee.run(PROMPTS, N, NEVER, kv_fill=fill)
    assert never.tokens.tolist() == plain.tokens.tolist()
    assert (never.layers_run == ee.cfg.n_layers).all() and never.caught_up == 0
    _same_pages(never.kv, plain.kv, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(never.kv.local_k)).sum() > 0  # something was written


def _same_pages(a, b, **tol):
    """Every pool equal, page 0 (scratch: padding and masked-out slots write there) aside."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x)[:, 1:], np.asarray(y)[:, 1:], **tol)


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


def test_recompute_mixed_rows_match_the_full_model_upper_layers(ee):
    """Recompute later: each row's tokens are the dense reference in which exited positions still
    run the upper layers (their K/V are the full model's), whatever mix of pending counts the rows
    of a compacted stage carry."""
    thr = float(np.median(_first_confidences(ee, PROMPTS)))
    run = ee.run(PROMPTS, N, threshold=thr, kv_fill="recompute")
    lr = run.layers_run[:, 1:]
    assert any((col < ee.cfg.n_layers).any() and (col == ee.cfg.n_layers).any() for col in lr.T)
    assert run.caught_up > 0
    _check_rows(ee, run, PROMPTS, propagated=False)
    prop = ee.run(PROMPTS, N, threshold=thr)  # the same threshold with propagation decodes otherwise
    assert prop.tokens.tolist() != run.tokens.tolist()


def test_recompute_catch_up_writes_the_full_models_kv(ee):
    """Steps where every row exits, then full steps (teacher-forced, so both runs see the same
    tokens): the catch-up leaves every K/V slot as a full forward writes it, and the next full
    step scores as the full model. Propagation's pages differ. A row with max_pending positions
    pending may not exit (forced full step)."""
    feed = ee.run(PROMPTS, N, plain=True).tokens
    thr = [NEVER] + [0.0] * 3 + [NEVER] * 2 + [0.0] * 5 + [NEVER]  # 3 exit, catch up; 5 exit: 4, forced
    full = ee.run(PROMPTS, N, NEVER, feed=feed)
    rc = ee.run(PROMPTS, N, thr, feed=feed, kv_fill="recompute")
    L, k = ee.cfg.n_layers, ee.exits[0]
    assert rc.layers_run[0].tolist() == [L, k, k, k, L, L, k, k, k, k, L, L]  # step 10: forced
    assert (rc.layers_run == rc.layers_run[0]).all()
    assert rc.caught_up == 4 * (3 + 4) and rc.forced == 4
    _same_pages(rc.kv, full.kv, rtol=1e-4, atol=1e-5)
    done = rc.layers_run == L
    done[:, :5] = False  # the full steps after a catch-up (steps 5, 10 and 11: their logprobs)
    np.testing.assert_allclose(rc.logprob[done], full.logprob[done], rtol=1e-4, atol=1e-4)
    pr = ee.run(PROMPTS, N, thr, feed=feed)
    with pytest.raises(AssertionError):
        _same_pages(pr.kv, full.kv, rtol=1e-4, atol=1e-5)
    assert np.abs(pr.logprob[:, -1] - full.logprob[:, -1]).max() > 1e-3


def test_recompute_pending_positions_stay_out_of_the_pages_until_caught_up(ee):
    """While a row pends, its upper layers' slots at the pending positions are not written: the
    pages there still hold what they held (zeros in a fresh pool); the lower layers are written."""
    rc = ee.run(PROMPTS[:1], 4, threshold=0.0, kv_fill="recompute")  # decode steps 1-3 all exit
    cfg, k = ee.cfg, ee.exits[0]
    assert rc.layers_run[0, 1:].tolist() == [k, k, k]
    gtab, ltab = rc.tables
    ps, p = ee.page_size, len(PROMPTS[0]) + 1  # the second decoded position: pending
    for layer in range(cfg.n_layers):
        kind, idx = kind_index(cfg, layer)
        pool, page = ((rc.kv.global_k, gtab[0, p // ps]) if kind == "global"
                      else (rc.kv.local_k, ltab[0, (p // ps) % ltab.shape[1]]))
        written = np.abs(np.asarray(pool[idx, page, p % ps])).sum() > 0
        assert written == (layer < k), layer


def _first_confidences(ee, prompts):
    """Confidences of the first adapter over the first decode step of each prompt."""
    st, first = ee._prefill(prompts, N)
    from engine.memory.kv import Batch

    top = ee.tops[0]
    B = len(prompts)
    batch = Batch(first[:, None].astype(np.int32), st.start, st.n_new, st.gtab, st.ltab)
    k, z = ee.exits[0], np.zeros(B, np.int32)
    bm = jnp.zeros((ee.cfg.n_layers, B, st.width), bool)
    out = stage(ee.cfg, st.ring, 0, k, ee.confidence, False, ee.params["layers"][:k], top, st.kv, batch,
                None, st.start[:, None], z[:, None], z, st.bk, st.bv, bm, np.full(B, B, np.int32), z)
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
    # Recompute later: every segment bucket (1 + 0, 1, 2, 4 pending) and window the runs reach.
    e.warm(3, 4, 12, kv_fill="recompute")
    before = compile_count()
    sched = [NEVER, 0.0, NEVER, 0.0, 0.0, NEVER, 0.0, 0.0, 0.0, 0.0, 0.0, NEVER]  # 1, 2, then 4 + forced
    runs = [e.run(prompts, 12, threshold=thr, kv_fill="recompute") for thr in (sched, mid, 0.0, NEVER)]
    assert compile_count() == before
    assert runs[0].caught_up == 3 * (1 + 2 + 4) and runs[0].forced == 3
    assert runs[1].caught_up > 0


def test_bad_exit_points_are_refused(tiny):
    cfg, params = tiny
    heads = DraftHeads.random(cfg, 0, (3,), 64)
    for exits in ((), (4,), (3, 3)):
        with pytest.raises(ValueError, match="exit points"):
            EarlyExit(cfg, params, heads, exits=exits)
    with pytest.raises(ValueError, match="confidence"):
        EarlyExit(cfg, params, heads, exits=(3,), confidence="entropy")
    with pytest.raises(ValueError, match="max_pending"):
        EarlyExit(cfg, params, heads, exits=(3,), max_pending=3)
    with pytest.raises(ValueError, match="kv_fill"):
        EarlyExit(cfg, params, heads, exits=(3,)).run(PROMPTS, 3, kv_fill="later")
