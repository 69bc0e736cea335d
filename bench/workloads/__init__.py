"""Built-in traffic generator: seeded prompts from the stdlib's own text.

Every machine with Python has the standard library, so the prompts are built
from its sources and docstrings (`sources.py`); nothing is downloaded. Four
tenant kinds (`KINDS`), each with a pool of a few hundred distinct prompts:

- copy  -- edit-heavy requests whose answer quotes the prompt: "add type
  hints to this function", "fix the typos in this paragraph and repeat it",
  "repeat the text exactly", each followed by a verbatim stdlib block
  (`Prompt.quote`) and ending where the answer (the copy) starts.
- code  -- completion of a real stdlib function: signature, docstring and the
  first half of the body, cut at a statement boundary.
- chat  -- a user question about a stdlib function built from templates and
  its docstring summary, sometimes with a system turn or a follow-up turn;
  rendered with the chat template (`Prompt.render`, `to_request`).
- prose -- the first sentences of a long docstring, to be continued.

Why copy-heavy traffic favours n-gram drafting: an n-gram proposer drafts the
tokens that followed the last few tokens' earlier occurrence in the context.
When the answer repeats the prompt, that earlier occurrence is the prompt's
quoted block, so whole runs of drafts are accepted for the price of a lookup,
without running any draft model. Code completion repeats identifiers and chat
or prose rarely repeat long spans, so the payoff shrinks in that order and
the tuner has something to decide.

`prompts(kind, n, seed)` and `mixed(n, mix, seed)` draw prompts; `shared_prefix(n, seed,
tokenizer)` draws multi-tenant chat prompts that start with their tenant's ~1,000-token
system prompt (`shared.py`, for prefix caching); `trace(phases,
seed)` times them as Poisson arrivals per `Phase` (`SHIFTING_TRACE` is the
default low-copy / high-mixed / low-prose trace). Output is reproducible for a
given seed on a given interpreter (the pools depend on its stdlib version).
"""

from bench.workloads.kinds import (
    DEFAULT_MAX_TOKENS,
    KINDS,
    Prompt,
    check_mix,
    mixed,
    pool,
    prompts,
    tenant_for,
    to_request,
)
from bench.workloads.shared import shared_prefix, system_prompts
from bench.workloads.trace import (
    PHASE_NAMES,
    SHIFTING_TRACE,
    Phase,
    TimedPrompt,
    shifting_trace,
    trace,
)

__all__ = [
    "DEFAULT_MAX_TOKENS", "KINDS", "PHASE_NAMES", "Phase", "Prompt", "SHIFTING_TRACE", "TimedPrompt",
    "check_mix", "mixed",
    "pool", "prompts", "shared_prefix", "shifting_trace", "system_prompts", "tenant_for", "to_request",
    "trace",
]
