"""The four prompt kinds, their pools built from stdlib text, and seeded draws.

Each kind has a pool: every prompt its builder can make from `load_modules()`,
in source order, de-duplicated. `prompts` shuffles a pool with a seeded
`random.Random` and takes from the front (reshuffling when it runs out), so the
same seed on the same interpreter gives the same prompts.
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Protocol

from bench.workloads.sources import Definition, Module, load_modules
from engine.types import Request, SamplingParams

KINDS: tuple[str, ...] = ("copy", "code", "chat", "prose")
DEFAULT_MAX_TOKENS = {"copy": 256, "code": 96, "chat": 160, "prose": 128}
"""Suggested output lengths; copy prompts ask for about as much as they quote."""

MIN_CHARS, MAX_CHARS = 200, 1200
"""Bounds on the stdlib text in one prompt (about 50-400 Gemma tokens)."""


@dataclass(frozen=True)
class Prompt:
    """One generated prompt. Chat prompts carry messages; the rest are raw completions."""

    kind: str
    text: str
    """The completion prompt; for chat, the last user message."""
    max_tokens: int
    """Suggested `SamplingParams.max_tokens`."""
    chat: bool = False
    messages: tuple[tuple[str, str], ...] = ()
    """(role, content) turns of a chat prompt, ending with a user turn."""
    quote: str = ""
    """Copy kind: the block, verbatim from a stdlib file, that the answer should repeat."""
    source: str = ""
    """Where the text came from: "json/decoder.py:JSONDecoder.decode"."""
    tenant: str = ""
    """The tenant that sends it; "" for the kinds' own (`tenant_for(kind)`)."""

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]

    def render(self, tokenizer: ChatTokenizer) -> str:
        """The text to encode: the chat template applied for chat prompts, else `text`."""
        return tokenizer.apply_chat_template(self.as_messages()) if self.chat else self.text


class ChatTokenizer(Protocol):
    """What rendering and encoding need (`engine.model.tokenizer.Tokenizer` has it)."""

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...
    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str: ...


def tenant_for(kind: str) -> str:
    """The tenant name load tests use for a kind: "copy" -> "copy-tenant"."""
    return f"{kind}-tenant"


def to_request(
    p: Prompt, tokenizer: ChatTokenizer, request_id: str, max_tokens: int | None = None,
    temperature: float = 0.0, seed: int | None = None, tenant: str | None = None,
    arrival_time: float | None = None,
) -> Request:
    """Encode `p` (with BOS; chat via the template) into an engine `Request` of `tenant`,
    else of `p.tenant`, else of its kind's tenant."""
    limit = p.max_tokens if max_tokens is None else max_tokens
    sampling = SamplingParams(max_tokens=limit, temperature=temperature, seed=seed)
    extra = {} if arrival_time is None else {"arrival_time": arrival_time}
    ids = tokenizer.encode(p.render(tokenizer), add_bos=True)
    return Request(request_id, ids, sampling, tenant or p.tenant or tenant_for(p.kind), **extra)


# --- copy / edit-heavy -------------------------------------------------------

_CODE_EDITS = (
    "Add type hints to the following Python function. Change nothing else and reply with the whole "
    "function.\n\n```python\n{quote}\n```\n\nThe same function with type hints:\n\n```python\n",
    "Rename the function `{name}` to `{name}_v2` and write out the complete function again.\n\n"
    "```python\n{quote}\n```\n\nRenamed:\n\n```python\n",
    "Reformat this function so that no line is longer than 79 characters, keeping the code otherwise "
    "identical.\n\n```python\n{quote}\n```\n\n```python\n",
    "Repeat the following code exactly, character for character:\n\n{quote}\n\nRepeated:\n\n",
)
_TEXT_EDITS = (
    'Fix any typos in this paragraph and repeat it:\n\n"""\n{quote}\n"""\n\nCorrected paragraph:\n\n"""\n',
    "Repeat the text exactly:\n\n{quote}\n\nRepeated text:\n\n",
    "Rewrite the following documentation using British spelling, changing nothing else:\n\n{quote}\n\n"
    "Rewritten:\n\n",
)


def _copy_max_tokens(quote: str) -> int:
    return min(DEFAULT_MAX_TOKENS["copy"], max(32, len(quote) // 3))


def _code_copies(mod: Module) -> list[Prompt]:
    out = []
    for d in mod.defs:
        if not d.top_level or d.is_class:
            continue
        quote = mod.segment(d.lineno, d.end_lineno)
        if MIN_CHARS <= len(quote) <= MAX_CHARS:
            template = _CODE_EDITS[len(out) % len(_CODE_EDITS)]
            text = template.format(quote=quote, name=d.name)
            out.append(Prompt("copy", text, _copy_max_tokens(quote), quote=quote,
                              source=f"{mod.path}:{d.qualname}"))
    return out


def _paragraph_blocks(mod: Module) -> list[tuple[int, int]]:
    """Line spans of runs of module-docstring paragraphs, each MIN_CHARS..MAX_CHARS long."""
    span = mod.doc_span
    if span is None:
        return []
    blocks, start = [], None
    for n in range(span[0], span[1] + 2):
        blank = n > span[1] or not mod.lines[n - 1].strip()
        if start is None and not blank:
            start = n
        if start is not None and blank and len(mod.segment(start, n - 1)) >= MIN_CHARS:
            blocks.append((start, n - 1))
            start = None
    return [b for b in blocks if len(mod.segment(*b)) <= MAX_CHARS and ">>>" not in mod.segment(*b)]


def _text_copies(mod: Module) -> list[Prompt]:
    out = []
    for first, last in _paragraph_blocks(mod):
        quote = mod.segment(first, last)
        text = _TEXT_EDITS[len(out) % len(_TEXT_EDITS)].format(quote=quote)
        out.append(Prompt("copy", text, _copy_max_tokens(quote), quote=quote,
                          source=f"{mod.path}:{first}-{last}"))
    return out


# --- code completion ---------------------------------------------------------

def _completion(mod: Module, d: Definition) -> Prompt | None:
    """Signature, docstring and the first half of the body, cut at a statement boundary."""
    rest = d.body_lines
    if d.is_class or d.docstring is None or len(rest) < 2:
        return None
    header = "" if d.top_level else f"class {d.qualname.split('.')[0]}:\n"
    for keep in range(math.ceil(len(rest) / 2), 0, -1):
        text = header + mod.segment(d.lineno, rest[keep] - 1).rstrip() + "\n"
        if len(text) <= MAX_CHARS + 200:
            break
    else:
        return None
    if len(text) < MIN_CHARS:
        return None
    return Prompt("code", text, DEFAULT_MAX_TOKENS["code"], source=f"{mod.path}:{d.qualname}")


# --- chat --------------------------------------------------------------------

_QUESTIONS = (
    'What does `{name}` do? The documentation says: "{summary}" I don\'t quite follow. Can you explain '
    "it in plain words and show a short example?",
    "I'm reading the source of Python's `{module}` module and found `{name}`. Its docstring reads:\n\n"
    "{summary}\n\nWhen would I use it, and what mistakes do people usually make with it?",
    "Can you show me how to use `{name}` from the standard library? I know it is described as "
    '"{summary}" but I have never called it myself.',
    "Explain `{name}` to someone who is new to Python. Here is its docstring for reference:\n\n{summary}"
    "\n\nPlease keep the answer short.",
)
_SYSTEM = "You are a concise Python tutor. Answer in one short paragraph and at most one code example."
_FOLLOW_UP = 'Thanks. How does that compare with `{name}`, which is documented as "{summary}"?'


def _summary(d: Definition) -> str | None:
    if not d.public or not d.docstring:
        return None
    first = " ".join(d.docstring.split("\n\n")[0].split())
    return first if 40 <= len(first) <= 400 and ">>>" not in first else None


def _chats(mod: Module) -> list[Prompt]:
    documented = [(d, s) for d in mod.defs if (s := _summary(d))]
    out = []
    for i, (d, summary) in enumerate(documented):
        name = f"{mod.name}.{d.qualname}"
        question = _QUESTIONS[i % len(_QUESTIONS)].format(name=name, module=mod.name, summary=summary)
        turns: list[tuple[str, str]] = [("system", _SYSTEM)] if i % 3 == 0 else []
        turns.append(("user", question))
        if i % 5 == 4:
            other, other_summary = documented[i - 1]
            question = _FOLLOW_UP.format(name=f"{mod.name}.{other.qualname}", summary=other_summary)
            turns += [("assistant", f"`{name}`: {summary}"), ("user", question)]
        out.append(Prompt("chat", question, DEFAULT_MAX_TOKENS["chat"], chat=True, messages=tuple(turns),
                          source=f"{mod.path}:{d.qualname}"))
    return out


# --- prose continuation ------------------------------------------------------

_SENTENCE_END = re.compile(r"[.!?](?=\s+[A-Z`\"'(])")


def _is_prose(paragraph: str) -> bool:
    lines = paragraph.split("\n")
    return ">>>" not in paragraph and not paragraph.rstrip().endswith("::") and not any(
        line[:1].isspace() or line.lstrip()[:2] in ("- ", "* ") for line in lines)


def _continuation(doc: str) -> str | None:
    """The first sentences (about half) of a docstring's leading prose paragraphs."""
    paragraphs = []
    for paragraph in doc.split("\n\n"):
        if not _is_prose(paragraph):
            break
        paragraphs.append(paragraph)
    prose = "\n\n".join(paragraphs)
    ends = [m.end() for m in _SENTENCE_END.finditer(prose) if m.end() <= MAX_CHARS]
    if len(ends) < 3 or len(prose) < 2 * MIN_CHARS:
        return None
    cut = next((e for e in ends[1:] if e >= len(prose) / 2), ends[-1])
    return prose[:cut] if cut >= MIN_CHARS else None


def _proses(mod: Module) -> list[Prompt]:
    docs = [(mod.name, mod.doc)] if mod.doc else []
    docs += [(f"{mod.name}.{d.qualname}", d.docstring) for d in mod.defs if d.docstring]
    out = []
    for where, doc in docs:
        if text := _continuation(doc):
            out.append(Prompt("prose", text, DEFAULT_MAX_TOKENS["prose"], source=f"{mod.path}:{where}"))
    return out


# --- pools and draws ---------------------------------------------------------

_BUILDERS = {
    "copy": lambda m: _code_copies(m) + _text_copies(m),
    "code": lambda m: [p for d in m.defs if (p := _completion(m, d))],
    "chat": _chats,
    "prose": _proses,
}


@cache
def pool(kind: str) -> tuple[Prompt, ...]:
    """Every distinct prompt of `kind` this interpreter's stdlib yields, in source order."""
    _check_kind(kind)
    unique: dict[object, Prompt] = {}
    for mod in load_modules():
        for p in _BUILDERS[kind](mod):
            unique.setdefault(p.messages if p.chat else p.text, p)
    if not unique:
        raise RuntimeError(f"no {kind!r} prompts could be built from the standard library")
    return tuple(unique.values())


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown prompt kind {kind!r}; expected one of {KINDS}")


def prompts(kind: str, n: int, seed: int = 0) -> list[Prompt]:
    """`n` prompts of `kind`, distinct until the pool is used up (then it is reshuffled).

    >>> [p.kind for p in prompts("code", 2, seed=1)]
    ['code', 'code']
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    items = pool(kind)
    rng = random.Random(f"crossover-workloads:{kind}:{seed}")
    out: list[Prompt] = []
    while len(out) < n:
        out += rng.sample(items, len(items))[: n - len(out)]
    return out


def check_mix(mix: Mapping[str, float]) -> tuple[list[str], list[float]]:
    """The kinds and weights of a mix, validated: known kinds, finite weights >= 0, positive sum."""
    for kind, weight in mix.items():
        _check_kind(kind)
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"mix weight for {kind!r} must be finite and >= 0, got {weight!r}")
    if sum(mix.values()) <= 0:
        raise ValueError(f"mix weights must sum to more than 0, got {dict(mix)}")
    return list(mix), [float(w) for w in mix.values()]


def fill(kinds: Sequence[str], seed: int) -> list[Prompt]:
    """One prompt per entry of `kinds`, each kind drawn in order from its own seeded stream."""
    streams = {k: iter(prompts(k, c, seed)) for k, c in Counter(kinds).items()}
    return [next(streams[k]) for k in kinds]


def mixed(n: int, mix: Mapping[str, float], seed: int) -> list[Prompt]:
    """`n` prompts whose kinds are drawn independently with probabilities proportional to `mix`.

    >>> sorted({p.kind for p in mixed(8, {"copy": 1.0, "prose": 1.0}, seed=0)})
    ['copy', 'prose']
    """
    names, weights = check_mix(mix)
    rng = random.Random(f"crossover-workloads:mixed:{seed}")
    return fill(rng.choices(names, weights, k=n), seed)
