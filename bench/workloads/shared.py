"""The shared-prefix workload: a few tenants, each with its own long system prompt.

Multi-tenant traffic as a prefix cache sees it: every request of a tenant
starts with that tenant's system prompt (about `prefix_tokens` tokens), and
requests differ only after it, in the user's question.

1. Tenants: `tenants` names ("prefix-tenant-0", ...). The seed picks one
   stdlib module per tenant (distinct modules with enough documentation);
   the tenant's system prompt is an instruction line followed by that
   module's docstrings as reference notes, cut to `prefix_tokens` tokens of
   the given tokenizer (without one, to 4 characters per token).
2. Requests: chat prompts (system turn, then one user question about a stdlib
   function, drawn from the `chat` pool with the same seed, so distinct
   until the pool runs out). Request i goes to tenant `order[i % tenants]`,
   `order` a seeded permutation: every tenant appears once in each run of
   `tenants` consecutive requests. `Prompt.tenant` carries the tenant.

The same seed on the same interpreter (and tokenizer) gives the same prompts.
"""

from __future__ import annotations

import random
from typing import Protocol

from bench.workloads.kinds import DEFAULT_MAX_TOKENS, Prompt, prompts
from bench.workloads.sources import Module, load_modules

KIND = "shared-prefix"
TENANTS = 4
PREFIX_TOKENS = 1000
CHARS_PER_TOKEN = 4
"""Sizing without a tokenizer: Gemma's tokenizer averages about 4 characters of English per token."""


class SizingTokenizer(Protocol):
    """What sizing a system prompt needs (`engine.model.tokenizer.Tokenizer` and the fake have it)."""

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def tenant_name(i: int) -> str:
    return f"prefix-tenant-{i}"


def system_prompts(seed: int = 0, tokenizer: SizingTokenizer | None = None,
                   prefix_tokens: int = PREFIX_TOKENS, tenants: int = TENANTS) -> dict[str, str]:
    """Tenant name -> its system prompt, about `prefix_tokens` tokens long (see module doc)."""
    if tenants < 1 or prefix_tokens < 1:
        raise ValueError(f"tenants and prefix_tokens must be >= 1, got {tenants}, {prefix_tokens}")
    need = prefix_tokens * 2 * CHARS_PER_TOKEN  # room to cut from, whatever the tokenizer
    documented = [m for m in load_modules() if len(_notes(m, need)) >= need]
    if len(documented) < tenants:
        raise RuntimeError(f"only {len(documented)} stdlib modules have {need} characters of "
                           f"documentation; {tenants} tenants need one each")
    rng = random.Random(f"crossover-workloads:{KIND}:{seed}")
    chosen = rng.sample(documented, tenants)
    out = {}
    for i, module in enumerate(chosen):
        head = (f"{module.name} support desk. You are the assistant of a team that builds on "
                f"Python's `{module.name}` module. Answer briefly and cite the reference notes "
                f"below when they help.\n\nReference notes on `{module.name}`:\n\n")
        out[tenant_name(i)] = _cut(head + _notes(module, need), tokenizer, prefix_tokens)
    return out


def shared_prefix(n: int, seed: int = 0, tokenizer: SizingTokenizer | None = None,
                  prefix_tokens: int = PREFIX_TOKENS, tenants: int = TENANTS) -> list[Prompt]:
    """`n` chat prompts of `tenants` tenants, each starting with its tenant's system prompt.

    >>> ps = shared_prefix(8, seed=0, prefix_tokens=50)
    >>> sorted({p.tenant for p in ps})
    ['prefix-tenant-0', 'prefix-tenant-1', 'prefix-tenant-2', 'prefix-tenant-3']
    >>> len({p.messages[0] for p in ps}), len({p.messages[1] for p in ps})
    (4, 8)
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    systems = system_prompts(seed, tokenizer, prefix_tokens, tenants)
    names = list(systems)
    rng = random.Random(f"crossover-workloads:{KIND}:order:{seed}")
    order = rng.sample(names, len(names))
    out = []
    for i, question in enumerate(prompts("chat", n, seed)):
        tenant = order[i % len(order)]
        out.append(Prompt(KIND, question.text, DEFAULT_MAX_TOKENS["chat"], chat=True,
                          messages=(("system", systems[tenant]), ("user", question.text)),
                          source=question.source, tenant=tenant))
    return out


def _notes(module: Module, chars: int) -> str:
    """The module's docstring, then "name: docstring" of its documented definitions, up to
    about `chars` characters."""
    parts = [module.doc] if module.doc else []
    total = len(parts[0]) if parts else 0
    for d in module.defs:
        if total >= chars:
            break
        if d.docstring:
            parts.append(f"{d.qualname}: {d.docstring}")
            total += len(parts[-1])
    return "\n\n".join(parts)


def _cut(text: str, tokenizer: SizingTokenizer | None, tokens: int) -> str:
    """The longest whitespace-ended start of `text` of at most `tokens` tokens (a few fewer:
    the cut backs off to the last whitespace)."""
    if tokenizer is None:
        head = text[: tokens * CHARS_PER_TOKEN]
    else:
        head = tokenizer.decode(tokenizer.encode(text, add_bos=False)[:tokens])
    cut = max(head.rfind(" "), head.rfind("\n"))
    return (head[:cut] if cut > 0 else head).rstrip()
