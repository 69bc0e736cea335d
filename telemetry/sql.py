"""Portable SQL helpers shared by the queries and the retention job."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, literal_column
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement


class floor_div(FunctionElement[int]):
    """`floor(expr / n)` for a non-negative expression and a positive integer n.

    SQLite may lack FLOOR (it needs the math extension), so there it compiles
    to CAST(expr / n AS INTEGER), which is the same for non-negative values.
    """

    type = BigInteger()
    name = "floor_div"
    inherit_cache = True


@compiles(floor_div)
def _floor_div_default(element: floor_div, compiler: Any, **kw: Any) -> str:
    expr, divisor = (compiler.process(c, **kw) for c in element.clauses)
    return f"FLOOR({expr} / {divisor})"


@compiles(floor_div, "sqlite")
def _floor_div_sqlite(element: floor_div, compiler: Any, **kw: Any) -> str:
    expr, divisor = (compiler.process(c, **kw) for c in element.clauses)
    return f"CAST({expr} / {divisor} AS INTEGER)"


def bucket_start(expr: Any, bucket_s: int) -> Any:
    """SQL for the start of the `bucket_s`-second bucket holding `expr` (unix seconds)."""
    if int(bucket_s) != bucket_s or bucket_s < 1:
        raise ValueError(f"bucket_s must be a positive integer, got {bucket_s!r}")
    n = literal_column(str(int(bucket_s)))
    return floor_div(expr, n) * n


def minute_of(t: float) -> int:
    """Start of the minute holding unix time `t`, as Python computes it.

    >>> minute_of(125.5)
    120
    """
    return int(t // 60) * 60
