"""The training tests build tiny engines with the engine tests' fixtures."""

from tests.engine.conftest import _compile_cache, tiny  # noqa: F401  (pytest fixtures)
