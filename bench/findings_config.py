"""`crossover bench findings`'s configuration: the config its flags ask for (cli/commands/bench.py parses
them), and the early-exit results Q4 shows by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.workloads import KINDS

TECHNIQUES = ("ngram", "mtp", "early_exit", "draft")


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
    depth: int = 4
    """Draft depth of every speculative run (a proposer with fewer heads runs its most)."""
    q1_prompts: int = 4
    """Prompts per kind in Q1 (the mixed batch holds all kinds' prompts)."""
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Q2 batch sizes."""
    prompt_tokens: int = 128
    """Longest Q1/Q2 prompt."""
    new_tokens: int = 24
    """Tokens each Q1/Q2 request decodes."""
    draft_split: float = 0.2
    """Pool split of the draft model's Q1/Q2 runs (it drafts only in a lent pool); others run at 0."""
    q3_kinds: tuple[str, ...] = ("copy", "code")
    """Kinds of the Q3 queue: the ones with the longest prompts, so the queue fills the pool."""
    q3_requests: int = 32
    q3_prompt_tokens: int = 320
    q3_new_tokens: int = 64
    splits: tuple[float, ...] = (0.125, 0.25, 0.5)
    """Pool splits of the draft model's Q3 runs."""
    kv_budget: int = 416 << 20
    """The engine's one memory budget (engine/memory/budget.py): speculation's resident bytes (~160 MiB
    of Gemma 3 270M's heads in float32) come out of it first, leaving a ~256 MiB KV pool in which
    Q2's largest batch fits and Q3's queue does not."""
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

    def __post_init__(self) -> None:
        bad = [k for k in (*self.kinds, *self.q3_kinds) if k not in KINDS]
        bad += [t for t in self.techniques if t not in TECHNIQUES]
        if bad or not self.kinds or not self.q3_kinds:
            raise ValueError(f"unknown kinds or techniques {bad} (kinds: {list(KINDS)}, techniques: "
                             f"{list(TECHNIQUES)})")
        for name in ("depth", "q1_prompts", "prompt_tokens", "new_tokens", "q3_requests", "q3_prompt_tokens",
                     "q3_new_tokens", "max_batch", "kv_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.batches or min(self.batches) < 1 or max(self.batches) > self.max_batch:
            raise ValueError(f"batches {list(self.batches)} must be in 1..max_batch={self.max_batch}")
        if not self.phases or any(x not in ("q1", "q2", "q3") for x in self.phases):
            raise ValueError(f"phases {list(self.phases)} must be some of q1, q2, q3")
        if any(not 0 < s <= 0.5 for s in (*self.splits, self.draft_split)):
            raise ValueError(f"splits {list(self.splits)} and draft_split {self.draft_split} must be in (0, "
                             "0.5]")

    @staticmethod
    def quick_config(db: str, out: str, **kw: Any) -> FindingsConfig:
        """The --quick grid: fake engine, two batch sizes per phase."""
        small = {"quick": True, "q1_prompts": 2, "batches": (1, 4, 8), "prompt_tokens": 48, "new_tokens": 12,
                 "q3_requests": 12, "q3_prompt_tokens": 48, "q3_new_tokens": 24, "splits": (0.25, 0.5),
                 "max_batch": 8}
        return FindingsConfig(db=db, out=out, **{**small, **kw})


def parse_size(text: str) -> int:
    """Bytes from "268435456", "256MiB", "1GiB"; ValueError naming the text otherwise.

    >>> parse_size("256MiB"), parse_size("1gib"), parse_size("4096")
    (268435456, 1073741824, 4096)
    """
    units = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    num = text.strip().lower().rstrip("kmgib")
    unit = text.strip().lower()[len(num):]
    if unit not in units or not num.replace(".", "", 1).isdigit():
        raise ValueError(f"--kv-budget {text!r} is not a size (e.g. 256MiB)")
    return int(float(num) * units[unit])


def command_line(args: Any) -> str:
    """The `crossover bench findings` command line these parsed flags spell (flags left at their
    default omitted), for the report header."""
    import shlex

    parts = ["crossover", "bench", "findings", "--db", args.db, "--out",
             args.out] + (["--quick"] if args.quick else [])
    for flag in ("kv_budget", "splits", "batches", "techniques", "phases", "note", "model", "heads", "dtype"):
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
                            "note": args.note, "command": command_line(args)}
    if args.kv_budget is not None:
        over["kv_budget"] = parse_size(args.kv_budget)
    for name, kind in (("splits", float), ("batches", int)):
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


REFERENCE_EXIT = "exit8-b1-64.json"
"""The compacting early-exit run Q4 shows by default (with any written after it)."""


def default_early_exit(folder: Path | None = None) -> list[str]:
    """`crossover bench early-exit` results for Q4: REFERENCE_EXIT under bench/results/early-exit
    and every JSON there written more than a minute after it (a newer run)."""
    folder = folder or Path(__file__).resolve().parent / "results" / "early-exit"
    ref = folder / REFERENCE_EXIT
    if not ref.is_file():
        return []
    newer = sorted((p for p in folder.glob("*.json") if p.stat().st_mtime > ref.stat().st_mtime + 60),
                   key=lambda p: p.stat().st_mtime)
    return [_shown(p) for p in (ref, *newer)]


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
