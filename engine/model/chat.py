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
_SYSTEM = ("system", "developer")
"""Roles folded into the first user turn (OpenAI's `developer` is its newer name for system)."""


def _content(message: Mapping[str, Any], where: str) -> str:
    """Text of a message: a string, or OpenAI-style parts [{"type": "text", "text": ...}]."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and all(isinstance(p, Mapping) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise ValueError(f"{where}: only text content parts are supported")
        return "".join(p["text"].strip() for p in content)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got "
                     f"{type(content).__name__}")


def _role(message: Any, where: str) -> str:
    if not isinstance(message, Mapping):
        kind = type(message).__name__
        raise ValueError(f"{where}: a message must be a dict with 'role' and 'content', got {kind}")  # noqa: TRY004
    role = message.get("role")
    if role not in (*_SYSTEM, *_TURN_ROLE):
        raise ValueError(f"{where}: unknown role {role!r} (system, developer, user, assistant)")
    return role


def chat_segments(messages: Sequence[Mapping[str, Any]],
                  add_generation_prompt: bool = True) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is_template) pieces, in order.

    Only template pieces may hold control tokens: a tokenizer encodes the other
    pieces (the messages' own text) as plain text, so a message that writes
    `<end_of_turn>` cannot close its turn and forge another one.

    >>> chat_segments([{"role": "user", "content": "Hi"}])
    [('<start_of_turn>user\\n', True), ('Hi', False), ('<end_of_turn>\\n<start_of_turn>model\\n', True)]
    """
    if not messages:
        raise ValueError("messages is empty: at least one user message is needed")
    roles = [_role(m, f"messages[{i}]") for i, m in enumerate(messages)]
    system, start = "", 0
    if roles[0] in _SYSTEM:
        system, start = _content(messages[0], "messages[0]"), 1
        if len(messages) == 1:
            raise ValueError("a system message must be followed by a user message")
    out: list[tuple[str, bool]] = []
    for turn, i in enumerate(range(start, len(messages))):
        where = f"messages[{i}]"
        expected = "user" if turn % 2 == 0 else "model"
        if roles[i] in _SYSTEM:
            raise ValueError(f"{where}: a system message is only allowed first")
        if _TURN_ROLE[roles[i]] != expected:
            wanted = "a user" if expected == "user" else "an assistant"
            raise ValueError(
                f"{where}: expected {wanted} message, got {roles[i]!r} "
                "(roles must alternate user/assistant, starting with user)"
            )
        out.append(((f"{END}\n" if out else "") + f"{START}{expected}\n", True))
        if turn == 0 and start:  # one plain piece, so "\n" runs tokenize as in the joined text
            out.append((system + "\n\n", False))
        out.append((_content(messages[i], where).strip(), False))
    out.append((f"{END}\n" + (f"{START}model\n" if add_generation_prompt else ""), True))
    return [(text, template) for text, template in out if text]


def apply_chat_template(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """Render a conversation as Gemma turns (as one string; see chat_segments).

    A leading system (or developer) message is folded into the first user turn,
    separated by a blank line; turns must then alternate user / assistant
    starting with user; turn contents are stripped of surrounding whitespace
    (as Gemma's template does).

    >>> apply_chat_template([{"role": "system", "content": "Be brief."},
    ...                      {"role": "user", "content": "Hi"}])
    '<start_of_turn>user\\nBe brief.\\n\\nHi<end_of_turn>\\n<start_of_turn>model\\n'
    """
    return "".join(text for text, _ in chat_segments(messages, add_generation_prompt))
