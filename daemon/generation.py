"""What a parsed OpenAI-style request is (`GenerationSpec`) and what it may ask for (`Limits`):
the types daemon/openai_params.py builds and the routes, formats and streams read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from daemon import tools
from engine.types import SamplingParams


class Tokenizer(Protocol):
    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


@dataclass(frozen=True)
class Limits:
    """What a request may ask for."""

    model_name: str
    """The name answers carry (the first served name)."""
    max_context: int
    max_prompt_chars: int
    max_tokens: int | None = None
    """The tenant's cap on completion tokens: more is a 400; an unset max_tokens is clamped."""
    vocab_size: int | None = None
    """Token ids must be below it (None: the engine checks them on submit)."""
    max_concurrent: int | None = None
    """The tenant's slots: `n` above it is a 400 (its n choices could never run at once)."""
    model_names: tuple[str, ...] = ()
    """Every name `model` may take (`--served-model-name`); () : `model_name` alone."""


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request, ready to become an `engine.types.Request`."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    top_logprobs: int
    """Most likely tokens listed per token in top_logprobs (0..20)."""
    names: dict[str, str] = field(default_factory=dict)
    """engine field -> the body key it came from (prompt_ids -> prompt or messages), for errors."""
    user: str | None = None
    """The client's end-user label (accepted, not interpreted)."""
    n: int = 1
    """Choices to generate (1..MAX_N), each its own engine request."""
    tools: tools.Tools | None = None
    """The functions a chat answer may call (daemon/tools.py); None: it answers in text."""
    prompts: list[list[int]] | None = None
    """A completion request's prompts when it sent a list of them (`prompt_ids` is the first)."""
    tokens_as_ids: bool = False
    """Logprobs name tokens `token_id:<id>` (vLLM's `return_tokens_as_token_ids`)."""
    echo: tuple[str, ...] | None = None
    """A completion request's `echo`: each prompt's text, put before its choices' text (and
    with logprobs, its tokens' logprobs before theirs); None: off."""

    @property
    def all_prompts(self) -> list[list[int]]:
        return self.prompts or [self.prompt_ids]

    @property
    def choices(self) -> int:
        """Engine requests of the response: `n` for each prompt."""
        return self.n * len(self.all_prompts)
