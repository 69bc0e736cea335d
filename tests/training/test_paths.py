"""Where head training writes and which heads file the loader reads, without the real model:
an explicit path first, then the user cache's file for the model, then the packaged one."""

from __future__ import annotations

from pathlib import Path

import pytest

import engine
from engine.config import GEMMA3_270M
from engine.loader import _load_heads, find_heads, heads_cache_path
from engine.speculation.heads import DraftHeads, default_heads_path
from tests.engine.conftest import make_engine
from tests.engine.tiny import tiny_config
from training.heads import output_path

PACKAGE = Path(engine.__file__).parent


@pytest.fixture()
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user cache under XDG_CACHE_HOME (CROSSOVER_CACHE unset)."""
    monkeypatch.delenv("CROSSOVER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "crossover"


def test_training_writes_where_told_else_to_the_user_cache_never_the_package(xdg, tmp_path, monkeypatch):
    default = output_path(None, "gemma3-270m")
    assert default == xdg / "heads" / "gemma3-270m.safetensors"
    assert PACKAGE not in default.parents
    assert output_path(tmp_path / "mine.safetensors", "gemma3-270m") == tmp_path / "mine.safetensors"
    assert output_path("~/h.safetensors", "x") == Path.home() / "h.safetensors"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert output_path(None, "m") == tmp_path / "home" / ".cache" / "crossover" / "heads" / "m.safetensors"
    monkeypatch.setenv("CROSSOVER_CACHE", str(tmp_path / "own"))
    assert heads_cache_path("m") == tmp_path / "own" / "heads" / "m.safetensors"


def test_the_loader_prefers_a_given_file_then_the_user_cache_then_the_package(xdg, tmp_path):
    cfg = GEMMA3_270M  # the model whose heads ship in engine/data
    packaged = default_heads_path(cfg)
    assert packaged.is_file() and PACKAGE in packaged.parents
    assert find_heads(None, cfg) == (packaged, "packaged")
    cached = heads_cache_path(cfg.name)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"trained here")
    assert find_heads(None, cfg) == (cached, "user cache")
    given = tmp_path / "given.safetensors"
    assert find_heads(str(given), cfg) == (given, "given")  # even missing: loading then names it
    assert find_heads(None, tiny_config()) == (None, "none")  # nothing trained, nothing shipped


def test_the_engine_line_says_which_heads_file_it_loaded(xdg, tiny, capsys):
    engine = make_engine(tiny)
    _load_heads(engine, None, "float32", True)
    assert "no draft heads for tiny" in capsys.readouterr().err and set(engine.proposers) == {"ngram"}
    DraftHeads.random(tiny[0], 2, (2,), 128, seed=1).save(heads_cache_path("tiny"))
    _load_heads(engine, None, "float32", True)
    err = capsys.readouterr().err
    assert f"engine: draft heads {heads_cache_path('tiny')} (user cache, " in err
    assert {"mtp", "early_exit"} <= set(engine.proposers)
    quiet = make_engine(tiny)
    _load_heads(quiet, None, "float32", False)
    assert capsys.readouterr().err == "" and "mtp" in quiet.proposers
