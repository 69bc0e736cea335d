"""`crossover db upgrade|current|revision`: manage the telemetry database schema."""

from __future__ import annotations

import argparse

from cli.commands import database_actions, database_url

ACTIONS = {
    "upgrade": "bring the database to the newest schema (creates it when empty)",
    "current": "print the database's schema revision and head; exit 1 unless at head",
    "revision": "developers: write a new migration from the models (autogenerate)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    revision = database_actions(parser, "db_action", ACTIONS)["revision"]
    revision.add_argument("-m", "--message", required=True, help="what the migration does")
    revision.add_argument("--empty", action="store_true", help="an empty revision (no autogenerate)")


def run(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from daemon.user_error import UserError, first_line
    from store import migrate

    url = database_url(args)
    try:
        if args.db_action == "upgrade":
            before = migrate.current_revision(url)
            migrate.upgrade(url)
            print(f"{_shown(url)}: {before or 'empty'} -> {migrate.current_revision(url)} (head)")
            return 0
        if args.db_action == "current":
            return _print_current(url)
        migrate.new_revision(url, args.message, autogenerate=not args.empty)
        return 0
    except SQLAlchemyError as exc:
        raise UserError(f"{_shown(url)}: {first_line(exc)}") from exc


def _print_current(url: str) -> int:
    from store import migrate

    current, head = migrate.current_revision(url), migrate.head_revision()
    print(f"database: {_shown(url)}")
    print(f"current:  {current or '(no crossover schema)'}")
    print(f"head:     {head}")
    if current == head:
        print("status:   up to date")
        return 0
    try:
        migrate.check_schema(url)
    except migrate.SchemaError as exc:
        print(f"status:   {exc}")
    return 1


def _shown(url: str) -> str:
    from store.db import shown_url

    return shown_url(url)
