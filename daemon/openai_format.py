"""Response bodies of the OpenAI-compatible routes: what one choice collected, and the JSON
shapes of /v1/completions (`Format`) and /v1/chat/completions (`ChatFormat`), whole or as
stream chunks. Every choice carries its `index` (0..n-1 for a request with `n` choices).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from daemon.openai_params import GenerationSpec
from daemon.tools import calls_in
from engine.types import TokenEvent


@dataclass
class Output:
    """What came out of the engine for one choice so far."""

    start: float = field(default_factory=time.monotonic)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    finish_reason: str | None = None
    ttft_ms: float | None = None
    prompt_logprobs: tuple | None = None
    """Per prompt token its engine.types.PromptLogprob (None for the first) when the prompt was scored."""

    def add(self, event: TokenEvent) -> None:
        if self.ttft_ms is None and event.token_ids:
            self.ttft_ms = round((time.monotonic() - self.start) * 1000.0, 1)
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.text.append(event.text)
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs or ())
        self.tops.extend(event.top_logprobs or ())
        if event.finished:
            self.finish_reason = event.finish_reason


def usage(spec: GenerationSpec, outs: list[Output]) -> dict[str, int]:
    """Token counts of a response: each prompt once (as OpenAI counts n > 1), every choice's output.

    >>> a, b = Output(token_ids=[5, 6]), Output(token_ids=[7])
    >>> usage(GenerationSpec([1, 2, 3], None, False, False, 0), [a, b])
    {'prompt_tokens': 3, 'completion_tokens': 3, 'total_tokens': 6}
    """
    prompt = sum(len(ids) for ids in spec.all_prompts)
    completion = sum(len(out.token_ids) for out in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class Format:
    """Body shapes of /v1/completions; `ChatFormat` overrides them for chat."""

    prefix = "cmpl"
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, model: str, spec: GenerationSpec, tok: Any) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.model, self.spec, self.tok = model, spec, tok
        self.created = int(time.time())
        self.unechoed = set(range(spec.choices)) if spec.echo is not None else set()
        """Choices whose stream has not yet carried their prompt (`echo`)."""

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full_choice(self, out: Output, index: int = 0) -> dict[str, Any]:
        lp = self._lp(out.token_ids, out.logprobs, out.tops)
        text, lp = self._echoed(index, "".join(out.text), lp, out.prompt_logprobs)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}

    def text_choice(self, event: TokenEvent, index: int = 0) -> dict[str, Any]:
        lp = self._lp(list(event.token_ids), list(event.logprobs or ()), list(event.top_logprobs or ()))
        text = event.text
        if index in self.unechoed:  # a choice's first chunk carries its prompt
            self.unechoed.discard(index)
            text, lp = self._echoed(index, text, lp, event.prompt_logprobs)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": None}

    def _echoed(self, index: int, text: str, lp: dict[str, Any] | None,
                prompt_lps: tuple | None) -> tuple[str, dict[str, Any] | None]:
        """A choice's `text` and logprobs with its prompt's before them (`echo`); the first prompt
        token has no logprob (nothing precedes it), as vLLM and OpenAI answer."""
        if self.spec.echo is None:
            return text, lp
        prompt = self.spec.echo[index // self.spec.n]
        if lp is None or prompt_lps is None:
            return prompt + text, lp
        ids = self.spec.all_prompts[index // self.spec.n]
        head = self._lp(ids, [p and p[0] for p in prompt_lps], [p and p[1] for p in prompt_lps])
        shift = sum(map(len, head["tokens"]))
        top = None if lp["top_logprobs"] is None else head["top_logprobs"] + lp["top_logprobs"]
        return prompt + text, {"tokens": head["tokens"] + lp["tokens"],
                               "token_logprobs": head["token_logprobs"] + lp["token_logprobs"],
                               "top_logprobs": top,
                               "text_offset": head["text_offset"] + [shift + o for o in lp["text_offset"]]}

    def finish_choice(self, reason: str | None, index: int = 0) -> dict[str, Any]:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}

    def finish_choices(self, out: Output, reason: str | None, index: int = 0) -> list[dict[str, Any]]:
        """The stream chunks' choices that end a choice (what `text_choice` held back, then its finish)."""
        return [self.finish_choice(reason, index)]

    def first_chunks(self) -> list[dict[str, Any]]:
        return []

    def token_text(self, token: int) -> str:
        """How logprobs name a token: its text, or `token_id:<id>` (vLLM's
        `return_tokens_as_token_ids`, for tokens whose text is not whole UTF-8)."""
        return f"token_id:{token}" if self.spec.tokens_as_ids else self.tok.decode([token])

    def _lp(self, token_ids: list[int], logprobs: list[float], tops: list) -> dict[str, Any] | None:
        """The legacy shape: top_logprobs is one {token text: logprob} per token (the N most
        likely, then the chosen token if it is not among them, as vLLM)."""
        if not self.spec.sampling.logprobs:
            return None
        tokens = [self.token_text(t) for t in token_ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        top = None
        if self.spec.top_logprobs or self.spec.sampling.prompt_logprobs is not None:
            top = []
            for text, lp, alts in zip(tokens, logprobs, tops, strict=False):
                if lp is None:  # a prompt's first token
                    top.append(None)
                    continue
                entry = {self.token_text(i): v for i, v in reversed(alts)}  # equal texts: the best wins
                entry.setdefault(text, lp)
                top.append(entry)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top,
                "text_offset": offsets}


class ChatFormat(Format):
    prefix = "chatcmpl"
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def full_choice(self, out: Output, index: int = 0) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(out.text), "refusal": None}
        calls, reason = self._calls(out), out.finish_reason
        if calls:
            message, reason = {**message, "content": None, "tool_calls": calls}, "tool_calls"
        return {"index": index, "message": message,
                "logprobs": self._lp(out.token_ids, out.logprobs, out.tops), "finish_reason": reason}

    def text_choice(self, event: TokenEvent, index: int = 0) -> dict[str, Any] | None:
        if self.spec.tools is not None:  # held until the answer is whole: a call, or text (`finish_choices`)
            return None
        lp = self._lp(list(event.token_ids), list(event.logprobs or ()), list(event.top_logprobs or ()))
        return {"index": index, "delta": {"content": event.text}, "logprobs": lp, "finish_reason": None}

    def finish_choices(self, out: Output, reason: str | None, index: int = 0) -> list[dict[str, Any]]:
        if self.spec.tools is None:
            return [self.finish_choice(reason, index)]
        calls = self._calls(out)
        if calls:  # each call whole in one delta, as the openai client reassembles them
            delta: dict[str, Any] = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
            reason = "tool_calls"
        else:
            delta = {"content": "".join(out.text)}
        return [{"index": index, "delta": delta, "logprobs": self._lp(out.token_ids, out.logprobs, out.tops),
                 "finish_reason": None}, self.finish_choice(reason, index)]

    def _calls(self, out: Output) -> list[dict[str, Any]] | None:
        """The tool calls of a whole answer that ended by itself; None for text."""
        if self.spec.tools is None or out.finish_reason != "stop":
            return None
        return calls_in("".join(out.text), self.spec.tools)

    def finish_choice(self, reason: str | None, index: int = 0) -> dict[str, Any]:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}

    def first_chunks(self) -> list[dict[str, Any]]:
        """One chunk per choice giving its role, before any content (as OpenAI and vLLM)."""
        delta = {"role": "assistant", "content": ""}
        return [self.envelope(self.object_chunk, [{"index": i, "delta": delta, "logprobs": None,
                                                   "finish_reason": None}])
                for i in range(self.spec.n)]

    def _lp(self, token_ids: list[int], logprobs: list[float], tops: list) -> dict[str, Any] | None:
        """OpenAI's chat shape: per token its logprob and top_logprobs, the N most likely tokens."""
        if not self.spec.sampling.logprobs:
            return None
        content = []
        for i, (t, lp) in enumerate(zip(token_ids, logprobs, strict=False)):
            alts = [self._entry(a, v) for a, v in tops[i]] if self.spec.top_logprobs and i < len(tops) else []
            content.append({**self._entry(t, lp), "top_logprobs": alts})
        return {"content": content, "refusal": None}

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
