"""Host side of the logit adjustments: repetition, presence and frequency penalties and
min_tokens' ban on stop ids, written as sparse entries for `engine.execute.sampling.Adjust`.

An entry is (token id, scale, add): the token's logit x becomes x / scale if x > 0
else x * scale (the repetition penalty), then + add (minus the presence and
frequency penalties; -inf bans the token). engine.execute.sampling.adjust_logits applies
them before any sampling, greedy included, in plain decode and in verification
alike. Position j of a verify row counts the drafts before it as output, so each
draft is checked against the distribution plain decoding would have drawn it from.

    >>> from engine.types import SamplingParams
    >>> sp = SamplingParams(max_tokens=8, presence_penalty=0.5, frequency_penalty=0.25, min_tokens=2)
    >>> entries(sp, prompt=[5, 6], output=[6, 6], stop_ids=frozenset({1}))
    {6: (1.0, -1.0)}
    >>> entries(sp, prompt=[5, 6], output=[6], stop_ids=frozenset({1}))
    {6: (1.0, -0.75), 1: (1.0, -inf)}
    >>> entries(SamplingParams(repetition_penalty=1.5), [5, 6], [6], frozenset({1}))
    {5: (1.5, 0.0), 6: (1.5, 0.0)}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq

import numpy as np

from engine.types import SamplingParams

BANNED = float("-inf")
"""The additive term that removes a token."""
SPARE_ENTRIES = 64
"""Entries per position beyond the context's distinct tokens: room for the banned stop ids."""


def wants_adjust(sp: SamplingParams, n_output: int) -> bool:
    """Whether `sp` changes the logits after `n_output` output tokens (most requests never do
    and skip this path; min_tokens alone stops once it is met)."""
    return (sp.min_tokens > n_output or sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
            or sp.repetition_penalty != 1.0)


def entries(sp: SamplingParams, prompt: Seq[int], output: Seq[int],
            stop_ids: frozenset[int]) -> dict[int, tuple[float, float]]:
    """token id -> (scale, add) for the position that follows `prompt` + `output`: the rules
    in plain Python (fill_adjust computes the same entries with numpy)."""
    out: dict[int, tuple[float, float]] = {}
    if sp.repetition_penalty != 1.0:
        out = dict.fromkeys(sorted(set(prompt).union(output)), (float(sp.repetition_penalty), 0.0))
    if sp.presence_penalty or sp.frequency_penalty:
        for t, n in Counter(output).items():
            out[t] = (out.get(t, (1.0, 0.0))[0], -sp.frequency_penalty * n - sp.presence_penalty)
    if len(output) < sp.min_tokens:  # EOS and stop ids may not end the output yet
        for t in sorted(stop_ids):
            out[t] = (1.0, BANNED)
    return out


def fill_adjust(adj: dict[str, np.ndarray], row: int, tokens: list[int], n_prompt: int,
                sp: SamplingParams, stop_ids: frozenset[int], drafts: Seq[int] = ()) -> None:
    """Write the entries of each position of `row` in the host arrays of engine.execute.sampling.Adjust
    ([B, T, H]): position j follows `tokens` and drafts[:j]. Entries that change nothing may
    be written too. ValueError when the entries do not fit in H."""
    T, width = adj["ids"].shape[1:]
    n_pos = min(T, 1 + len(drafts))
    n_out = len(tokens) - n_prompt
    rep = sp.repetition_penalty != 1.0
    pen = sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0
    ban = sp.min_tokens > n_out
    out = np.asarray(list(tokens[n_prompt:]) + list(drafts[: n_pos - 1]), np.int64)
    stops = np.fromiter(stop_ids, np.int64, len(stop_ids))
    parts = ([np.asarray(tokens[:n_prompt], np.int64)] if rep else []) + ([out] if rep or pen else [])
    ids = np.unique(np.concatenate(parts + ([stops] if ban else []) + [np.zeros(0, np.int64)]))
    n = len(ids)
    if n > width:
        raise ValueError(f"{n} logit adjustments exceed the {width} compiled per position")
    seen = np.zeros(n, bool)  # in the prompt (repetition penalty only) or the output so far
    counts = np.zeros(n, np.float64)  # occurrences in the output so far
    if rep:
        seen[np.searchsorted(ids, tokens[:n_prompt])] = True
    if rep or pen:
        np.add.at(counts, np.searchsorted(ids, out[:n_out]), 1.0)
    is_stop = np.isin(ids, stops)
    for j in range(n_pos):
        if j and (rep or pen):
            counts[np.searchsorted(ids, out[n_out + j - 1])] += 1.0
        scale = np.where(seen | (counts > 0), sp.repetition_penalty, 1.0) if rep else np.ones(n)
        add = -sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)
        if n_out + j < sp.min_tokens:
            scale, add = np.where(is_stop, 1.0, scale), np.where(is_stop, BANNED, add)
        adj["ids"][row, j] = -1
        adj["ids"][row, j, :n] = ids
        adj["scale"][row, j, :n] = scale
        adj["add"][row, j, :n] = add
