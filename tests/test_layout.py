"""The tree keeps the shape ../shared/DESIGN.md gives it, read from the source with `ast`.

Nothing is imported: every module of the project's packages is parsed, its
imports of the project's own modules are collected (at module level, inside
functions, under `if TYPE_CHECKING:`), and these rules are checked:

1. no import cycle between modules, nor between packages. Every import counts, the lazy
   ones inside functions and the type-checking ones too: a cycle that only a function-level
   or a TYPE_CHECKING import closes is still two modules that each need the other, and it
   turns into an import error the day someone moves the import to the top. `from pkg import
   mod` counts as importing `pkg` (its `__init__` runs and is read) and `pkg.mod`;
2. every import goes in a direction DESIGN.md allows (`ALLOWED` below), with no exceptions:
   the command line (`cli/`) is the one package that may call into the tools (`bench/`,
   `training/`), and nothing imports it;
3. the command line loads the tools only inside the command that runs them, so `crossover
   --help` and the serving commands never import them;
4. no Python file of the project's packages is longer than `MAX_LINES`;
5. no import cycle between the engine's parts (its subpackages and top-level modules), so
   the layers engine/__init__.py maps stay layers.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cli", "daemon", "engine", "tuner", "telemetry", "store", "migrations", "bench", "training")
OURS = (*PACKAGES, "tests")  # a production module importing tests/ is an error too
SERVING = ("daemon", "engine", "tuner", "telemetry", "store")
TOOLS = ("bench", "training")
MAX_LINES = 450

ALLOWED: dict[str, tuple[str, ...]] = {
    # importer package -> what it may import besides itself: a package or a module (and its submodules)
    "cli": tuple(p for p in PACKAGES if p != "cli"),
    "daemon": ("engine", "tuner", "telemetry", "store"),
    "tuner": ("store", "engine.policy", "engine.types", "engine.config"),
    "telemetry": ("store",),
    "store": (),
    "migrations": ("store.models", "store.versioning"),
    "engine": (),
    "bench": (*SERVING, "migrations"),
    "training": ("engine", "bench.workloads"),
}
"""Import directions from DESIGN.md. store.migrate points Alembic at the migrations folder
without importing the package."""


@dataclass(frozen=True)
class Import:
    source: str
    """Importing module, e.g. "engine.memory.planner"."""
    target: str
    """Imported module of ours (the longest dotted prefix that is a module)."""
    path: str
    """Importing file, relative to the repository root."""
    line: int
    lazy: bool
    """Inside a function (runs when called, not when the module loads)."""
    type_only: bool
    """Under `if TYPE_CHECKING:` (never runs)."""

    def __str__(self) -> str:
        how = " (type-checking only)" if self.type_only else " (inside a function)" if self.lazy else ""
        return f"{self.path}:{self.line} {self.source} -> {self.target}{how}"


def module_name(path: Path, root: Path = ROOT) -> str:
    """engine/memory/planner.py -> "engine.memory.planner"; store/__init__.py -> "store"."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py file under the packages."""
    return {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))
            if "__pycache__" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
                    modules: set[str]) -> set[str]:
    """Modules of ours an import statement loads: `from a import b` loads a.b when that is a module."""
    if isinstance(node, ast.Import):
        return {t for t in (_resolve(alias.name, modules) for alias in node.names) if t}
    base = node.module or ""
    if node.level:  # relative: resolve against the importing module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    targets = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else _resolve(base, modules)
               for alias in node.names}
    return {t for t in (*targets, _resolve(base, modules)) if t}


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest dotted prefix of `name` that is a module of ours (None: not ours)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def collect_imports(files: dict[str, Path], root: Path = ROOT) -> list[Import]:
    """Every import of one of our modules by one of our modules."""
    modules = set(files) | set(OURS)
    found: list[Import] = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in sorted(_import_targets(node, module, is_package, modules) - {module}):  # noqa: B023
                    found.append(Import(module, target, str(path.relative_to(root)), node.lineno,  # noqa: B023
                                        lazy, type_only))
                return
            for child in ast.iter_child_nodes(node):
                if isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body:
                    visit(child, lazy, True)
                else:
                    visit(child, lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                           ast.Lambda)), type_only)

        visit(tree, False, False)
    return found


def top(module: str) -> str:
    return module.split(".")[0]


def within(module: str, prefix: str) -> bool:
    """Whether `module` is `prefix` or one of its submodules."""
    return module == prefix or module.startswith(prefix + ".")


def direction_violations(imports: list[Import]) -> list[str]:
    """Imports that go against ALLOWED, one message each."""
    out = []
    for imp in imports:
        src, dst = top(imp.source), top(imp.target)
        if src == dst or any(within(imp.target, a) for a in ALLOWED[src]):
            continue
        allowed = ", ".join(ALLOWED[src]) or "nothing of ours"
        out.append(f"{imp}: {src}/ may import {allowed}")
    return out


def eager_tool_imports(imports: list[Import]) -> list[str]:
    """The command line's imports of a tool package that run when the module loads."""
    return [f"{imp}: import it inside the command that runs it" for imp in imports
            if top(imp.source) == "cli" and top(imp.target) in TOOLS and not imp.lazy]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted.

    >>> cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    [['a', 'b', 'c']]
    >>> cycles({"a": {"b"}, "b": set()})
    []
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    nodes = sorted(set(edges) | {d for ds in edges.values() for d in ds})

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in nodes:
        if v not in index:
            connect(v)
    return sorted(found)


def _cycle_messages(imports: list[Import], group, what: str) -> list[str]:
    """One message per cycle between the groups `group` maps modules to, naming the imports of
    `imports` that close it."""
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        edges[group(imp.source)].add(group(imp.target))
    out = []
    for component in cycles(edges):
        members = set(component)
        links = [str(i) for i in imports if group(i.source) in members and group(i.target) in members]
        out.append(f"import cycle between {what} " + ", ".join(component) + ":\n    "
                   + "\n    ".join(links))
    return out


def module_cycle_violations(imports: list[Import]) -> list[str]:
    """One message per cycle between modules, naming the imports that close it."""
    return _cycle_messages(imports, lambda m: m, "modules")


def package_cycle_violations(imports: list[Import]) -> list[str]:
    """One message per cycle between top-level packages, naming the imports that close it."""
    return _cycle_messages([i for i in imports if top(i.source) != top(i.target)], top, "packages")


def engine_part(module: str) -> str:
    """The engine subpackage or top-level module a module belongs to; other modules unchanged.

    >>> engine_part("engine.memory.kv"), engine_part("engine.policy"), engine_part("cli.main")
    ('engine.memory', 'engine.policy', 'cli.main')
    """
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "engine" else module


def engine_part_cycle_violations(imports: list[Import]) -> list[str]:
    """One message per cycle between the engine's parts, naming the imports that close it."""
    inside = [i for i in imports if top(i.source) == top(i.target) == "engine"
              and engine_part(i.source) != engine_part(i.target)]
    return _cycle_messages(inside, engine_part, "engine parts")


def long_files(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES, limit: int = MAX_LINES) -> list[str]:
    out = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > limit:
                out.append(f"{path.relative_to(root)}: {n} lines (limit {limit}): split it by what it does")
    return out


# ------------------------------------------------------------------ the tree ---


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return collect_imports(project_files())


def test_the_walk_sees_the_tree(imports):
    files = project_files()
    want = {"engine.step.core", "engine.memory.kv", "cli.main", "store.models", "migrations.env", "bench",
            "training"}
    assert want <= set(files)
    pairs = {(i.source, i.target) for i in imports}
    assert ("migrations.env", "store.models") in pairs
    assert any(top(s) == "daemon" and top(t) == "engine" for s, t in pairs)


@pytest.mark.parametrize("check", [module_cycle_violations, package_cycle_violations,
                                   engine_part_cycle_violations, direction_violations, eager_tool_imports],
                         ids=["no module cycle", "no package cycle", "no cycle between engine parts",
                              "the design's import directions", "the command line loads tools lazily"])
def test_the_tree_passes_the_import_check(imports, check):
    problems = check(imports)
    assert not problems, "\n".join(problems)


def test_files_stay_short():
    problems = long_files()
    assert not problems, "\n".join(problems)


# ------------------------------------------------- the checker, on toy trees ---


def _toy(tmp_path: Path, sources: dict[str, str]) -> list[Import]:
    """The imports of a tree of `sources` (path -> text); each folder gets an empty __init__.py
    unless `sources` gives one."""
    for rel in list(sources):
        for folder in Path(rel).parents[:-1]:
            sources.setdefault(f"{folder}/__init__.py", "")
    for rel, text in sources.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return collect_imports(project_files(tmp_path), tmp_path)


@pytest.mark.parametrize(("sources", "expected"), [
    pytest.param({"engine/a.py": "from engine.b import X\n",
                  "engine/b.py": "def f():\n    from engine import a\n"},
                 ["engine.a, engine.b", "engine/b.py:2", "inside a function"], id="lazy import"),
    pytest.param({"tuner/a.py": "from tuner.b import f\n",
                  "tuner/b.py": ("from typing import TYPE_CHECKING\n"
                                 "if TYPE_CHECKING:\n    from tuner.a import A\n")},
                 ["tuner.a, tuner.b", "tuner/b.py:3", "type-checking only"], id="type-only import"),
    # __init__ re-exports from a submodule that reads a sibling off the package
    pytest.param({"bench/report/__init__.py": "from bench.report.build import build\n",
                  "bench/report/build.py": "from bench.report import figures\n",
                  "bench/report/figures.py": ""},
                 ["bench.report, bench.report.build:"], id="package init"),
])
def test_checker_finds_a_module_cycle(tmp_path, sources, expected):
    (problem,) = module_cycle_violations(_toy(tmp_path, sources))
    assert all(part in problem for part in expected), problem


def test_checker_finds_a_cycle_between_engine_parts_but_not_inside_one(tmp_path):
    imports = _toy(tmp_path, {
        "engine/step/core.py": ("from engine.speculation.proposers import P\n"
                                "from engine.step import chooser\n"),
        "engine/step/chooser.py": "",
        "engine/step/sequence.py": "",
        "engine/speculation/proposers.py": "def f():\n    from engine.step.sequence import S\n",
    })
    assert not module_cycle_violations(imports)
    (problem,) = engine_part_cycle_violations(imports)
    assert "engine parts engine.speculation, engine.step" in problem
    assert "engine/speculation/proposers.py:2" in problem and "engine.step.chooser" not in problem


def test_checker_resolves_relative_and_submodule_imports(tmp_path):
    imports = _toy(tmp_path, {
        "store/models.py": "",
        "store/db.py": "from . import models\nfrom .models import Base\n",
        "daemon/x.py": "import store.db\nfrom store import db, models\n",
    })
    got = sorted((i.source, i.target, i.line) for i in imports)
    assert got == [("daemon.x", "store", 2), ("daemon.x", "store.db", 1), ("daemon.x", "store.db", 2),
                   ("daemon.x", "store.models", 2), ("store.db", "store", 1), ("store.db", "store.models", 1),
                   ("store.db", "store.models", 2)]


def test_checker_flags_wrong_directions(tmp_path):
    imports = _toy(tmp_path, {
        "engine/step/core.py": "from store import db\n",
        "store/db.py": "",
        "tuner/x.py": "from engine.policy import P\nfrom engine.step.core import C\n",
        "engine/policy.py": "",
        "bench/x.py": "import cli.main\n",
        "cli/main.py": "import daemon.other\n",
        "daemon/other.py": "def f():\n    import bench\n",
    })
    problems = direction_violations(imports)
    assert len(problems) == 5, problems  # `from store import db` reads store/__init__ and loads store.db
    assert any(p.startswith("engine/step/core.py:1 engine.step.core -> store.db") and "nothing of ours" in p
               for p in problems)
    assert any(p.startswith("engine/step/core.py:1 engine.step.core -> store:") for p in problems)
    assert any(p.startswith("tuner/x.py:2 tuner.x -> engine.step.core") for p in problems)
    assert any(p.startswith("daemon/other.py:2") for p in problems)
    assert any(p.startswith("bench/x.py:1 bench.x -> cli.main") for p in problems)


def test_checker_flags_the_command_lines_eager_tool_imports(tmp_path):
    imports = _toy(tmp_path, {
        "bench/__init__.py": "",
        "training/__init__.py": "",
        "cli/commands/bench.py": "import bench\n\ndef run():\n    import bench\n    import training\n",
    })
    assert not direction_violations(imports)
    (problem,) = eager_tool_imports(imports)
    assert problem.startswith("cli/commands/bench.py:1 cli.commands.bench -> bench:")


def test_checker_finds_package_cycles_through_lazy_imports(tmp_path):
    imports = _toy(tmp_path, {
        "telemetry/__init__.py": "import store\n",
        "store/__init__.py": "def f():\n    import telemetry\n",
    })
    (problem,) = package_cycle_violations(imports)
    assert "packages store, telemetry" in problem and "store/__init__.py:2" in problem


def test_checker_measures_file_length(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "big.py").write_text("x = 1\n" * 451)
    (tmp_path / "engine" / "ok.py").write_text("x = 1\n" * 450)
    assert long_files(tmp_path, ("engine",)) == [
        "engine/big.py: 451 lines (limit 450): split it by what it does"
    ]
