"""bench/llamacpp_baseline.py: its flags, its message without llama_cpp, and its greedy loop and JSON
over a stand-in `llama_cpp` (the real one is built from source outside CI: bench/README.md)."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from bench import llamacpp_baseline as lb

VOCAB = 50


class _Llama:
    """Last logits that make the argmax after token t be t + 1 (mod VOCAB)."""

    def __init__(self, **kw) -> None:
        self.kw, self.n_tokens = kw, 0
        self.ctx = np.zeros(VOCAB, np.float32)

    def n_vocab(self) -> int:
        return VOCAB

    def reset(self) -> None:
        self.n_tokens = 0

    def eval(self, ids: list[int]) -> None:
        self.n_tokens += len(ids)
        self.ctx[:] = 0
        self.ctx[(ids[-1] + 1) % VOCAB] = 1

    def tokenize(self, text: bytes, add_bos: bool = True) -> list[int]:
        return [2, 7, 9]

    def token_bos(self) -> int:
        return 2


@pytest.fixture
def fake_llama(monkeypatch):
    mod = types.SimpleNamespace(Llama=_Llama, __version__="test",
                                llama_print_system_info=lambda: b"AVX2 = 1 | ",
                                llama_get_logits_ith=lambda ctx, i: np.ctypeslib.as_ctypes(ctx))
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    return mod


def test_greedy_tokens_follow_the_logits_and_the_json_says_what_ran(fake_llama, tmp_path, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([2, 10, 11]))
    out = lb.main(["--gguf", "model.gguf", "--new-tokens", "5", "--repeats", "2", "--prompt-ids", str(ids),
                   "--prefill-tokens", "16", "--threads", "3", "--out", str(tmp_path / "r.json")])
    assert out["decode"]["token_ids"] == [12, 13, 14, 15, 16]
    assert out["decode"]["prompt_tokens"] == 3 and len(out["decode"]["runs_tokens_per_s"]) == 2
    assert out["decode"]["tokens_per_s"] == max(out["decode"]["runs_tokens_per_s"]) > 0
    assert out["prefill"]["prompt_tokens"] == 16 and len(out["prefill"]["runs"]) == 2
    assert out["threads"] == 3 and out["system_info"] == "AVX2 = 1 |"
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(capsys.readouterr().out)


def test_the_default_prompt_is_tokenized_and_prefill_can_be_skipped(fake_llama):
    out = lb.main(["--gguf", "m.gguf", "--new-tokens", "2", "--repeats", "1", "--skip-prefill"])
    assert out["decode"]["prompt_tokens"] == 3 and out["decode"]["token_ids"] == [10, 11]
    assert "prefill" not in out


@pytest.mark.parametrize("flag", ["--new-tokens", "--repeats", "--prefill-tokens"])
def test_counts_below_one_name_the_flag(fake_llama, flag, capsys):
    with pytest.raises(SystemExit):
        lb.main(["--gguf", "m.gguf", flag, "0"])
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


def test_without_llama_cpp_it_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(SystemExit):
        lb.main(["--gguf", "m.gguf"])
    assert "llama_cpp is not installed" in capsys.readouterr().err
