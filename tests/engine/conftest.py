"""Shared fixtures for engine tests: a tiny random model and a byte tokenizer."""

from __future__ import annotations

import random

import jax
import pytest

from engine.execute.runner import RunnerConfig
from engine.step.core import EngineConfig, EngineCore
from tests.engine.tiny import init_random_params, tiny_config


class ByteTokenizer:
    """ids 3..258 are bytes 0..255; 0 pad, 1 eos, 2 bos. Checkable by hand."""

    bos_id, eos_id = 2, 1
    stop_ids = (1,)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([2] if add_bos else []) + [b + 3 for b in text.encode()]

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")

    def encode_plain(self, text: str) -> list[int]:
        return self.encode(text, add_bos=False)

    def token_bytes(self) -> list[bytes]:
        """Constrained decoding's view (engine/grammar.py): pad, eos and bos are control tokens."""
        return [b"\xff<pad>", b"\xff<eos>", b"\xff<bos>"] + [bytes((b,)) for b in range(256)]

    def piece(self, token_id: int) -> str:
        return ("<pad>", "<eos>", "<bos>")[token_id] if token_id < 3 else self.decode([token_id])


TINY_RC = RunnerConfig(
    page_size=4, max_batch=8, max_chunk=16, max_context=128,
    global_pages=200, local_pages=200, ring_pages=6, fast_output=True,
)


@pytest.fixture(scope="session")
def tiny():
    cfg = tiny_config()
    return cfg, init_random_params(cfg, jax.random.PRNGKey(0))


@pytest.fixture(scope="session")
def tok():
    """The real Gemma 3 tokenizer, read from the GGUF file the engine serves."""
    from engine.model.gguf_file import default_gguf_path
    from engine.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_gguf_path(progress=False), progress=False)


class ChatBytes(ByteTokenizer):
    """The byte tokenizer with a trivial chat template (the workloads render chat prompts with one)."""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        turns = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return turns + ("<model>" if add_generation_prompt else "")


class LetterTokenizer(ByteTokenizer):
    """Every id decodes to one lowercase letter: the tiny model's output is always text."""

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def make_engine(tiny, tokenizer=None, **rc_overrides) -> EngineCore:
    """The tiny model's engine with TINY_RC (and `rc_overrides`)."""
    cfg, params = tiny
    rc = RunnerConfig(**{**TINY_RC.__dict__, **rc_overrides})
    return EngineCore(cfg, params, tokenizer or ByteTokenizer(), EngineConfig(runner=rc, token_budget=32))


@pytest.fixture(scope="session", autouse=True)
def _compile_cache():
    from engine.runtime.compiles import enable_persistent_cache

    enable_persistent_cache()


SPEC_RC = dict(verify_tokens=(2, 3, 5, 9), spec_max_batch=8)
SPEC_PROMPTS = [
    "abcabcabcabcabc abc",
    "the cat sat on the mat. the cat sat on the",
    "x",
    "def f(x):\n    return x\ndef f(x):\n    return",
    "one two three one two three one two",
]
"""Prompts of the speculation tests: repetitive text (n-gram drafts match), prose, one byte."""


def run_prompts(engine, prompts: list[str], sp, tokenizer=None):
    """Submit each prompt (as request r<i>), step until idle: (token ids per prompt, step stats)."""
    tok = tokenizer or ByteTokenizer()
    return run_requests(engine, [tok.encode(p) for p in prompts], sp)


def run_requests(engine, prompt_ids: list[list[int]], sp, tenants: list[str] | None = None):
    """Submit each prompt's token ids (as request r<i>, from tenants[i] when given), step until
    idle: (token ids per prompt, step stats)."""
    from engine.types import Request

    for i, ids in enumerate(prompt_ids):
        engine.add_request(Request(f"r{i}", ids, sp, **({"tenant": tenants[i]} if tenants else {})))
    out = {f"r{i}": [] for i in range(len(prompt_ids))}
    stats = []
    while engine.has_work():
        o = engine.step()
        stats += [o.stats] if o.stats else []
        for ev in o.events:
            out[ev.request_id] += ev.token_ids
    return [out[f"r{i}"] for i in range(len(prompt_ids))], stats


def churn_with_aborts(engine, n: int, seed: int, policy_at=None) -> set[str]:
    """Submit n short random requests (greedy and sampled, a fifth with a stop string) and step
    until idle, aborting a random live request on about one step in twenty; the ids of the
    requests that finished. `policy_at(i)`, when given, may return a policy to set before
    request i."""
    from engine.types import Request, SamplingParams

    rng, tok = random.Random(seed), ByteTokenizer()
    for i in range(n):
        if policy_at is not None and (policy := policy_at(i)) is not None:
            engine.set_policy(policy)
        prompt = " ".join(rng.choice(["ab", "cd", "ab cd", "x"]) for _ in range(rng.randint(1, 10)))
        sp = SamplingParams(max_tokens=rng.randint(1, 20), temperature=rng.choice([0.0, 1.0]),
                            stop=("cd",) if rng.random() < 0.2 else (), seed=i)
        engine.add_request(Request(f"r{i}", tok.encode(prompt), sp))
    done = set()
    while engine.has_work():
        if rng.random() < 0.05 and engine._seqs:
            engine.abort(rng.choice(sorted(engine._seqs)))
        done |= {r.request_id for r in engine.step().finished}
    return done
