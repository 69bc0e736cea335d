"""`crossover serve`'s flags: each reaches its setting (beside its CROSSOVER_* variable), vLLM's
spellings work, bad values exit 2 naming the setting, and --help shows the defaults."""

from __future__ import annotations

import argparse
import dataclasses
from importlib.metadata import version
from typing import Any

import pytest

from cli.commands import serve
from cli.main import main
from daemon.settings import Settings, field_docs, load_settings
from tuner.config import TunerConfig


@pytest.fixture
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p


def settings_of(parser: argparse.ArgumentParser, *argv: str) -> Settings:
    """The settings `crossover serve ARGV` asks for (no environment, no file)."""
    args = parser.parse_args(list(argv))
    assert serve._vllm_spellings(args) is None
    return load_settings({k: getattr(args, k) for k in serve.SETTING_FLAGS}, env={})


@pytest.mark.parametrize("argv, env, field, from_flag, from_env, default", [
    (["--no-prefix-cache"], {"CROSSOVER_PREFIX_CACHE": "off"}, "prefix_cache", False, False, True),
    (["--instance", "gpu-3"], {"CROSSOVER_INSTANCE": "east"}, "instance", "gpu-3", "east", None),
    (["--tensor-parallel", "2"], {"CROSSOVER_TENSOR_PARALLEL": "4"}, "tensor_parallel", 2, 4, 1),
    (["--weights", "gguf"], {"CROSSOVER_WEIGHTS": "int8"}, "weights", "gguf", "int8", None),
    (["--memory-budget", "6GiB"], {"CROSSOVER_MEMORY_BUDGET_BYTES": "3GiB"}, "memory_budget_bytes",
     6 << 30, 3 << 30, None),
])
def test_a_serve_flag_and_its_variable_reach_the_setting(parser: argparse.ArgumentParser, argv: list[str],
                                                         env: dict[str, str], field: str, from_flag: Any,
                                                         from_env: Any, default: Any) -> None:
    assert getattr(settings_of(parser, *argv), field) == from_flag
    assert getattr(load_settings({}, env=env), field) == from_env
    assert getattr(load_settings({}, env={}), field) == default


def test_serve_flags_map_onto_settings_and_bad_values_exit_2(parser: argparse.ArgumentParser,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    s = settings_of(parser, "--kv-budget", "2GiB", "--no-tuner", "--drain-deadline", "3", "--open",
                    "--tuner-interval", "5", "--tuner-trials", "9", "--tuner-ranges", "4,64",
                    "--no-tuner-search-process", "--stream-write-timeout", "7",
                    "--stream-idle-timeout", "8", "--tenant-max-concurrent-share", "0.25",
                    "--admin-token", "t", "--metrics-require-admin")
    assert (s.kv_budget_bytes, s.tuner.enabled, s.drain_deadline_s,
            s.open_mode) == (2 << 30, False, 3.0, True)
    assert (s.tuner.interval_s, s.tuner.trials, s.tuner.ranges) == (5.0, 9, (4, 64))
    assert s.tuner.search_process is False and s.tuner.min_new_steps == TunerConfig().min_new_steps
    assert (s.stream_write_timeout_s, s.stream_idle_timeout_s, s.tenant_max_concurrent_share) == (7, 8, 0.25)
    assert s.metrics_require_admin and s.admin_token == "t" and not s.open_non_loopback
    assert "--fake-engine" not in parser.format_help()

    bad = parser.parse_args(["--max-batch", "0"])
    assert serve.run(bad) == 2
    assert "max_batch" in capsys.readouterr().err


def test_every_tuner_field_has_a_flag_with_its_docstring_as_help(parser: argparse.ArgumentParser) -> None:
    text = " ".join(parser.format_help().split())
    for f in dataclasses.fields(TunerConfig):
        flag = {"enabled": "--tuner", "interval_s": "--tuner-interval"}.get(
            f.name, "--tuner-" + f.name.replace("_", "-"))
        assert flag in text and "tuner_" + f.name in serve.SETTING_FLAGS
    docs = field_docs(TunerConfig)
    assert docs["interval_s"] == "Seconds between scheduled retunes"
    assert docs["min_new_steps"].endswith("(tuner.data.count_step_rows)")  # cut at ": " outside ()
    assert f"{docs['trials']} (default 48)" in text


def test_vllm_spellings_of_serve_flags(parser: argparse.ArgumentParser,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`crossover serve MODEL`, --served-model-name, --max-model-len and --max-num-seqs as vLLM
    spells them; the old spellings keep working; defaults show in --help."""
    s = settings_of(parser, "some/model.gguf", "--served-model-name", "gemma", "g3", "--max-model-len",
                    "2048", "--max-num-seqs", "16")
    assert (s.model, s.served_model_name, s.max_context, s.max_batch) == ("some/model.gguf", "gemma,g3", 2048,
                                                                          16)
    assert s.served_names("engine-name") == ("gemma", "g3")
    assert settings_of(parser, "--max-num-batched-tokens", "2048").token_budget == 2048
    assert settings_of(parser, "--token-budget", "1024").token_budget == 1024
    assert serve.run(parser.parse_args(["--token-budget", "0"])) == 2
    assert "token_budget" in capsys.readouterr().err
    s = settings_of(parser, "--model", "m", "--max-context", "1024", "--max-batch", "8")
    assert (s.model, s.max_context, s.max_batch,
            s.served_names("engine-name")) == ("m", 1024, 8, ("engine-name",))
    for argv, says in ((["a", "--model", "b"], "given twice"),
                       (["--served-model-name", "x,y"], "without commas"),
                       (["--served-model-name", "x", "x"], "distinct")):
        assert serve.run(parser.parse_args(argv)) == 2
        assert says in capsys.readouterr().err
    shown = " ".join(parser.format_help().split())  # unwrapped
    assert "(default 32)" in shown and "(default 4096)" in shown and "(default 256)" in shown


def test_crossover_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"crossover {version('crossover')}"
