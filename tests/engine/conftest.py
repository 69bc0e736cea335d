"""Shared fixtures for engine tests: a tiny random model and a byte tokenizer."""

from __future__ import annotations

import jax
import pytest

from engine.core import EngineConfig, EngineCore
from engine.runner import RunnerConfig
from tests.engine.tiny import init_random_params, tiny_config


class ByteTokenizer:
    """ids 3..258 are bytes 0..255; 0 pad, 1 eos, 2 bos. Checkable by hand."""

    bos_id, eos_id = 2, 1
    stop_ids = (1,)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([2] if add_bos else []) + [b + 3 for b in text.encode()]

    def decode(self, ids) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


TINY_RC = RunnerConfig(
    page_size=4, batch_buckets=(1, 2, 4, 8), prefill_buckets=(4, 8, 16), context_buckets=(32, 128),
    global_pages=200, local_pages=200, ring_pages=6, fast_output=True,
)


@pytest.fixture(scope="session")
def tiny():
    cfg = tiny_config()
    return cfg, init_random_params(cfg, jax.random.PRNGKey(0))


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
    cfg, params = tiny
    rc = RunnerConfig(**{**TINY_RC.__dict__, **rc_overrides})
    return EngineCore(cfg, params, tokenizer or ByteTokenizer(), EngineConfig(runner=rc, token_budget=32))


@pytest.fixture(scope="session", autouse=True)
def _compile_cache():
    from engine.runner import enable_persistent_cache

    enable_persistent_cache()


SPEC_RC = dict(verify_tokens=(2, 3, 5, 9), spec_max_batch=8)


def run_prompts(engine, prompts: list[str], sp, tokenizer=None):
    """Submit each prompt (as request r<i>), step until idle: (token ids per prompt, step stats)."""
    from engine.types import Request

    tok = tokenizer or ByteTokenizer()
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", tok.encode(p), sp))
    out = {f"r{i}": [] for i in range(len(prompts))}
    stats = []
    while engine.has_work():
        o = engine.step()
        stats += [o.stats] if o.stats else []
        for ev in o.events:
            out[ev.request_id] += ev.token_ids
    return [out[f"r{i}"] for i in range(len(prompts))], stats
