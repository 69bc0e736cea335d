"""A step's rows as the acceptance and proposer fits count them: one `Drafts` per row class.

A step recorded with `row_classes` (schema revision 0009) names, for each
(tenant, technique, depth) among its decode rows, how many rows there were
and what they proposed and accepted. Its rows may draft with several
techniques at several depths (per-tenant rules), so the step-level fields
(technique of the most drafting rows, the verify depth, sums over every
row) no longer say what any one row did. The fits count each class on its
own instead:

- acceptance: every class under its technique key, and under its tenant's
  key (`ngram|copy`), whatever other tenants shared the step;
- draft share: a class's drafting sequences (proposed / depth) over its rows;
- proposer cost: a step's `propose_ms` is the sum of the proposers that ran,
  each priced p0 + p1 * rows + p2 * rows * depth on its own rows
  (`propose_columns`), so the terms of every technique are fitted jointly.

A step without row classes (older telemetry) is one unit: its
technique and depth, all its rows, and its tenant when the batch held one.

    >>> from engine.types import RowClass, StepStats
    >>> s = StepStats(batch_size=3, decode_tokens=6, technique="ngram", depth=4, proposed=10,
    ...               accepted=3, accepted_per_pos=(2, 1, 0, 0), tenants=("chat", "copy"),
    ...               row_classes=(RowClass("copy", "ngram", 4, 2, 8, 3, (2, 1, 0, 0)),
    ...                            RowClass("chat", "ngram", 2, 1, 2, 0, (0, 0))))
    >>> [(d.tenant, d.technique, d.depth, d.rows, d.speculating) for d in units(s)]
    [('copy', 'ngram', 4, 2, 2.0), ('chat', 'ngram', 2, 1, 1.0)]
    >>> propose_columns(s, lambda technique: technique)
    {'ngram': (1.0, 3.0, 10.0)}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.types import StepStats


@dataclass(frozen=True, slots=True)
class Drafts:
    """Rows of one step that drafted alike: what the acceptance fits count."""

    technique: str
    depth: int
    rows: int
    """Decode rows (drafting or not) of this unit."""
    proposed: int
    accepted_per_pos: tuple[int, ...]
    tenant: str | None
    """The rows' tenant; None when the unit mixes tenants (a step without row classes whose
    batch held several)."""
    decode_only: bool
    """The step carried no prefill: `rows` are all decode rows (what a draft share counts)."""
    classed: bool = False
    """From a recorded row class (one tenant, one choice), not a whole step."""

    @property
    def speculating(self) -> float:
        """Sequences that drafted (each offers one draft per position)."""
        return self.proposed / self.depth if self.depth else 0.0

    @property
    def drafts(self) -> bool:
        return bool(self.depth) and self.technique != "none" and self.proposed > 0


def units(s: StepStats) -> Iterator[Drafts]:
    """The step's row classes as Drafts, or the step itself without them (module doc)."""
    classes = getattr(s, "row_classes", ())
    if classes:
        for c in classes:
            yield Drafts(c.technique, c.depth, c.rows, c.proposed, tuple(c.accepted_per_pos),
                         c.tenant, True, True)
        return
    tenant = s.tenants[0] if len(s.tenants) == 1 else None
    yield Drafts(s.technique, s.depth, s.batch_size, s.proposed, tuple(s.accepted_per_pos),
                 tenant, not s.prefill_tokens)


def propose_columns(s: StepStats,
                    key_of: Callable[[str], str]) -> dict[str, tuple[float, float, float]]:
    """Proposer key -> (ran, rows, rows * depth) of the step: the regressors of its
    propose_ms, one triple per proposer that ran (key_of maps a technique to its key)."""
    classes = getattr(s, "row_classes", ())
    if not classes:
        if not s.depth or s.technique == "none":
            return {}
        return {key_of(s.technique): (1.0, float(s.batch_size), float(s.batch_size * s.depth))}
    out: dict[str, list[float]] = {}
    for c in classes:
        if c.depth and c.technique != "none":
            col = out.setdefault(key_of(c.technique), [1.0, 0.0, 0.0])
            col[1] += c.rows
            col[2] += c.rows * c.depth
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}
