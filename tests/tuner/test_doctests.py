"""The worked examples in the tuner's docstrings (STYLE 7) stay true."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["tuner.model", "tuner.traffic", "tuner.objective", "tuner.exact", "tuner.validate",
           "tuner.explore", "engine.fake"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
