"""Constrained decoding: a request's `Constraint` as a token matcher per sequence (llguidance).

1. `grammar_text(constraint)` turns a constraint (a JSON schema, a regular expression, a
   Lark or GBNF grammar, a list of choices) into llguidance's grammar text and checks it, so
   that a bad one is refused (ConstraintError, naming the request's field) before it reaches
   the engine.
2. `GrammarVocab(tokenizer, n_vocab)` is the vocabulary as the matcher sees it, built once
   per engine: each id's bytes (`tokenizer.token_bytes()`: control pieces start with 0xff,
   so no text can produce them), the ids that end a generation, and the tokenizer's encoder.
3. `Matcher` follows one sequence's output. Before a step, `drafts_allowed` cuts a row's
   drafts to those the grammar takes (a refused draft ends the run: everything after it
   would be verified against a state it never reaches) and `masks` gives the allowed ids
   at each of the row's output positions as int32 words, bit `i % 32` of word `i // 32`
   for id i: position j is what may follow the output plus drafts[:j]. The heads call
   sets every other id's logit to -inf there (engine/execute/sampling.py `apply_mask`),
   so greedy, sampling and the check of drafts all draw from the grammar's tokens, and
   speculation keeps greedy output identical. After the step, `advance` takes each
   token appended; once the grammar can take nothing more the sequence stops ("stop").
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.types import Constraint, ParamError

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How constrained JSON is laid out: `{"a": 1, "b": [2, 3]}`, no other whitespace. With free
whitespace a small model can spend its every token on blanks between two items."""
KINDS = ("json", "regex", "grammar", "choice")
"""Constraint kinds: a JSON schema (its text; "{}" or an object schema for any JSON object),
a regular expression, a Lark or GBNF grammar, a JSON list of strings to choose from."""


class ConstraintError(ParamError):
    """A constraint that cannot be compiled; `param` names the request field that carried it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(param, message[:500], "invalid_grammar")


def _llguidance() -> Any:
    import llguidance  # imported on first use: requests without constraints never load it

    return llguidance


@functools.lru_cache(maxsize=256)
def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for `c`, checked; ConstraintError naming `c.param` when it is not one.
    Cached: the daemon checks a request's constraint when it parses it, and the engine compiles
    the same one again for each choice's matcher.

    >>> grammar_text(Constraint("regex", "[0-9]+", "guided_regex")).startswith("{")
    True
    """
    llg = _llguidance()
    if c.kind not in KINDS:
        raise ConstraintError(c.param, f"unknown constraint kind {c.kind!r} (known: {', '.join(KINDS)})")
    try:
        if c.kind == "json":
            schema = json.loads(c.spec)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            text = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        elif c.kind == "choice":
            choices = json.loads(c.spec)
            if not (isinstance(choices, list) and choices and all(isinstance(x, str) and x for x in choices)):
                raise ValueError("choices must be a non-empty list of non-empty strings")
            text = llg.grammar_from("choice", c.spec)
        else:
            text = llg.grammar_from("regex" if c.kind == "regex" else "grammar", c.spec)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(c.param, f"{c.param}: {exc}") from None
    error = llg.LLMatcher.validate_grammar(text)
    if error:
        raise ConstraintError(c.param, f"{c.param} cannot be compiled: {error.strip().splitlines()[0]}")
    return text


class GrammarTokenizer(Protocol):
    """What a tokenizer gives constrained decoding (engine.model.tokenizer.Tokenizer has it)."""

    bos_id: int
    stop_ids: tuple[int, ...]

    def token_bytes(self) -> list[bytes]: ...

    def encode_plain(self, text: str) -> list[int]: ...


class GrammarVocab:
    """The engine's vocabulary for llguidance (module docstring, 2)."""

    def __init__(self, tokenizer: GrammarTokenizer, n_vocab: int) -> None:
        llg = _llguidance()
        words = list(tokenizer.token_bytes())[:n_vocab]
        words += [b""] * (n_vocab - len(words))  # ids past the tokenizer's (model padding): never text
        stops = [int(i) for i in tokenizer.stop_ids if 0 <= i < n_vocab]
        special = [i for i, w in enumerate(words) if w.startswith(b"\xff")]

        class _Words:  # llguidance.TokenizerWrapper reads these attributes and calls it
            eos_token_id, bos_token_id, tokens, special_token_ids = stops[0], tokenizer.bos_id, words, special

            def __call__(self, text: str | bytes) -> list[int]:
                return tokenizer.encode_plain(text.decode("utf-8", "replace") if isinstance(text, bytes)
                                              else text)

        self.ll = llg.LLTokenizer(llg.TokenizerWrapper(_Words()), n_vocab=n_vocab, eos_token=stops)
        self.n_vocab = n_vocab
        self.words = (n_vocab + 31) // 32
        """int32 words of one position's mask."""

    def matcher(self, c: Constraint) -> Matcher:
        """A new sequence's matcher; ConstraintError when the grammar fails against this vocabulary."""
        m = _llguidance().LLMatcher(self.ll, grammar_text(c), log_level=0)
        if m.is_error():
            raise ConstraintError(c.param, f"{c.param} cannot be compiled: {m.get_error()}")
        return Matcher(m, self)


@dataclass
class Matcher:
    """One sequence's grammar state (module docstring, 3)."""

    m: Any
    """The llguidance LLMatcher, at the sequence's output so far."""
    vocab: GrammarVocab

    def drafts_allowed(self, drafts: list[int]) -> int:
        """How many of `drafts`, from the first, the grammar takes."""
        return int(self.m.validate_tokens(list(drafts))) if drafts else 0

    def masks(self, drafts: list[int]) -> np.ndarray:
        """[1 + len(drafts), words] int32: the allowed ids after the output plus drafts[:j] (every
        draft allowed: `drafts_allowed`)."""
        from llguidance.numpy import fill_next_token_bitmask

        out = np.zeros((1 + len(drafts), self.vocab.words), np.int32)
        taken = 0
        try:
            for j in range(len(drafts) + 1):
                fill_next_token_bitmask(self.m, out, j)
                if j < len(drafts):
                    if not self.m.consume_token(int(drafts[j])):
                        raise ValueError(f"the grammar refused draft {drafts[j]}: {self.m.get_error()}")
                    taken += 1
        finally:
            if taken:
                self.m.rollback(taken)
        return out

    def advance(self, token: int) -> bool:
        """Take one appended token; True when the grammar can take no more (the sequence stops).
        ValueError when the grammar refuses it."""
        if not self.m.consume_token(int(token)):
            raise ValueError(f"the grammar refused token {token}: {self.m.get_error()}")
        return bool(self.m.is_stopped())
