"""The ragged forward (engine/model/ragged.py) against the dense reference: rows of every kind in one
call (decode, verify-sized, prefill chunks with and without a cache), across several calls that
fill the cache past the sliding window so the local rings wrap."""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import pytest

from engine.memory.kv import KVState
from engine.model import ragged
from engine.model.gemma import logits, unstack_layers
from tests.engine.reference import dense_logits

PAGE, RING, BLOCK = 4, 6, 8  # ring of 24 slots >= window 8 + verify; reads of 2 pages an item
N_TOKENS, N_ROWS, WIDTH = 32, 4, 16  # 16 pages: 64 positions a row


@partial(jax.jit, static_argnames=("cfg", "chunk"))
def _call(cfg, params, kv, rb, chunk=ragged.CHUNK):
    h, new_kv, _ = ragged.forward(cfg, params, kv, rb, block=BLOCK, chunk=chunk)
    return logits(params, h), ragged.write(kv, rb, new_kv)


def _steps():
    """Per call, per row: new tokens. Row 0 decodes from the second call on; row 1 prefills in
    chunks of up to 12 (two query groups); row 2 verifies 2-9 tokens; row 3 joins late."""
    return [
        {0: 5, 1: 12, 2: 1, 3: 0},
        {0: 1, 1: 7, 2: 4, 3: 9},
        {0: 1, 1: 12, 2: 9, 3: 1},
        {0: 1, 1: 1, 2: 2, 3: 8},
        {0: 1, 1: 9, 2: 9, 3: 1},
        {0: 1, 1: 1, 2: 5, 3: 12},
    ]


@pytest.mark.parametrize("chunk", [ragged.CHUNK, 1, 3])
def test_every_token_of_mixed_calls_equals_the_dense_model(tiny, chunk):
    """Chunks of 1 and 3 query groups: groups read in several passes, each as far as its own
    chunk's longest cache (rows of different lengths in one chunk with 3)."""
    cfg, params = tiny
    params = unstack_layers(params)
    rng = np.random.default_rng(0)
    kv = KVState.create(cfg, 1 + N_ROWS * WIDTH, 1 + N_ROWS * RING, PAGE, np.float32)
    gpages = {r: list(range(1 + r * WIDTH, 1 + (r + 1) * WIDTH)) for r in range(N_ROWS)}
    ring = {r: list(range(1 + r * RING, 1 + (r + 1) * RING)) for r in range(N_ROWS)}
    seqs = {r: [] for r in range(N_ROWS)}
    wrapped = False
    for step in _steps():
        rows, order = [], []
        for r, n in step.items():
            if n == 0:
                continue
            new = rng.integers(3, cfg.vocab_size, n).tolist()
            rows.append((new, len(seqs[r]), gpages[r], ring[r]))
            order.append(r)
        rb = ragged.RaggedBatch.build(rows, N_TOKENS, N_ROWS, WIDTH, RING)
        got, kv = _call(cfg, params, kv, jax.tree.map(np.asarray, rb), chunk)
        got = np.asarray(got)
        at = 0
        for (new, start, _, _), r in zip(rows, order):
            seqs[r] += new
            want = dense_logits(cfg, tiny[1], seqs[r])[start:]
            np.testing.assert_allclose(got[at: at + len(new)], want, rtol=2e-4, atol=2e-4,
                                       err_msg=f"row {r} at positions {start}..{len(seqs[r]) - 1}")
            at += len(new)
        assert (np.asarray(rb.pos)[at:] == -1).all()
        wrapped |= max(len(s) for s in seqs.values()) > RING * PAGE
    assert wrapped  # some ring wrapped, so local layers read overwritten slots correctly


def test_one_executable_serves_every_mix_of_rows(tiny):
    """Calls of other row mixes at the same token count reuse the compiled forward."""
    cfg, params = tiny
    params = unstack_layers(params)
    kv = KVState.create(cfg, 1 + N_ROWS * WIDTH, 1 + N_ROWS * RING, PAGE, np.float32)
    g = [list(range(1 + r * WIDTH, 1 + (r + 1) * WIDTH)) for r in range(N_ROWS)]
    ring = [list(range(1 + r * RING, 1 + (r + 1) * RING)) for r in range(N_ROWS)]
    mixes = [[(list(range(3, 23)), 0, g[0], ring[0])],
             [([5], 20, g[0], ring[0]), ([6, 7, 8], 0, g[1], ring[1])],
             [([5], 21, g[0], ring[0]), ([9] * 9, 3, g[1], ring[1]), ([4], 0, g[2], ring[2]),
              ([4] * 2, 0, g[3], ring[3])]]
    sizes = []
    for rows in mixes:
        _, kv = _call(cfg, params, kv, jax.tree.map(np.asarray, ragged.RaggedBatch.build(
            rows, N_TOKENS, N_ROWS, WIDTH, RING)))
        sizes.append(_call._cache_size())
    assert sizes[0] >= 1 and sizes == [sizes[0]] * len(mixes)


@pytest.mark.parametrize("rows,message", [
    ([([1] * 33, 0, [1], [1])], "33 tokens exceed"),
    ([([1], 0, [1], [1])] * 5, "5 rows exceed"),
    ([([], 0, [1], [1])], "no new token"),
    ([([1], 0, list(range(1, 18)), [1])], "more pages"),
])
def test_build_refuses_what_the_call_cannot_hold(rows, message):
    with pytest.raises(ValueError, match=message):
        ragged.RaggedBatch.build(rows, N_TOKENS, N_ROWS, WIDTH, RING)


def test_new_keys_go_to_the_ring_pages_written_not_those_read(tiny):
    """A row whose ring entry got a new page on wrap (engine.memory.kv.KVPool.prepare) reads the old
    page and writes its new keys to the new one."""
    cfg, params = tiny
    params = unstack_layers(params)
    kv = KVState.create(cfg, 1 + WIDTH, 1 + 2 * RING, PAGE, np.float32)
    read, written = list(range(1, 1 + RING)), list(range(1 + RING, 1 + 2 * RING))
    rb = jax.tree.map(np.asarray, ragged.RaggedBatch.build(
        [([7, 8, 9], 0, list(range(1, 1 + WIDTH)), read, written)], N_TOKENS, N_ROWS, WIDTH, RING))
    _, kv = _call(cfg, params, kv, rb)
    local = np.asarray(kv.local_k)  # [layers, pages, page, KV, hd]
    assert np.abs(local[:, written[0], :3]).sum() > 0  # positions 0-2: the first entry's page written
    assert np.abs(local[:, read]).sum() == 0
    with pytest.raises(ValueError, match="writes 2 ring pages but reads 6"):
        ragged.RaggedBatch.build([([1], 0, [1], read, written[:2])], N_TOKENS, N_ROWS, WIDTH, RING)
