"""Text sources for the traffic generator: the running interpreter's stdlib.

Only `.py` files that exist under `sysconfig.get_paths()["stdlib"]` are read,
in the fixed order of `MODULES`; a file that is missing, unreadable or does not
parse is skipped, so any CPython 3.11+ install yields a corpus (larger or
smaller) and the same install always yields the same one.
"""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

MODULES: tuple[str, ...] = (
    "textwrap.py", "json/__init__.py", "json/decoder.py", "json/encoder.py", "collections/__init__.py",
    "argparse.py", "difflib.py", "statistics.py", "string.py", "fractions.py", "shlex.py", "heapq.py",
    "bisect.py", "functools.py", "calendar.py", "ipaddress.py", "pprint.py", "fnmatch.py", "glob.py",
    "random.py", "_pydatetime.py", "datetime.py", "enum.py", "dataclasses.py", "csv.py", "contextlib.py",
    "copy.py", "queue.py", "sched.py", "gettext.py", "base64.py", "colorsys.py", "html/__init__.py",
    "urllib/parse.py", "email/utils.py", "posixpath.py", "shutil.py", "tempfile.py", "configparser.py",
    "logging/__init__.py", "threading.py", "inspect.py", "typing.py", "_pydecimal.py", "numbers.py",
    "graphlib.py", "reprlib.py", "traceback.py", "getopt.py", "optparse.py", "cmd.py", "secrets.py",
    "uuid.py", "mimetypes.py", "plistlib.py", "timeit.py", "zipfile.py", "zipfile/__init__.py",
    "pathlib.py", "pathlib/__init__.py", "operator.py", "weakref.py", "locale.py", "quopri.py",
)
"""Candidate files, relative to the stdlib directory; absent ones are skipped."""

_ALIASES = {"_pydatetime": "datetime", "_pydecimal": "decimal"}


@dataclass(frozen=True)
class Definition:
    """A function or class of a module: where it is and what its docstring says."""

    qualname: str
    """"name" at top level, "Class.method" for methods."""
    is_class: bool
    top_level: bool
    lineno: int
    """1-based line of the `def`/`class` keyword (decorators excluded)."""
    end_lineno: int
    docstring: str | None
    """Cleaned by `ast.get_docstring`."""
    body_lines: tuple[int, ...]
    """First line of each body statement after the docstring."""

    @property
    def name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def public(self) -> bool:
        return not any(part.startswith("_") for part in self.qualname.split("."))


@dataclass(frozen=True)
class Module:
    """What the generator needs of one stdlib file (the syntax tree is not kept)."""

    path: str
    """Relative to the stdlib directory, e.g. "json/__init__.py"."""
    name: str
    """Dotted import name, e.g. "json"."""
    text: str
    lines: tuple[str, ...]
    """`text.split("\\n")`: raw lines, so joined slices are verbatim substrings."""
    doc: str | None
    """The cleaned module docstring."""
    doc_span: tuple[int, int] | None
    """1-based inclusive lines of the module docstring's body (the quote lines excluded)."""
    defs: tuple[Definition, ...]
    """Functions and classes in source order, methods included (one level of classes)."""

    def segment(self, first: int, last: int) -> str:
        """Lines first..last (1-based, inclusive) exactly as in the file."""
        return "\n".join(self.lines[first - 1:last])


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _dotted(path: str) -> str:
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(_ALIASES.get(p, p) for p in parts)


_DefNode = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _definition(node: _DefNode, qualname: str, top_level: bool) -> Definition:
    doc = ast.get_docstring(node)
    body = node.body[1:] if doc is not None else node.body
    return Definition(qualname, isinstance(node, ast.ClassDef), top_level, node.lineno,
                      node.end_lineno or node.lineno, doc, tuple(s.lineno for s in body))


def _definitions(tree: ast.Module) -> Iterator[Definition]:
    for node in tree.body:
        if isinstance(node, _DefNode):
            yield _definition(node, node.name, top_level=True)
        if isinstance(node, ast.ClassDef):
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield _definition(child, f"{node.name}.{child.name}", top_level=False)


def _doc_span(tree: ast.Module) -> tuple[int, int] | None:
    body = tree.body
    if not body or not isinstance(body[0], ast.Expr):
        return None
    value = body[0].value
    if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
        return None
    first, last = value.lineno + 1, (value.end_lineno or value.lineno) - 1
    return (first, last) if last >= first else None


def _load(root: Path, rel: str) -> Module | None:
    file = root / rel
    if not file.is_file():
        return None
    try:
        text = file.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(file))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    lines = tuple(text.split("\n"))
    return Module(rel, _dotted(rel), text, lines, ast.get_docstring(tree), _doc_span(tree),
                  tuple(_definitions(tree)))


@lru_cache(maxsize=4)
def load_modules(root: str | None = None) -> tuple[Module, ...]:
    """Every readable module of `MODULES` under `root` (default: this interpreter's stdlib).

    Only plain records are kept: holding dozens of syntax trees would make every
    full garbage collection walk millions of nodes.
    """
    base = Path(root) if root is not None else stdlib_dir()
    loaded = (_load(base, rel) for rel in MODULES)
    return tuple(m for m in loaded if m is not None)
