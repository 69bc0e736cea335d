"""The golden prompts: varied on purpose, each one exercising something the
engine can get wrong (indentation tokens, byte fallback, control tokens,
copying, digits, sliding-window attention past 512 tokens).

Rules every prompt follows:
- no run of 32+ spaces (transformers' GGUF tokenizer is inexact there);
- control tokens appear only in the chat case, written literally
  (``<bos>``, ``<start_of_turn>``, ``<end_of_turn>``) and tokenized as such.

Two prompts are cut from Python's standard library at run time (their text
is stored in the fixture, which is the source of truth afterwards).
"""

from __future__ import annotations

import bisect
import inspect
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    name: str
    """Stable identifier used by the golden test."""
    kind: str
    """What the prompt exercises (prose, code, chat, long, ...)."""
    text: str
    """Prompt text. Control tokens written literally are tokenized as such."""
    add_bos: bool
    """True: the ids are [2] + encode(text). False: text already holds <bos>."""


CHAT_TEMPLATE = "<bos><start_of_turn>user\n{msg}<end_of_turn>\n<start_of_turn>model\n"

_CODE = '''def fibonacci(n):
    """Return the first n Fibonacci numbers."""
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
'''

_FIXED = [
    Prompt("prose", "prose",
           "The lighthouse keeper had lived alone on the island for eleven years. "
           "Every evening, just before sunset, he climbed the hundred and twelve "
           "steps to the lamp room and", True),
    Prompt("code_python", "code", _CODE, True),
    Prompt("recipe_list", "structured",
           "Ingredients for pancakes:\n- 2 cups flour\n- 2 eggs\n- 1.5 cups milk\n"
           "- 2 tablespoons sugar\n- 1 teaspoon baking powder\n\nSteps:\n"
           "1. Whisk the dry ingredients together.\n2.", True),
    Prompt("json_record", "structured",
           '{"name": "Alice", "age": 30, "languages": ["Python", "Rust"], '
           '"address": {"city": "Berlin",', True),
    Prompt("question", "question",
           "Question: Why is the sky blue during the day but red at sunset?\nAnswer:", True),
    Prompt("french", "non_english",
           "La ville de Lyon est située au confluent du Rhône et de la Saône. "
           "Elle est connue pour", True),
    Prompt("japanese", "non_english",
           "東京は日本の首都であり、世界で最も人口の多い都市圏の一つです。この都市は", True),
    Prompt("copy_repeat", "copy",
           "Repeat the following text exactly:\nThe quick brown fox jumps over the "
           "lazy dog near the riverbank at dawn, while seven silver swans glide "
           "across the misty water.\n\nRepeated text:\nThe quick brown fox", True),
    Prompt("arithmetic", "math",
           "12 + 35 = 47\n48 + 17 = 65\n23 + 41 = 64\n56 + 29 = 85\n31 + 44 =", True),
    Prompt("chat_poem", "chat",
           CHAT_TEMPLATE.format(msg="Write a short poem about the ocean."), False),
    Prompt("one_word", "minimal", "The", True),
]


def _statistics_docstring() -> str:
    """~900 tokens: the whole prompt is past the 512-token sliding window."""
    return statistics.__doc__.strip() + "\n"


def _bisect_prefix(count_tokens: Callable[[str], int], limit: int) -> str:
    """The longest prefix of bisect.py, cut just after a word, whose ids (BOS
    included) number at most ``limit``. With ~490 prompt ids, decode steps
    from about 22 on have queries past position 512, so the sliding window
    starts dropping keys part-way through generation."""
    words = re.findall(r"\s*\S+", inspect.getsource(bisect))
    lo, hi = 0, len(words)  # binary search on the number of words kept
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens("".join(words[:mid])) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return "".join(words[:lo])


def build_prompts(count_tokens: Callable[[str], int]) -> list[Prompt]:
    """All golden prompts. ``count_tokens(text)`` returns len([2] + encode(text))."""
    long_text = _statistics_docstring()
    crossing = _bisect_prefix(count_tokens, limit=490)
    return _FIXED + [
        Prompt("long_statistics_doc", "long_past_window", long_text, True),
        Prompt("bisect_crosses_window", "crosses_window", crossing, True),
    ]
