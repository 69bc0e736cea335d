"""`UserError`: what a `crossover` command raises for a bad value from the user.

It lives apart from cli.main so that commands and the CLI share one class
even when the CLI runs as `python -m cli.main` (where that module is
`__main__`, and a class defined in it would be a second, different one).
"""

from __future__ import annotations


class UserError(Exception):
    """A bad value from the user; printed without a traceback, exit code 2."""


def first_line(exc: BaseException) -> str:
    """The first line of `exc`'s message, or its type's name when the message is empty."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]

