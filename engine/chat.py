"""Gemma's chat turn template (the GGUF carries none).

    <start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n
    <start_of_turn>model\n{assistant}<end_of_turn>\n
    ...
    <start_of_turn>model\n            (the generation prompt)

`<bos>` is not part of the text: `Tokenizer.encode` adds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

START, END = "<start_of_turn>", "<end_of_turn>"
_TURN_ROLE = {"user": "user", "assistant": "model", "model": "model"}


def _content(message: Mapping[str, Any], where: str) -> str:
    """Text of a message: a string, or OpenAI-style parts [{"type": "text", "text": ...}]."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and all(isinstance(p, Mapping) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise ValueError(f"{where}: only text content parts are supported")
        return "".join(p["text"].strip() for p in content)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def _role(message: Any, where: str) -> str:
    if not isinstance(message, Mapping):
        kind = type(message).__name__
        raise ValueError(f"{where}: a message must be a dict with 'role' and 'content', got {kind}")
    role = message.get("role")
    if role not in ("system", *_TURN_ROLE):
        raise ValueError(f"{where}: unknown role {role!r} (system, user, assistant)")
    return role


def apply_chat_template(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render a conversation as Gemma turns.

    A leading system message is folded into the first user turn, separated by a
    blank line; turns must then alternate user / assistant starting with user;
    turn contents are stripped of surrounding whitespace (as Gemma's template does).

    >>> apply_chat_template([{"role": "system", "content": "Be brief."},
    ...                      {"role": "user", "content": "Hi"}])
    '<start_of_turn>user\\nBe brief.\\n\\nHi<end_of_turn>\\n<start_of_turn>model\\n'
    """
    if not messages:
        raise ValueError("messages is empty: at least one user message is needed")
    roles = [_role(m, f"messages[{i}]") for i, m in enumerate(messages)]
    prefix, start = "", 0
    if roles[0] == "system":
        prefix, start = _content(messages[0], "messages[0]") + "\n\n", 1
        if len(messages) == 1:
            raise ValueError("a system message must be followed by a user message")
    parts = []
    for turn, i in enumerate(range(start, len(messages))):
        where = f"messages[{i}]"
        expected = "user" if turn % 2 == 0 else "model"
        if roles[i] == "system":
            raise ValueError(f"{where}: a system message is only allowed first")
        if _TURN_ROLE[roles[i]] != expected:
            wanted = "a user" if expected == "user" else "an assistant"
            raise ValueError(
                f"{where}: expected {wanted} message, got {roles[i]!r} "
                "(roles must alternate user/assistant, starting with user)"
            )
        text = (prefix if turn == 0 else "") + _content(messages[i], where).strip()
        parts.append(f"{START}{expected}\n{text}{END}\n")
    if add_generation_prompt:
        parts.append(f"{START}model\n")
    return "".join(parts)
