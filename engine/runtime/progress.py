"""How the engine's long operations report progress: a callback, never a drawing.

Assembling and hashing the model file, converting weights, building the
tokenizer and compiling every shape at warmup take seconds to minutes. Each
calls `progress(label, done, total)` as it goes (done == total last, once);
the command line turns the calls into a terminal bar or JSON log events
(daemon/progress.py). The engine itself imports no UI library.

A `progress` argument is a `Progress`, or a bool (the older form callers still pass):
False / None is silent; True prints the informational lines but draws no bar.
"""

from __future__ import annotations

import sys
from typing import Protocol


class Progress(Protocol):
    """Called as work advances: `label` names the operation, `done` of `total` units."""

    def __call__(self, label: str, done: int, total: int) -> None: ...


Reporter = Progress | bool | None
"""What long operations accept as their `progress` argument (module doc)."""


def report(progress: Reporter, label: str, done: int, total: int) -> None:
    """Pass one update to a callback; bools and None draw nothing.

    >>> seen = []
    >>> report(lambda *a: seen.append(a), "convert", 3, 8); report(True, "convert", 4, 8)
    >>> seen
    [('convert', 3, 8)]
    """
    if callable(progress):
        progress(label, done, total)


def note(progress: Reporter, message: str) -> None:
    """An informational line: the reporter's own `note(message)` when it has one (a JSON log
    event under `crossover serve`), else printed on stderr; nothing when `progress` is falsy."""
    if not progress:
        return
    own = getattr(progress, "note", None)
    if callable(own):
        own(message)
    else:
        print(message, file=sys.stderr, flush=True)


class Steps:
    """Counts units of one operation and reports each advance; `close()` reports the end.

    >>> seen = []
    >>> with Steps(lambda *a: seen.append(a), "hash", 10) as s:
    ...     s.advance(4); s.advance(4)
    >>> seen
    [('hash', 0, 10), ('hash', 4, 10), ('hash', 8, 10), ('hash', 10, 10)]
    """

    def __init__(self, progress: Reporter, label: str, total: int) -> None:
        self.progress, self.label, self.total, self.done = progress, label, max(int(total), 1), 0
        report(progress, label, 0, self.total)

    def advance(self, amount: int = 1) -> None:
        self.done = min(self.done + int(amount), self.total)
        report(self.progress, self.label, self.done, self.total)

    def close(self) -> None:
        if self.done < self.total:
            self.done = self.total
            report(self.progress, self.label, self.done, self.total)

    def __enter__(self) -> Steps:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
