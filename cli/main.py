"""The `crossover` command line: one subcommand per module in cli/commands.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`
and imports heavy packages (jax, sqlalchemy, ...) only inside `run`, so
`crossover --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from daemon.user_error import UserError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("cli.commands.serve", "run the HTTP inference daemon"),
    "generate": ("cli.commands.generate", "one-shot generation from the CLI (no server)"),
    "plan": ("cli.commands.plan", "print the memory plan for a device and a model"),
    "bench": ("cli.commands.bench", "run a benchmark and write JSON"),
    "db": ("cli.commands.db", "manage the telemetry database schema"),
    "tenants": ("cli.commands.tenants", "add, list and revoke tenants' API keys"),
    "retune": ("cli.commands.retune", "ask a running daemon to retune its policy now"),
    "train-heads": ("cli.commands.train_heads",
                    "train the MTP heads and exit adapters of the draft proposers"),
    "report": ("cli.commands.report",
               "write the findings report (Markdown + figures) from a telemetry database"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="crossover", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"crossover {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:  # a command still being built
            if exc.name != module:
                raise
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("crossover")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


ENGINE_COMMANDS = frozenset({"serve", "generate", "bench"})
"""Commands that run the engine in this process: they start with its allocator settings."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and args.command in ENGINE_COMMANDS:
        from engine.runtime.allocator import restart_with_allocator_settings

        restart_with_allocator_settings()
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except UserError as exc:
        print(f"crossover {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
