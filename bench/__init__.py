"""Benchmarks, load generators, workloads and reports around the crossover daemon.

Nothing in the serving packages imports this package; `crossover bench ...`
parses its flags in cli/commands/bench.py and calls in here.
"""


def print_and_write(result: dict, out: str | None) -> dict:
    """Print a bench tool's result as indented JSON and, when `out` names a file, write it there
    too (its folder made). Returns `result`."""
    import json
    from pathlib import Path

    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return result

