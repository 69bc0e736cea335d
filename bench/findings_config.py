"""`crossover bench findings`'s configuration: the config its flags ask for (cli/commands/bench.py parses
them), and the early-exit results Q4 shows by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.workloads import KINDS

TECHNIQUES = ("ngram", "mtp", "early_exit", "draft")
SAMPLINGS = ("greedy", "sampled")
"""Q1's decoding modes: temperature 0, and `q1_temperature` with a seed per request."""
RESIDENT_TECHNIQUES = ("mtp", "draft")
"""Proposers that hold resident memory (heads, a draft model): Q3 prices each against plain decoding."""


@dataclass(frozen=True)
class FindingsConfig:
    """What `crossover bench findings` runs (the defaults: see bench/README.md for how long they take)."""

    db: str
    """Telemetry database (SQLAlchemy URL or SQLite path); migrated to head, rows appended."""
    out: str = "docs/findings"
    """Folder of the report (README.md, PNGs, findings.json)."""
    quick: bool = False
    """Fake engine, small grid: the whole pipeline in seconds (tests)."""
    kinds: tuple[str, ...] = KINDS
    techniques: tuple[str, ...] = TECHNIQUES
    depth: int = 2
    """Draft depth of the Q1 and Q3 runs (a proposer with fewer heads runs its most)."""
    rounds: int = 3
    """Q2 and Q3 rounds: a round runs every configuration once, plain decoding first in each group."""
    q1_prompts: int = 16
    """Prompts per kind in Q1 (its batches hold every kind's prompts, round-robin)."""
    q1_new_tokens: int = 128
    """Tokens each Q1 request decodes."""
    q1_temperature: float = 0.8
    """Temperature of Q1's sampled runs (greedy runs: 0)."""
    q1_alone: bool = False
    """Q1 also runs each kind alone (greedy only): lossless verification makes a row's drafts independent
    of its batch mates, so this only checks that."""
    prompt_tokens: int = 128
    """Longest Q1 prompt."""
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Q2 batch sizes (at each context, those within `q2_tokens`)."""
    contexts: tuple[int, ...] = (512, 2048, 4096)
    """Q2 contexts: each request's prompt fills its context but for its new tokens and drafts."""
    q2_tokens: int = 16384
    """Most batch x context tokens a Q2 run holds: larger batches are left out at that context."""
    depths: tuple[int, ...] = (1, 3)
    """Q2 draft depths: the report compares plain decoding with each technique at its best one."""
    new_tokens: int = 16
    """Tokens each Q2 request decodes."""
    draft_split: float = 0.2
    """Pool split of the draft model's Q1/Q2 runs (it drafts only in a lent pool); others run at 0."""
    q3_kinds: tuple[str, ...] = ("copy", "code")
    """Kinds of the Q3 queue."""
    q3_requests: int = 32
    """Requests queued at once in Q3: more than the plain engine's pool holds at `q3_context`."""
    q3_context: int = 512
    """Tokens of each Q3 request (prompt and new tokens): the context tenants are counted at."""
    q3_new_tokens: int = 32
    splits: tuple[float, ...] = (0.25,)
    """Pool splits of the draft model's Q3 runs."""
    kv_budget: int = 1536 << 20
    """Memory budget (engine/memory/budget.py) of the Q1/Q2 engine: speculation's resident bytes (~165 MiB
    of Gemma 3 270M's heads in float32) come out of it first. The pool is sized for the rows that fit at
    the engine's max context, sliding-window ring pages included, so the rest must hold `max_batch` rows at
    the longest Q2 context (Gemma 3 270M at 4224 tokens: ~42 MiB a row), or batches above that never run."""
    q3_kv_budget: int = 256 << 20
    """Memory budget of each Q3 engine (plain, MTP heads, draft model: each loads only its own
    proposer), so plain decoding gets speculation's resident bytes back as KV pages."""
    max_batch: int = 32
    seed: int = 0
    model: str | None = None
    heads: str | None = None
    dtype: str | None = None
    early_exit: tuple[str, ...] = ()
    """`crossover bench early-exit` JSON files for Q4."""
    phases: tuple[str, ...] = ("q1", "q2", "q3")
    """Phases to run, in this order; a run of some phases appends to a database holding the others."""
    note: str | None = None
    """Free text for the report header (e.g. that the machine was shared)."""
    command: str | None = None
    """The command line that ran this, for the report header."""
    dry_run: bool = False
    """Print the plan of runs and its estimated time; load and measure nothing."""

    def __post_init__(self) -> None:
        bad = [k for k in (*self.kinds, *self.q3_kinds) if k not in KINDS]
        bad += [t for t in self.techniques if t not in TECHNIQUES]
        if bad or not self.kinds or not self.q3_kinds:
            raise ValueError(f"unknown kinds or techniques {bad} (kinds: {list(KINDS)}, techniques: "
                             f"{list(TECHNIQUES)})")
        for name in ("depth", "rounds", "q1_prompts", "q1_new_tokens", "prompt_tokens", "new_tokens",
                     "q3_requests", "q3_context", "q3_new_tokens", "max_batch", "kv_budget", "q3_kv_budget",
                     "q2_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.batches or min(self.batches) < 1 or max(self.batches) > self.max_batch:
            raise ValueError(f"batches {list(self.batches)} must be in 1..max_batch={self.max_batch}")
        if not self.depths or min(self.depths) < 1:
            raise ValueError(f"depths {list(self.depths)} must be >= 1")
        room = self.new_tokens + max(self.depths) + 2
        if not self.contexts or min(self.contexts) <= room:
            raise ValueError(f"contexts {list(self.contexts)} must exceed new_tokens + depth + 2 = {room}")
        if not any(b * c <= self.q2_tokens for b in self.batches for c in self.contexts):
            raise ValueError(f"q2_tokens={self.q2_tokens} holds no batch of {list(self.batches)} at any "
                             f"context of {list(self.contexts)}")
        if self.q3_new_tokens + self.depth + 2 >= self.q3_context:
            raise ValueError(f"q3_context={self.q3_context} must exceed q3_new_tokens={self.q3_new_tokens} "
                             f"+ depth={self.depth} + 2")
        if not self.phases or any(x not in ("q1", "q2", "q3") for x in self.phases):
            raise ValueError(f"phases {list(self.phases)} must be some of q1, q2, q3")
        if any(not 0 < s <= 0.5 for s in (*self.splits, self.draft_split)):
            raise ValueError(f"splits {list(self.splits)} and draft_split {self.draft_split} must be in (0, "
                             "0.5]")
        if not self.q1_temperature > 0:
            raise ValueError(f"q1_temperature={self.q1_temperature} must be > 0 (greedy runs are apart)")

    def q2_grid(self) -> list[tuple[int, int]]:
        """(context, batch) of every Q2 cell: each context with the batches `q2_tokens` holds."""
        return [(c, b) for c in sorted(self.contexts) for b in sorted(self.batches)
                if b * c <= self.q2_tokens]

    @staticmethod
    def quick_config(db: str, out: str, **kw: Any) -> FindingsConfig:
        """The --quick grid: fake engine, three batch sizes, two contexts, two rounds' worth of everything."""
        small = {"quick": True, "q1_prompts": 3, "q1_new_tokens": 12, "batches": (1, 4, 8),
                 "contexts": (64, 128),
                 "q2_tokens": 512, "depths": (1, 3), "prompt_tokens": 48, "new_tokens": 12, "rounds": 3,
                 "q3_requests": 12, "q3_context": 96, "q3_new_tokens": 24, "splits": (0.25, 0.5),
                 "max_batch": 8}
        return FindingsConfig(db=db, out=out, **{**small, **kw})


def parse_size(text: str, flag: str = "--kv-budget") -> int:
    """Bytes from "268435456", "256MiB", "1GiB"; ValueError naming the text otherwise.

    >>> parse_size("256MiB"), parse_size("1gib"), parse_size("4096")
    (268435456, 1073741824, 4096)
    """
    units = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    num = text.strip().lower().rstrip("kmgib")
    unit = text.strip().lower()[len(num):]
    if unit not in units or not num.replace(".", "", 1).isdigit():
        raise ValueError(f"{flag} {text!r} is not a size (e.g. 256MiB)")
    return int(float(num) * units[unit])


def command_line(args: Any) -> str:
    """The `crossover bench findings` command line these parsed flags spell (flags left at their
    default omitted), for the report header."""
    import shlex

    parts = ["crossover", "bench", "findings", "--db", args.db, "--out",
             args.out] + (["--quick"] if args.quick else []) + (["--dry-run"] if args.dry_run else [])
    for flag in ("kv_budget", "q3_kv_budget", "splits", "batches", "contexts", "depths", "rounds",
                 "techniques", "phases", "note", "model", "heads", "dtype"):
        if getattr(args, flag) is not None:
            parts += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for path in args.early_exit or ():
        parts += ["--early-exit", path]
    return shlex.join(parts + (["--seed", str(args.seed)] if args.seed else []))


def config_from_flags(args: Any) -> FindingsConfig:
    """The config `crossover bench findings` flags ask for (cli/commands/bench.py parses them);
    ValueError naming a bad value."""
    from dataclasses import fields

    over: dict[str, Any] = {"seed": args.seed, "model": args.model, "heads": args.heads, "dtype": args.dtype,
                            "note": args.note, "command": command_line(args), "dry_run": args.dry_run}
    for name in ("kv_budget", "q3_kv_budget"):
        if getattr(args, name) is not None:
            over[name] = parse_size(getattr(args, name), "--" + name.replace("_", "-"))
    if args.rounds is not None:
        over["rounds"] = args.rounds
    for name, kind in (("splits", float), ("batches", int), ("contexts", int), ("depths", int)):
        text = getattr(args, name)
        if text is not None:
            try:
                over[name] = tuple(kind(x) for x in text.split(","))
            except ValueError:
                raise ValueError(f"--{name} must be comma-separated numbers, got {text!r}") from None
    for name in ("techniques", "phases"):
        if getattr(args, name):
            over[name] = tuple(x.strip() for x in getattr(args, name).split(",") if x.strip())
    files = args.early_exit if args.early_exit is not None else default_early_exit()
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise ValueError(f"--early-exit {missing[0]!r} does not exist")
    over["early_exit"] = tuple(files)
    if args.quick:
        return FindingsConfig.quick_config(args.db, args.out, **over)
    known = {f.name for f in fields(FindingsConfig)}
    return FindingsConfig(db=args.db, out=args.out, **{k: v for k, v in over.items() if k in known})


REFERENCE_EXIT = "exit8-b1-64-rounds3.json"
"""The compacting early-exit run Q4 shows by default: it keeps every round's speedup, so its cells
carry intervals. Other runs are named with `--early-exit`."""


def default_early_exit(folder: Path | None = None) -> list[str]:
    """`crossover bench early-exit` results for Q4: REFERENCE_EXIT under bench/results/early-exit, or none.
    By name, not by file time: a fresh clone gives every file the same time."""
    ref = (folder or Path(__file__).resolve().parent / "results" / "early-exit") / REFERENCE_EXIT
    return [_shown(ref)] if ref.is_file() else []


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
