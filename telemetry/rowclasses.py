"""A step's drafts per row class, as the telemetry readers count them.

Since revision 0009 a step records `row_classes`: one JSON object per
(tenant, technique, depth) among its decode rows, with its rows and the
drafts they proposed and accepted (engine.types.RowClass). Under per-tenant
rules one step's rows may draft with several techniques and depths; its
step-level columns then hold the technique of the most drafting rows, the
verify depth (the deepest row's) and sums over every row, which say what no
single row did. So:

- acceptance (per technique, per draft position, per-minute rollups) counts
  every drafting class under its own technique and depth (`drafts`);
- a step's time is one step's, so it is counted once: under its recorded
  technique, or under MIXED when its drafting classes used several
  techniques (`step_technique`); the verify depth stays its depth.

A step without classes (NULL: rows from before 0009, or [] for a step with
no decode rows) counts as one unit: its technique and depth are the step's own.

    >>> classes = [{"tenant": "copy", "technique": "ngram", "depth": 4, "rows": 2, "proposed": 8,
    ...             "accepted": 3, "accepted_per_pos": [2, 1, 0, 0]},
    ...            {"tenant": "chat", "technique": "mtp", "depth": 2, "rows": 1, "proposed": 2,
    ...             "accepted": 1, "accepted_per_pos": [1, 0]},
    ...            {"tenant": "prose", "technique": "none", "depth": 0, "rows": 1}]
    >>> [(d.technique, d.depth, d.proposed, d.accepted)
    ...  for d in drafts("ngram", 4, 10, 4, [3, 1, 0, 0], classes)]
    [('ngram', 4, 8, 3), ('mtp', 2, 2, 1)]
    >>> step_technique("ngram", classes), step_technique("ngram", classes[:1]), step_technique("none", None)
    ('mixed', 'ngram', 'none')
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MIXED = "mixed"
"""The technique a step's time is counted under when its rows drafted with several techniques."""


@dataclass(frozen=True, slots=True)
class Drafted:
    """Drafts of rows that drafted alike: one row class, or a whole step without classes."""

    technique: str
    depth: int
    proposed: int
    accepted: int
    accepted_per_pos: tuple[int, ...]
    tenant: str | None = None
    """The class's tenant; None for a whole step."""


def classes_of(value: Any) -> list[dict[str, Any]]:
    """The stored `row_classes` value as a list of objects ([] for NULL, JSON null or [])."""
    if isinstance(value, (str, bytes)):  # a driver that hands JSON back as text
        value = json.loads(value)
    return list(value or ())


def drafts(technique: str, depth: int, proposed: int, accepted: int,
           accepted_per_pos: Sequence[int] | None, row_classes: Any) -> list[Drafted]:
    """The step's drafting units: its drafting classes, else the step itself (when it drafted)."""
    classes = classes_of(row_classes)
    if not classes:
        if not depth or technique == "none":
            return []
        return [Drafted(technique, int(depth), int(proposed or 0), int(accepted or 0),
                        tuple(int(n) for n in accepted_per_pos or ()))]
    out = []
    for c in classes:
        if not c.get("depth") or c.get("technique", "none") == "none":
            continue
        per_pos = tuple(int(n) for n in c.get("accepted_per_pos") or ())
        out.append(Drafted(str(c["technique"]), int(c["depth"]), int(c.get("proposed", 0)),
                           int(c.get("accepted", sum(per_pos))), per_pos, c.get("tenant")))
    return out


def step_technique(technique: str, row_classes: Any) -> str:
    """What a step's time counts under: MIXED when its drafting classes used several techniques,
    else its recorded technique."""
    used = {c.get("technique") for c in classes_of(row_classes)
            if c.get("depth") and c.get("technique", "none") != "none"}
    return MIXED if len(used) > 1 else technique
