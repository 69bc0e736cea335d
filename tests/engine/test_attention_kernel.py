"""The ragged attention kernel (engine/kernels/attention.py) against the jnp `ragged.attend` it
replaces on CPU and a plain numpy reference: global and sliding layers, rings that wrap, decode,
verify and prefill rows with padding in one call, grouped-query heads; the switch that turns
it off; the tiny model's greedy tokens with it on and off."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.kernels import attention as ak
from engine.memory.kv import KVState
from engine.model import ragged
from engine.model.gemma import logits, unstack_layers
from tests.engine.kernel_checks import check_missing_compiler, check_switched_off
from tests.engine.tiny import tiny_config

needs_kernel = pytest.mark.skipif(not ak.kernel_available(), reason=f"no kernel: {ak.kernel_status()}")

PAGE, RING, WIDTH = 4, 6, 16  # a ring of 24 slots; global tables of 64 positions
N_TOKENS, N_ROWS = 40, 6


ROWS = [(1, 30), (5, 9), (12, 0), (1, 3), (9, 0), (6, 41)]
"""(new tokens, cached) per row: decode rows (one past the ring's 24 slots, one not), a verify
row, rows prefilled from nothing (each over two 8-token segments), a verify row past the ring."""


def _setup(cfg, seed=0, n_tokens=N_TOKENS):
    rng = np.random.default_rng(seed)
    kv = KVState.create(cfg, 1 + N_ROWS * WIDTH, 1 + N_ROWS * RING, PAGE, np.float32)
    kv = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape, np.float32)), kv)
    rows = []
    for r, (n, cached) in enumerate(ROWS):
        gpages = rng.permutation(np.arange(1 + r * WIDTH, 1 + (r + 1) * WIDTH)).tolist()
        ring = rng.permutation(np.arange(1 + r * RING, 1 + (r + 1) * RING)).tolist()
        rows.append(([3] * n, cached, gpages, ring))
    rb = jax.tree.map(jnp.asarray, ragged.RaggedBatch.build(rows, n_tokens, N_ROWS, WIDTH, RING))
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32))
               for s in ((n_tokens, H, hd), (n_tokens, KV, hd), (n_tokens, KV, hd)))
    return q, k, v, rb, kv


@partial(jax.jit, static_argnames=("cfg", "kind", "window", "kernel"))
def _attend(cfg, q, k, v, rb, kv, layer, kind, window, kernel):
    return ragged.attend(cfg, q, k, v, rb, kv, kind, layer, 8, window, kernel=kernel)


def reference(q, k, v, row, pos, cached, table, pool_k, pool_v, layer, scale, window, ring):
    """The kernel's contract, one query and one key at a time, in float64."""
    q, k, v, pool_k, pool_v = (np.asarray(a, np.float64) for a in (q, k, v, pool_k, pool_v))
    N, H, _ = q.shape
    KV, ps, W = k.shape[1], pool_k.shape[2], table.shape[1]
    out = np.zeros_like(q)
    for t in range(N):
        p, r = pos[t], row[t]
        if p < 0:
            continue
        keys = []  # (position, k [KV, hd], v [KV, hd])
        last = cached[r] - 1
        for s in range(min(cached[r], min(ring, W * ps) if ring else W * ps)):
            kp = last - (last - s) % ring if ring else s
            page = table[r, s // ps]
            keys.append((kp, pool_k[layer, page, s % ps], pool_v[layer, page, s % ps]))
        keys += [(pos[u], k[u], v[u]) for u in range(N) if row[u] == r and pos[u] >= 0]
        keys = [(kk, vv) for kp, kk, vv in keys if 0 <= kp <= p and (not window or p - kp < window)]
        for h in range(H):
            g = h // (H // KV)
            s = np.array([q[t, h] @ kk[g] for kk, _ in keys]) * scale
            w = np.exp(s - s.max())
            out[t, h] = sum(wi * vv[g] for wi, (_, vv) in zip(w, keys)) / w.sum()
    return out


CONFIGS = {  # (heads, kv heads, head size): each head group in chunks of 4, 2 and 1 queries
    "gqa-4/2": (4, 2, 16), "gqa-4/1-hd256": (4, 1, 256), "gqa-7/1": (7, 1, 8), "mha-2/2": (2, 2, 24)}


@needs_kernel
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind,window", [("global", None), ("local", 8), ("local", 20)])
def test_kernel_matches_the_jnp_attention(config, kind, window):
    H, KV, hd = CONFIGS[config]
    cfg = tiny_config(n_heads=H, n_kv_heads=KV, head_dim=hd)
    q, k, v, rb, kv = _setup(cfg)
    for layer in range(2):
        want = np.asarray(_attend(cfg, q, k, v, rb, kv, jnp.int32(layer), kind, window, False))
        for isa in ak.supported_isas():
            previous = ak.set_isa(isa)
            try:
                got = np.asarray(_attend(cfg, q, k, v, rb, kv, jnp.int32(layer), kind, window, True))
            finally:
                ak.set_isa(previous)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5, err_msg=f"{isa}, layer {layer}")
    pad = np.asarray(rb.pos) < 0
    assert pad.any() and (got[pad] == 0).all() and (np.abs(got[~pad]).sum(axis=(1, 2)) > 0).all()
    hlo = _attend.lower(cfg, q, k, v, rb, kv, jnp.int32(0), kind, window, True).as_text()
    assert ak.TARGET in hlo and "while" not in hlo  # one custom call, none of the jnp path's loops


@needs_kernel
def test_wrapped_ring_reads_only_the_window():
    """A decode row 41 tokens in, ring 24, window 8: positions 33..40 count, whatever the ring's
    older slots hold (NaN here)."""
    cfg = tiny_config()
    q, k, v, rb, kv = _setup(cfg)
    t = int(np.flatnonzero(np.asarray(rb.row) == 5)[0])  # row 5: 6 new tokens after 41 cached
    assert int(rb.pos[t]) == 41
    ring = np.asarray(rb.local_table)[5]
    slots = np.arange(RING * PAGE)
    held = 40 - (40 - slots) % (RING * PAGE)  # the position each slot holds
    local_k = np.asarray(kv.local_k).copy()
    for s in slots[held < 34]:
        local_k[:, ring[s // PAGE], s % PAGE] = np.nan
    poisoned = KVState(kv.global_k, kv.global_v, jnp.asarray(local_k), kv.local_v)
    got = np.asarray(_attend(cfg, q, k, v, rb, poisoned, jnp.int32(1), "local", 8, True))
    assert np.isfinite(got[t]).all()
    want = np.asarray(_attend(cfg, q, k, v, rb, kv, jnp.int32(1), "local", 8, False))
    np.testing.assert_allclose(got[t], want[t], rtol=2e-5, atol=1e-5)
    wide = np.asarray(_attend(cfg, q, k, v, rb, poisoned, jnp.int32(1), "local", 20, True))
    assert not np.isfinite(wide[t]).all()  # a window of 20 reaches the poisoned slots


@needs_kernel
@pytest.mark.parametrize("ring,window", [(0, 0), (RING * PAGE, 8)])
def test_any_token_order_and_interleaved_positions_match_the_reference(ring, window):
    """Tokens of a row anywhere on the axis, in any order, and new tokens at positions the cache
    also holds (the kernel sorts and merges them): the contract as the numpy reference reads it."""
    rng = np.random.default_rng(5)
    N, S, H, KV, hd = 24, 3, 4, 2, 16
    q, k, v = (rng.standard_normal(s, np.float32) for s in ((N, H, hd), (N, KV, hd), (N, KV, hd)))
    pool_k, pool_v = (rng.standard_normal((2, 1 + S * WIDTH, PAGE, KV, hd), np.float32) for _ in range(2))
    row = rng.integers(0, S, N).astype(np.int32)
    cached = np.array([0, 13, 30], np.int32)
    pos = np.zeros(N, np.int32)
    for r in range(S):  # row 1's new tokens start inside its cache: positions 10, 11, ...
        at = np.flatnonzero(row == r)
        pos[rng.permutation(at)] = (10 if r == 1 else cached[r]) + np.arange(len(at))
    pos[rng.choice(N, 3, replace=False)] = -1
    table = (1 + rng.permutation(S * WIDTH).reshape(S, WIDTH)).astype(np.int32)
    if ring:
        table = table[:, :RING]
    args = (q, k, v, row, pos, cached, table, pool_k, pool_v, 1)
    got = np.asarray(jax.jit(partial(ak.ragged_attention, scale=0.3, window=window, ring=ring))(*args))
    want = reference(*args, 0.3, window, ring)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)


@needs_kernel
def test_threads_agree_and_bad_operands_are_refused():
    cfg = tiny_config(n_kv_heads=1, head_dim=256)  # enough multiply-adds for several threads
    q, k, v, rb, kv = _setup(cfg, n_tokens=64)
    pooled = np.asarray(_attend(cfg, q, k, v, rb, kv, jnp.int32(0), "global", None, True))
    ak.set_threads(1)
    try:
        single = np.asarray(_attend(cfg, q, k, v, rb, kv, jnp.int32(0), "global", None, True))
    finally:
        ak.set_threads(0)
    assert np.array_equal(pooled, single)  # each item's sums run in the same order on any thread
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(_attend(cfg, q, k, v, rb, kv, jnp.int32(2), "global", None, True))
    bad = dataclasses.replace(rb, global_table=rb.global_table.at[0, 0].set(10_000))
    with pytest.raises(Exception, match="page id out of range"):
        np.asarray(_attend(cfg, q, k, v, bad, kv, jnp.int32(0), "global", None, True))


def test_kernel_off_falls_back_to_jnp(monkeypatch, caplog):
    check_switched_off(ak.KERNEL, monkeypatch, caplog)
    cfg = tiny_config()
    q, k, v, rb, kv = _setup(cfg)
    assert not ak.serves(q, k, v, kv.local_k, kv.local_v)
    hlo = jax.jit(partial(ragged.attend, cfg, kind="local", layer=0, block=8, window=8)).lower(
        q, k, v, rb, kv).as_text()
    assert "custom_call" not in hlo and "while" in hlo
    with pytest.raises(RuntimeError, match="not available"):
        ak.ragged_attention(q, k, v, rb.row, rb.pos, rb.cached, rb.local_table, kv.local_k, kv.local_v, 0,
                            scale=0.25, window=8, ring=RING * PAGE)


def test_missing_compiler_falls_back_to_jnp(monkeypatch, caplog, tmp_path):
    check_missing_compiler(ak.KERNEL, monkeypatch, caplog, tmp_path)


@needs_kernel
def test_serves_only_float32_with_whole_vectors_of_head():
    cfg = tiny_config()
    q, k, v, _, kv = _setup(cfg)
    assert ak.serves(q, k, v, kv.local_k, kv.local_v)
    assert not ak.serves(q, k, v, kv.local_k.astype(jnp.bfloat16), kv.local_v.astype(jnp.bfloat16))
    assert not ak.serves(q[:, :, :12], k[:, :, :12], v[:, :, :12], kv.local_k, kv.local_v)  # hd % 8


def _greedy(cfg, params, tokens, kernel):
    """The tiny model's greedy token after every prefix of `tokens`, through ragged calls: the
    first 12 as one prefill call, then one decode call a token (past the 24-slot ring, so local
    layers read wrapped slots); and every call's logits."""
    serves = ak.serves
    ak.serves = serves if kernel else (lambda *a: False)
    ragged._layer.clear_cache()  # its traces chose a path when they were made
    try:
        @jax.jit
        def call(params, kv, rb):
            h, new_kv, _ = ragged.forward(cfg, params, kv, rb, block=8)
            return logits(params, h), ragged.write(kv, rb, new_kv)

        kv = KVState.create(cfg, 1 + WIDTH, 1 + RING, PAGE, np.float32)
        gpages, ring = list(range(1, 1 + WIDTH)), list(range(1, 1 + RING))
        greedy, scores = [], []
        for start, end in [(0, 12)] + [(i, i + 1) for i in range(12, len(tokens))]:
            n = 16 if end - start > 1 else 1
            rb = ragged.RaggedBatch.build([(tokens[start:end], start, gpages, ring)], n, 1, WIDTH, RING)
            lg, kv = call(params, kv, jax.tree.map(jnp.asarray, rb))
            lg = np.asarray(lg)[: end - start]
            greedy += lg.argmax(-1).tolist()
            scores.append(lg)
        hlo = call.lower(params, kv, jax.tree.map(jnp.asarray, rb)).as_text()
    finally:
        ak.serves = serves
        ragged._layer.clear_cache()
    assert (ak.TARGET in hlo) == kernel
    return greedy, np.concatenate(scores)


@needs_kernel
def test_tiny_model_greedy_tokens_are_the_same_with_the_kernel_on_and_off(tiny):
    cfg, params = tiny
    params = unstack_layers(params)
    tokens = np.random.default_rng(7).integers(3, cfg.vocab_size, 32).tolist()
    on, on_scores = _greedy(cfg, params, tokens, kernel=True)
    off, off_scores = _greedy(cfg, params, tokens, kernel=False)
    assert len(tokens) > RING * PAGE
    assert on == off and len(set(on)) > 1
    np.testing.assert_allclose(on_scores, off_scores, rtol=1e-4, atol=1e-4)
