"""The bench tests build tiny engines with the engine tests' fixtures and live daemons with the
daemon tests' one."""

from tests.daemon.conftest import live  # noqa: F401  (pytest fixture)
from tests.engine.conftest import _compile_cache, tiny  # noqa: F401  (pytest fixtures)
