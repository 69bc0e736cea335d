"""Ragged calls on a ModelRunner (engine/ragged_calls.py: the engine/ragged.py forward, then the
output layer and sampling apart at the rows' output tokens) against its padded calls on the same
rows: prefill chunks, decode, verification and sampling mixed in one call give the tokens,
acceptances, logprobs, hidden states and top logprobs the padded calls give one kind at a time."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.ragged_calls import TOKEN_BUCKETS, RaggedRow, new_call, run, top_in
from engine.runner import ModelRunner
from tests.engine.conftest import TINY_RC
from tests.engine.reference import dense_logits

# float32 logits (no bfloat16 output pass), so logprobs compare to 1e-4; verify shapes for the padded runner
RC = replace(TINY_RC, fast_output=False, verify_tokens=(2, 3, 5), spec_max_batch=1)
WIDTH = RC.max_context // RC.page_size
RING = RC.ring_pages


def _pages(i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(range(1 + i * WIDTH, 1 + (i + 1) * WIDTH)), tuple(range(1 + i * RING, 1 + (i + 1) * RING))


def _sampling(samp: dict, at, temperature: float, seed: int) -> None:
    samp["temperature"][at] = temperature
    samp["key"][at] = (0, seed)
    samp["want_logprobs"][at] = True


def _padded(runner: ModelRunner, row: RaggedRow, temperature: float, seed: int):
    """The row run alone by the padded runner: (tokens, accepted or None, logprobs, hidden, top
    logprobs) at its outputs."""
    n = len(row.tokens)
    if row.cand:
        c = runner.new_verify_call(1, n - 1, row.start + n)
    else:
        c = runner.new_call(1, n, row.start + n)
        c.logit_idx[0, 0] = n - 1
    c.tokens[0, :n] = row.tokens
    c.start[0], c.n_new[0] = row.start, n
    c.global_table[0, :] = row.global_pages[: c.global_table.shape[1]]
    c.local_table[0, :] = row.ring[: c.local_table.shape[1]]
    c.local_write[0, :] = row.ring[: c.local_write.shape[1]]
    k = c.logit_idx.shape[1]
    c.counter[0] = row.start + n - k + 1 + np.arange(k)
    _sampling(c.samp, 0, temperature, seed)
    if row.cand:
        cand = np.full((1, k), -1, np.int32)
        cand[0, : len(row.cand)] = row.cand
        tok, acc, lp = runner.run_verify(c, cand)
        return tok[0, :n], acc[0, :n], lp[0, :n], np.asarray(runner.last_hidden)[0, :n], runner.top_at(0, n)
    tok, lp = runner.run(c)
    return tok[0], None, lp[0], np.asarray(runner.last_hidden)[0], runner.top_at(0, 1)


def _greedy_after(cfg, params, tokens: list[int], n: int) -> list[int]:
    """The dense reference's n greedy tokens after `tokens`."""
    out = list(tokens)
    for _ in range(n):
        out.append(int(np.argmax(dense_logits(cfg, params, out)[-1])))
    return out[len(tokens):]


def test_a_mixed_ragged_call_equals_the_padded_calls_row_by_row(tiny):
    cfg, params = tiny
    ragged_runner, padded_runner = ModelRunner(cfg, params, RC), ModelRunner(cfg, params, RC)
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
            want.append(_padded(padded_runner, row, temps[r], seed=r))
        call = new_call(ragged_runner, rows)
        for r, sl in zip(step, call.out_rows):
            _sampling(call.samp, sl, temps[r], seed=r)
        tok, acc, lp = run(ragged_runner, call)
        hidden = np.asarray(ragged_runner.last_hidden)
        n = sum(len(r.tokens) for r in rows)
        assert call.batch.tokens.shape[0] == min(b for b in TOKEN_BUCKETS if b >= n)
        for r, row, sl, (wtok, wacc, wlp, wh, wtop) in zip(step, rows, call.out_rows, want):
            k = sl.stop - sl.start
            np.testing.assert_array_equal(tok[sl], np.atleast_1d(wtok)[-k:], err_msg=f"row {r}")
            np.testing.assert_allclose(lp[sl], np.atleast_1d(wlp)[-k:], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(hidden[sl], np.atleast_2d(wh)[-k:], rtol=1e-4, atol=1e-4)
            top = top_in(ragged_runner, sl)
            assert [[t for t, _ in pos] for pos in top] == [[t for t, _ in pos] for pos in wtop[-k:]]
            lps = lambda tops: [[x for _, x in pos] for pos in tops]  # noqa: E731
            np.testing.assert_allclose(lps(top), lps(wtop[-k:]), rtol=1e-4, atol=1e-4)
            if row.cand:
                np.testing.assert_array_equal(acc[sl], wacc[-k:])
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
