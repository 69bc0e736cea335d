"""Settings: flags > environment > TOML > defaults; bad values name key and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.settings import Settings, SettingsError, load_settings
from tuner.config import TunerConfig


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "crossover.toml"
    path.write_text(text)
    return str(path)


def test_defaults() -> None:
    s = load_settings({}, env={})
    assert s == Settings()
    assert (s.host, s.port, s.max_batch, s.is_open) == ("127.0.0.1", 8000, 32, True)


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = write(tmp_path, 'port = 7000\nmax_batch = 4\nmax_context = 1024\nlog_level = "debug"\n')
    env = {"CROSSOVER_PORT": "7100", "CROSSOVER_MAX_BATCH": "8"}
    s = load_settings({"port": 7200, "max_batch": None}, env=env, config_path=path)
    assert s.port == 7200  # flag
    assert s.max_batch == 8  # env (the flag was not given)
    assert s.max_context == 1024  # file
    assert s.max_waiting == Settings().max_waiting  # default
    assert s.log_level == "debug"


def test_config_path_from_flags_or_env(tmp_path: Path) -> None:
    path = write(tmp_path, "max_waiting = 3\n")
    assert load_settings({"config": path}, env={}).max_waiting == 3
    assert load_settings({}, env={"CROSSOVER_CONFIG": path}).max_waiting == 3


def test_env_parsing_of_bools_sizes_floats_and_none() -> None:
    env = {"CROSSOVER_TUNER_ENABLED": "off", "CROSSOVER_KV_BUDGET_BYTES": "1.5GiB",
           "CROSSOVER_MAX_BODY_BYTES": "64KiB", "CROSSOVER_DRAIN_DEADLINE_S": "2.5",
           "CROSSOVER_OPEN_MODE": "none", "CROSSOVER_DTYPE": "bfloat16"}
    s = load_settings({}, env=env)
    assert s.tuner.enabled is False
    assert s.kv_budget_bytes == int(1.5 * (1 << 30))
    assert s.max_body_bytes == 64 * 1024
    assert s.drain_deadline_s == 2.5
    assert s.open_mode is None and s.dtype == "bfloat16"


@pytest.mark.parametrize(
    "flags,env,toml,words",
    [
        ({}, {"CROSSOVER_PORT": "eighty"}, None, ["port", "'eighty'", "CROSSOVER_PORT"]),
        ({}, {"CROSSOVER_TUNER_ENABLED": "maybe"}, None, ["tuner.enabled", "'maybe'"]),
        ({}, {"CROSSOVER_TUNER": "off"}, None, ["CROSSOVER_TUNER_ENABLED"]),  # renamed
        ({}, {"CROSSOVER_TUNER_TRIALS": "0"}, None, ["[tuner]", "trials=0"]),
        ({"tuner_explore_share": "0.9"}, {}, None, ["explore_share=0.9", "0.5"]),
        ({}, {"CROSSOVER_TUNER_RANGES": "2,x"}, None, ["tuner.ranges", "'2,x'", "integers"]),
        ({}, {"CROSSOVER_KV_BUDGET_BYTES": "lots"}, None, ["kv_budget_bytes", "'lots'"]),
        ({"kv_budget_bytes": "2GiB", "memory_budget_bytes": "4GiB"}, {}, None,
         ["kv_budget_bytes", "memory_budget_bytes", "not both"]),
        ({"memory_budget_bytes": "0"}, {}, None, ["memory_budget_bytes", "0"]),
        ({"port": 70000}, {}, None, ["port", "70000"]),
        ({"max_batch": 0}, {}, None, ["max_batch", "0"]),
        ({"log_level": "loud"}, {}, None, ["log_level", "'loud'"]),
        ({}, {}, 'max_batch = "many"\n', ["max_batch", "'many'", "crossover.toml"]),
        ({}, {}, "tuner = 1\n", ["tuner", "1", "[tuner] table", "enabled"]),
        ({}, {}, "tuner_trials = 8\n", ["tuner_trials", "[tuner] table"]),
        ({}, {}, "[tuner]\ntrails = 8\n", ["trails", "[tuner]"]),
        ({}, {}, '[tuner]\ntrials = "many"\n', ["tuner.trials", "'many'", "crossover.toml"]),
        ({}, {}, "prot = 1\n", ["prot"]),
        ({}, {}, "port = \n", ["not valid TOML"]),
    ],
)
def test_bad_values_name_the_key_and_value(
    tmp_path: Path, flags: dict, env: dict, toml: str | None, words: list[str]
) -> None:
    path = write(tmp_path, toml) if toml is not None else None
    with pytest.raises(SettingsError) as info:
        load_settings(flags, env=env, config_path=path)
    for word in words:
        assert word in str(info.value)


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings({}, env={}, config_path=str(tmp_path / "nope.toml"))


@pytest.mark.parametrize(
    "host,open_mode,expected",
    [("127.0.0.1", None, True), ("localhost", None, True), ("::1", None, True),
     ("0.0.0.0", None, False), ("10.1.2.3", None, False), ("0.0.0.0", True, True),
     ("127.0.0.1", False, False)],
)
def test_open_mode_defaults_to_loopback_only(host: str, open_mode: bool | None, expected: bool) -> None:
    assert Settings(host=host, open_mode=open_mode, open_non_loopback=True).is_open is expected


def test_open_mode_on_a_public_host_needs_a_second_flag() -> None:
    with pytest.raises(SettingsError, match="open_non_loopback"):
        Settings(host="0.0.0.0", open_mode=True)
    with pytest.raises(SettingsError, match="10.1.2.3"):
        load_settings({"host": "10.1.2.3"}, env={"CROSSOVER_OPEN_MODE": "1"})
    assert load_settings({"host": "0.0.0.0", "open_mode": True, "open_non_loopback": True}, env={}).is_open
    assert Settings(host="::1", open_mode=True).is_open  # loopback: no second flag needed
    assert not Settings(host="0.0.0.0").is_open  # keys required: nothing to accept


def test_the_admin_token_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text("s3cret-from-file\nignored second line\n")
    s = load_settings({"admin_token_file": str(token_file)}, env={})
    assert s.admin_token == "s3cret-from-file"
    assert load_settings({}, env={"CROSSOVER_ADMIN_TOKEN_FILE": str(token_file)}).admin_token == \
        "s3cret-from-file"
    assert load_settings({}, env={"CROSSOVER_ADMIN_TOKEN": "from-env"}).admin_token == "from-env"
    with pytest.raises(SettingsError, match="not both"):
        load_settings({"admin_token_file": str(token_file)}, env={"CROSSOVER_ADMIN_TOKEN": "x"})
    with pytest.raises(SettingsError, match="cannot read admin_token_file"):
        load_settings({"admin_token_file": str(tmp_path / "missing")}, env={})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SettingsError, match="is empty"):
        load_settings({"admin_token_file": str(tmp_path / "empty")}, env={})


def test_metrics_behind_the_admin_token_needs_a_token() -> None:
    with pytest.raises(SettingsError, match="metrics_require_admin"):
        Settings(metrics_require_admin=True)
    assert Settings(metrics_require_admin=True, admin_token="t").metrics_require_admin


def test_stream_timeouts_and_the_tenant_share_are_range_checked() -> None:
    s = load_settings({}, env={"CROSSOVER_STREAM_WRITE_TIMEOUT_S": "2.5",
                               "CROSSOVER_TENANT_MAX_CONCURRENT_SHARE": "none"})
    assert (s.stream_write_timeout_s, s.stream_idle_timeout_s) == (2.5, 60.0)
    assert s.tenant_max_concurrent_share is None and s.tenant_default_max_concurrent is None
    for bad in ({"stream_write_timeout_s": 0.0}, {"stream_idle_timeout_s": -1.0},
                {"tenant_max_concurrent_share": 1.5}, {"tenant_max_concurrent_share": 0.0}):
        with pytest.raises(SettingsError, match=next(iter(bad))):
            Settings(**bad)


def test_settings_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Settings().port = 1  # type: ignore[misc]


def test_the_tuner_section_loads_through_every_layer(tmp_path: Path) -> None:
    path = write(tmp_path, "port = 7000\n[tuner]\ntrials = 10\nvalidation_s = 30\nranges = [2, 16]\n"
                           "seed = 3\nenabled = false\n")
    env = {"CROSSOVER_TUNER_TRIALS": "11", "CROSSOVER_TUNER_FIT_WINDOW_S": "900",
           "CROSSOVER_TUNER_SEED": "none"}
    s = load_settings({"tuner_validation_s": "45", "tuner_trials": None}, env=env, config_path=path)
    assert s.port == 7000 and s.tuner.trials == 11  # env over file
    assert s.tuner.validation_s == 45.0  # flag over file
    assert s.tuner.fit_window_s == 900.0 and s.tuner.seed is None  # env only, "none" for an optional
    assert s.tuner.ranges == (2, 16) and s.tuner.enabled is False  # file only
    assert s.tuner.baseline_s == TunerConfig().baseline_s  # default
    assert Settings(tuner=TunerConfig(trials=5)).tuner.trials == 5
