"""Ragged calls on a ModelRunner (engine/execute/ragged_calls.py: the engine/model/ragged.py forward, then the
output layer and sampling apart at the rows' output tokens): prefill chunks, decode,
verification and sampling mixed in one call give each row the tokens, acceptances, logprobs,
hidden states and top logprobs it gets in a call of its own, and the logprobs, top tokens,
greedy tokens and greedy acceptances are the dense reference model's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.execute.ragged_calls import TOKEN_BUCKETS, RaggedRow, new_call, run, top_in
from engine.execute.runner import ModelRunner
from tests.engine.conftest import TINY_RC
from tests.engine.reference import dense_logits

# float32 logits (no bfloat16 output pass), so logprobs compare to 1e-4
RC = replace(TINY_RC, fast_output=False, verify_tokens=(2, 3, 5), spec_max_batch=1)
WIDTH = RC.max_context // RC.page_size
RING = RC.ring_pages


def _pages(i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(range(1 + i * WIDTH, 1 + (i + 1) * WIDTH)), tuple(range(1 + i * RING, 1 + (i + 1) * RING))


def _sampling(samp: dict, at, temperature: float, seed: int) -> None:
    samp["temperature"][at] = temperature
    samp["key"][at] = (0, seed)
    samp["want_logprobs"][at] = True


def _alone(runner: ModelRunner, row: RaggedRow, temperature: float, seed: int):
    """The row run in a ragged call of its own: (tokens, accepted, logprobs, hidden, top
    logprobs) at its outputs."""
    call = new_call(runner, [row])
    sl = call.out_rows[0]
    _sampling(call.samp, sl, temperature, seed)
    tok, acc, lp = run(runner, call)
    return tok[sl], acc[sl], lp[sl], np.asarray(runner.last_hidden)[sl], top_in(runner, sl)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _greedy_after(cfg, params, tokens: list[int], n: int) -> list[int]:
    """The dense reference's n greedy tokens after `tokens`."""
    out = list(tokens)
    for _ in range(n):
        out.append(int(np.argmax(dense_logits(cfg, params, out)[-1])))
    return out[len(tokens):]


def test_a_mixed_ragged_call_equals_each_row_alone_and_the_dense_model(tiny):
    cfg, params = tiny
    ragged_runner, alone_runner = ModelRunner(cfg, params, RC), ModelRunner(cfg, params, RC)
    rng = np.random.default_rng(1)
    seq = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (10, 7, 13)]
    temps = [0.0, 0.0, 0.9]  # row 2 samples: the same key and position draw the same token
    steps = [  # per step, per row: "prefill" (new tokens to feed), "decode", or drafts "good"/"bad" x depth
        {0: ("prefill", 10), 1: ("prefill", 7), 2: ("prefill", 9)},
        {0: ("decode",), 1: ("good", 2), 2: ("prefill", 4)},
        {0: ("bad", 3), 1: ("decode",), 2: ("good", 1)},
        {0: ("good", 4), 1: ("bad", 1), 2: ("decode",)},
    ]
    cached = [0, 0, 0]
    accepted = 0
    for step in steps:
        rows, want = [], []
        for r, (kind, *n) in step.items():
            cand: tuple[int, ...] = ()
            if kind == "prefill":
                toks = seq[r][cached[r]: cached[r] + n[0]]
            else:
                toks = [seq[r][-1]]
                if kind != "decode":
                    cand = tuple(_greedy_after(cfg, params, seq[r], n[0]))
                    if kind == "bad":
                        cand = (cand[0] + 1,) + cand[1:]
            g, ring = _pages(r)
            row = RaggedRow(tuple(toks) + cand, cached[r], g, ring, outputs=1 + len(cand), cand=cand)
            rows.append(row)
            want.append(_alone(alone_runner, row, temps[r], seed=r))
        call = new_call(ragged_runner, rows)
        for r, sl in zip(step, call.out_rows):
            _sampling(call.samp, sl, temps[r], seed=r)
        tok, acc, lp = run(ragged_runner, call)
        hidden = np.asarray(ragged_runner.last_hidden)
        n = sum(len(r.tokens) for r in rows)
        assert call.batch.tokens.shape[0] == min(b for b in TOKEN_BUCKETS if b >= n)
        for r, row, sl, (wtok, wacc, wlp, wh, wtop) in zip(step, rows, call.out_rows, want):
            k = sl.stop - sl.start
            np.testing.assert_array_equal(tok[sl], wtok, err_msg=f"row {r}")
            np.testing.assert_array_equal(acc[sl], wacc)
            np.testing.assert_allclose(lp[sl], wlp, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(hidden[sl], wh, rtol=1e-4, atol=1e-4)
            top = top_in(ragged_runner, sl)
            assert [[t for t, _ in pos] for pos in top] == [[t for t, _ in pos] for pos in wtop]
            lps = lambda tops: [[x for _, x in pos] for pos in tops]
            np.testing.assert_allclose(lps(top), lps(wtop), rtol=1e-4, atol=1e-4)
            fed = seq[r][: row.start] + list(row.tokens)  # what the forward saw, drafts included
            ref = _log_softmax(dense_logits(cfg, params, fed)[len(fed) - k:])  # [k, V] at the outputs
            np.testing.assert_allclose(lp[sl], ref[np.arange(k), tok[sl]], atol=1e-4)
            assert [[t for t, _ in pos] for pos in top] == [list(np.argsort(-x)[: len(top[0])]) for x in ref]
            if temps[r] == 0:  # greedy: the argmax, and a draft accepted where it is that
                best = ref.argmax(axis=-1)
                np.testing.assert_array_equal(tok[sl], best)
                np.testing.assert_array_equal(acc[sl][: len(row.cand)],
                                              np.asarray(row.cand) == best[: len(row.cand)])
            if row.cand:
                n_ok = int(np.cumprod(acc[sl][: len(row.cand)]).sum())
                accepted += n_ok
                seq[r] += list(row.cand[:n_ok]) + [int(tok[sl][n_ok])]
                cached[r] += 1 + n_ok
            else:
                assert not acc[sl].any()
                cached[r] += len(row.tokens)
                if cached[r] == len(seq[r]):  # the prompt is in: its last logits give the next token
                    seq[r].append(int(tok[sl][0]))
    assert accepted >= 4  # the greedy rows' good drafts were accepted


@pytest.mark.parametrize("rows,message", [
    ([RaggedRow((1, 2), 0, (1,), (1,), outputs=3)], "asks 3 outputs"),
    ([RaggedRow((1, 2), 0, (1,), (1,), outputs=1, cand=(5, 6))], "checking 2 drafts"),
    ([RaggedRow((1,) * 513, 0, (1,), (1,))], "exceeds the largest bucket"),
])
def test_a_ragged_call_refuses_rows_it_cannot_hold(tiny, rows, message):
    cfg, params = tiny
    with pytest.raises(ValueError, match=message):
        new_call(ModelRunner(cfg, params, RC), rows)
