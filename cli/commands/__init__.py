"""One module per `crossover` subcommand: `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse

DB_HELP = "SQLAlchemy URL or SQLite file path (default: $CROSSOVER_DB or ./crossover.db)"


def database_actions(
    parser: argparse.ArgumentParser, dest: str, actions: dict[str, str]
) -> dict[str, argparse.ArgumentParser]:
    """Sub-actions (name -> help) of a command that works on the telemetry database, each
    with a `--db URL` flag; returns their parsers for action-specific flags."""
    sub = parser.add_subparsers(dest=dest, metavar="ACTION")
    sub.required = True
    parsers = {}
    for name, help_text in actions.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--db", metavar="URL", default=None, help=DB_HELP)
        parsers[name] = p
    return parsers


def database_url(args: argparse.Namespace) -> str:
    """The URL a `--db` flag names, or the default database."""
    from store.db import default_url, resolve_url

    return resolve_url(args.db) if args.db else default_url()
