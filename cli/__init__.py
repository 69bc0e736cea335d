"""The `crossover` command line: `cli.main` parses the subcommand, `cli.commands` holds one
module per subcommand. It dispatches to the daemon (`serve`), the serving packages' tools
(`db`, `plan`, `tenants`, ...), `bench/` and `training/`; nothing of the service imports it.
"""
