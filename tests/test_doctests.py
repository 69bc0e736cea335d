"""Every worked example (`>>>`) in a docstring of the serving packages, the command line, bench/ and training/
runs.

Modules are chosen by reading their source with `ast` (a docstring holding
`>>>`), so a new example is picked up without being listed here; each chosen
module is then imported and its examples run with `doctest`. migrations/ is
left out: its env.py runs only inside Alembic.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cli", "daemon", "engine", "tuner", "telemetry", "store", "bench", "training")
_DEFINITIONS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def has_examples(source: str) -> bool:
    """Whether any docstring in `source` holds a `>>>` example.

    >>> has_examples('def f():\\n    \"\"\">>> 1 + 1\\n    2\"\"\"\\n')
    True
    >>> has_examples('PROMPT = ">>> not a docstring"\\n')
    False
    """
    tree = ast.parse(source)
    return any(">>>" in (ast.get_docstring(node, clean=False) or "")
               for node in ast.walk(tree) if isinstance(node, _DEFINITIONS))


def modules_with_examples() -> list[str]:
    names = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if has_examples(path.read_text(encoding="utf-8")):
                parts = list(path.relative_to(ROOT).with_suffix("").parts)
                names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = modules_with_examples()


def test_examples_are_found():
    assert len(MODULES) >= 20, MODULES  # the tree carries more than twenty such modules
    assert "tests.test_doctests" not in MODULES and "engine.memory.sizes" in MODULES


def test_this_files_examples():
    results = doctest.testmod(sys.modules[__name__])
    assert results.attempted >= 2 and results.failed == 0


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
    assert tests, f"{name}: a docstring holds '>>>' but doctest finds no example (nested function?)"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    failures: list[str] = []
    for test in tests:
        runner.run(test, out=failures.append)
    assert runner.failures == 0, f"{name}: {runner.failures} failing example(s)\n" + "".join(failures)
