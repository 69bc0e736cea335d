"""The paged, scanned model against an independent dense reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.padded import forward_and_write, padded_call
from engine.execute.runner import ModelRunner, RunnerConfig
from engine.memory.kv import Batch
from engine.types import SamplingParams
from tests.engine.conftest import TINY_RC, ByteTokenizer, make_engine, run_requests
from tests.engine.reference import dense_logits


def _paged_logits(runner: ModelRunner, tokens: list[int], chunks: list[int], pages, ring):
    """Feed `tokens` in chunks through the paged runner; logits of every position."""
    out, pos = [], 0
    for n in chunks:
        c = padded_call(runner.rc, 1, n)
        T = c.tokens.shape[1]
        c.tokens[0, :n] = tokens[pos : pos + n]
        c.start[0], c.n_new[0] = pos, n
        c.global_table[0, : len(pages)] = pages[: c.global_table.shape[1]]
        c.local_table[0, :] = ring[: c.local_table.shape[1]]
        idx = np.minimum(np.arange(T), n - 1)[None, :].astype(np.int32)
        batch = Batch(c.tokens, c.start, c.n_new, c.global_table, c.local_table)
        runner.kv, sc, _ = forward_and_write(runner.cfg, runner.rc.ring_pages, runner.params, runner.kv,
                                             batch, idx)
        out.append(np.asarray(sc.logits)[0, :n])
        pos += n
    return np.concatenate(out)


def test_paged_attention_equals_dense_reference_past_the_window(tiny):
    cfg, params = tiny
    runner = ModelRunner(cfg, params, dataclasses.replace(TINY_RC, fast_output=False))  # exact logits
    rng = np.random.default_rng(1)
    n = 50  # window is 8, ring holds 24 positions: pages are recycled many times
    tokens = [int(t) for t in rng.integers(3, cfg.vocab_size, n)]
    assert n > TINY_RC.ring_pages * TINY_RC.page_size > cfg.sliding_window
    chunks = [16, 9, 3] + [1] * (n - 28)
    got = _paged_logits(runner, tokens, chunks, list(range(1, 14)), list(range(1, 7)))
    want = dense_logits(cfg, params, tokens)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_dense_reference_differs_without_the_window(tiny):
    """Guards the test above: the window really changes the logits here."""
    cfg, params = tiny
    tokens = list(np.random.default_rng(1).integers(3, cfg.vocab_size, 30))
    a = dense_logits(cfg, params, tokens)
    b = dense_logits(cfg.replace(sliding_window=4096), params, tokens)
    assert np.abs(a[-1] - b[-1]).max() > 1e-3
    np.testing.assert_allclose(a[:8], b[:8], atol=1e-9)


def _greedy(engine, prompts, max_tokens=12):
    return run_requests(engine, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]


def test_mixed_length_batch_equals_each_sequence_alone(tiny):
    tok = ByteTokenizer()
    prompts = [tok.encode(s)
               for s in ("a", "hello there", "x" * 30, "the quick brown fox " * 3, "ok?", "z" * 9)]
    together = _greedy(make_engine(tiny), prompts)
    alone = [_greedy(make_engine(tiny), [p])[0] for p in prompts]
    assert together == alone
    assert all(len(t) == 12 for t in together)
    assert len({tuple(t) for t in together}) > 1


@pytest.mark.parametrize("chunk_budget", [4, 16])
def test_chunked_prefill_gives_the_same_tokens(tiny, chunk_budget):
    tok = ByteTokenizer()
    prompt = tok.encode("a long prompt that needs several prefill chunks " * 2)
    ref = _greedy(make_engine(tiny), [prompt])[0]
    e = make_engine(tiny)
    e.scheduler.cfg = type(e.scheduler.cfg)(max_batch=8, token_budget=8, max_chunk=chunk_budget)
    assert _greedy(e, [prompt])[0] == ref


def test_fast_output_rescores_the_top_candidates_exactly():
    """bfloat16 scoring of the vocabulary, float32 for each row's top 16: the greedy token
    and the top logits are the float32 ones; the tail is off by bfloat16 rounding only."""
    from engine.execute.runner import RESCORE, output_scores
    from engine.execute.sampling import TOP_BLOCK
    from engine.model.gemma import logits

    rng = np.random.default_rng(0)
    embed = jnp.asarray(rng.normal(size=(64 * TOP_BLOCK, 64)).astype(np.float32))  # blocked top-k
    params = {"embed": embed, "embed_fast": embed.astype(jnp.bfloat16)}
    hs = jnp.asarray(rng.normal(size=(4, 3, 64)).astype(np.float32))
    sc, exact = jax.jit(output_scores)(params, hs), np.asarray(logits(params, hs))
    fast = np.asarray(sc.logits)
    np.testing.assert_array_equal(np.asarray(sc.best), exact.argmax(-1))
    assert (fast.argmax(-1) == exact.argmax(-1)).all()
    top = np.argsort(-exact, axis=-1)[..., :4]
    np.testing.assert_allclose(np.take_along_axis(fast, top, -1), np.take_along_axis(exact, top, -1),
                               rtol=1e-5)
    assert 0 < np.abs(fast - exact).max() < 0.05 * np.abs(exact).max()  # the tail really is bfloat16
    few = hs[:1, :1]  # under FAST_OUTPUT_MIN_ROWS rows: plain float32
    plain = output_scores(params, few)
    np.testing.assert_array_equal(np.asarray(plain.logits), np.asarray(logits(params, few)))
    assert int(plain.best[0, 0]) == int(exact[0, 0].argmax())
    assert RESCORE >= 4


@pytest.mark.parametrize("rows", [1, 3, 64, 65])
def test_tied_logits_equal_the_plain_product_in_either_orientation(rows):
    """Up to FEW_ROWS rows the table is the product's left operand; past it the rows are."""
    from engine.model.gemma import FEW_ROWS, tied_logits

    rng = np.random.default_rng(rows)
    table = rng.normal(size=(300, 16)).astype(np.float32)
    h = rng.normal(size=(rows, 1, 16)).astype(np.float32)
    got = np.asarray(jax.jit(tied_logits)(jnp.asarray(table), jnp.asarray(h)))
    assert got.shape == (rows, 1, 300) and (rows > FEW_ROWS) == (rows == 65)
    np.testing.assert_allclose(got, h @ table.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags, has", [("fpu sse avx2 fma", False), ("avx2 avx512f avx512_bf16", True),
                                        ("avx2 amx_bf16 amx_tile", True)])
def test_the_bfloat16_output_table_is_kept_only_where_the_cpu_has_bfloat16_units(monkeypatch, flags, has):
    from pathlib import Path

    from engine.loader import cpu_has_bf16

    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: f"processor : 0\nflags : {flags}\n")
    assert cpu_has_bf16() is has


def test_a_batch_one_runner_that_verifies_keeps_the_fast_output_table(tiny):
    """Verification scores 1 + depth rows even when the runner never batches two sequences."""
    cfg, params = tiny
    single = dict(TINY_RC.__dict__, max_batch=1, fast_output=True)
    assert "embed_fast" not in ModelRunner(cfg, params, RunnerConfig(**single)).params
    verifying = RunnerConfig(**{**single, "verify_tokens": (2, 3), "spec_max_batch": 1})
    assert ModelRunner(cfg, params, verifying).params["embed_fast"].dtype == jnp.bfloat16


def test_the_heads_call_takes_the_output_tables_alone(tiny):
    """ModelRunner.out_params (what the ragged heads call gets) holds every table output_scores
    reads, the bfloat16 copy too where kept, and none of the layers' weights."""
    cfg, params = tiny
    for fast in (False, True):
        runner = ModelRunner(cfg, params, RunnerConfig(**dict(TINY_RC.__dict__, fast_output=fast)))
        assert set(runner.out_params) == {"embed"} | ({"embed_fast"} if fast else set())
        for name, table in runner.out_params.items():
            assert table is runner.params[name]


@pytest.mark.parametrize("ring", [0, 48])
def test_block_attention_over_real_pages_equals_one_softmax_over_the_gathered_cache(ring, monkeypatch):
    """Rows of very different cached lengths (0, 5, 70 slots of a 96-slot table) in one call:
    attention read ATTEND_BLOCK slots at a time with a running softmax equals one softmax over
    every slot gathered, for a global table and a sliding-window ring, with hidden positions."""
    from engine.config import ModelConfig
    from engine.model import gemma

    monkeypatch.setattr(gemma, "ATTEND_BLOCK", 32)  # several blocks: 70 cached slots read as 3
    cfg = ModelConfig(n_heads=4, n_kv_heads=2, head_dim=8, sliding_window=40)
    rng = np.random.default_rng(0)
    ps, pages, B, T = 8, 40, 3, 2
    width = 6 if ring else 12  # a ring's table is at most the ring
    k = jnp.asarray(rng.standard_normal((2, pages, ps, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, pages, ps, 2, 8)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[: B * width].reshape(B, width), jnp.int32)
    last = jnp.asarray([-1, 4, 69], jnp.int32)
    q_pos = last[:, None] + 1 + jnp.arange(T)[None, :]
    q = jnp.asarray(rng.standard_normal((B, T, 4, 8)), jnp.float32)
    kn, vn = (jnp.asarray(rng.standard_normal((B, T, 2, 8)), jnp.float32) for _ in range(2))
    hidden = jnp.asarray([[-1], [3], [60]], jnp.int32)
    paged = gemma.PagedView(k, v, 1, table, last, ring=ring, hidden=hidden)
    slots = jnp.arange(width * ps, dtype=jnp.int32)
    gathered = gemma.KVView(k[1, table].reshape(B, -1, 2, 8), v[1, table].reshape(B, -1, 2, 8),
                            paged.slot_positions(slots))
    assert int(paged.slots_to_read()) == (48 if ring else 70)
    for window in (None, cfg.sliding_window):
        got = gemma.attend(cfg, q, kn, vn, q_pos, paged, window)
        want = gemma.attend(cfg, q, kn, vn, q_pos, gathered, window)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # the hidden position is unread: showing it changes the row that held it
    shown = gemma.attend(cfg, q, kn, vn, q_pos, dataclasses.replace(paged, hidden=None), None)
    assert not np.allclose(np.asarray(shown)[2], np.asarray(got)[2])
