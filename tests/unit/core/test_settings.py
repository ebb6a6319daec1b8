import pytest
from pydantic import ValidationError

from flywheel.core.settings import ConfigFileError, load_settings


def test_defaults_follow_the_port_conventions():
    s = load_settings()
    assert (s.gateway.port, s.engine.port, s.reward.port, s.teacher.port) == (
        8000,
        30000,
        50051,
        50052,
    )
    assert s.redis.port == 6379
    assert s.streams.key("rollouts") == "flywheel:rollouts"
    assert s.next_stream_after_reward() == "flywheel:train"  # teacher disabled by default


def test_toml_file_then_environment_override(tmp_path, monkeypatch):
    cfg = tmp_path / "f.toml"
    cfg.write_text(
        '[trainer.optim]\nlr = 2e-5\n[trainer.batch]\ngroup_size = 4\n[streams]\nprefix = "exp1"\n'
    )
    monkeypatch.setenv("FLYWHEEL_TRAINER__OPTIM__LR", "3e-6")
    s = load_settings(cfg)
    assert s.trainer.optim.lr == 3e-6  # environment wins over the file
    assert s.trainer.batch.group_size == 4  # the file wins over the default
    assert s.streams.key("train") == "exp1:train"


def test_unknown_keys_and_bad_values_are_refused(tmp_path):
    cfg = tmp_path / "f.toml"
    cfg.write_text("[trainer.optim]\nlr = -1\n")
    with pytest.raises(ValidationError, match="lr"):
        load_settings(cfg)
    cfg.write_text("[trainer.optim]\nlearning_rate = 1e-5\n")
    with pytest.raises(ValidationError, match="learning_rate"):
        load_settings(cfg)
    cfg.write_text("[nonsense]\nx = 1\n")
    with pytest.raises(ConfigFileError, match="nonsense"):
        load_settings(cfg)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_settings(tmp_path / "absent.toml")


def test_misspelled_section_key_is_refused_in_file_and_environment(tmp_path, monkeypatch):
    cfg = tmp_path / "f.toml"
    cfg.write_text("[reward]\nmetric_port = 9100\n")
    with pytest.raises(ValidationError, match="metric_port"):
        load_settings(cfg)
    monkeypatch.setenv("FLYWHEEL_TRAINER__LEARNING_RATE", "1e-5")
    with pytest.raises(ValidationError, match="learning_rate"):
        load_settings()


@pytest.mark.parametrize("name", ["FLYWHEEL_GATWAY__PORT", "FLYWHEEL_TRIANER__OPTIM__LR"])
def test_misspelled_section_in_environment_is_refused(monkeypatch, name):
    """pydantic-settings reads only known names, so a misspelled SECTION would change nothing."""
    from flywheel.core.settings import ConfigFileError

    monkeypatch.setenv(name, "5")
    with pytest.raises(ConfigFileError, match=name) as info:
        load_settings()
    assert "known sections: engine, fleet, gateway" in str(info.value)


def test_misspelled_section_in_a_config_file_names_the_known_ones(tmp_path):
    from flywheel.core.settings import ConfigFileError

    path = tmp_path / "flywheel.toml"
    path.write_text("state_dir = '.flywheel'\n[gatway]\nport = 8001\n")
    with pytest.raises(ConfigFileError) as info:
        load_settings(path)
    text = str(info.value)
    assert f"config file {path}: no settings section 'gatway'" in text
    assert "known sections: engine, fleet, gateway" in text and "state_dir" in text
    path.write_text("state_dir = '.flywheel'\n[gateway]\nport = 8001\n")
    assert load_settings(path).gateway.port == 8001


def test_non_setting_flywheel_variables_are_left_alone(monkeypatch):
    """Only FLYWHEEL_<SECTION>__... names are settings; FLYWHEEL_CONFIG-like names are not."""
    for name in ("FLYWHEEL_PEERS_DIR", "FLYWHEEL_CONTAINER_TESTS", "FLYWHEEL_TAG"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("FLYWHEEL_GATEWAY__PORT", "8123")
    assert load_settings().gateway.port == 8123


@pytest.mark.parametrize(
    ("name", "setting", "fixed"),
    [
        ("FLYWHEEL_GATEWAY_PORT", "gateway.port", "FLYWHEEL_GATEWAY__PORT"),
        ("FLYWHEEL_TRAINER_OPTIM__LR", "trainer.optim", "FLYWHEEL_TRAINER__OPTIM__LR"),
        ("flywheel_engine_threads", "engine.threads", "FLYWHEEL_ENGINE__THREADS"),
    ],
)
def test_one_underscore_after_the_section_is_refused_naming_the_spelling(
    monkeypatch, name, setting, fixed
):
    """pydantic-settings reads FLYWHEEL_GATEWAY__PORT only: FLYWHEEL_GATEWAY_PORT would change
    nothing without a word."""
    monkeypatch.setenv(name, "5")
    with pytest.raises(ConfigFileError) as info:
        load_settings()
    assert f"{name}: not read; the setting {setting} is {fixed}" in str(info.value)


def test_compose_variables_and_top_level_settings_are_not_taken_for_misspellings(monkeypatch):
    """docker-compose.yml reads FLYWHEEL_TEACHER_ENABLED itself; FLYWHEEL_STATE_DIR is the
    top-level setting state_dir; FLYWHEEL_STREAM_PREFIX (compose's) names no section."""
    for name in (
        "FLYWHEEL_TEACHER_ENABLED",
        "FLYWHEEL_TEACHER_ENGINE_URLS",
        "FLYWHEEL_STREAM_PREFIX",
    ):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("FLYWHEEL_STATE_DIR", "/tmp/elsewhere")
    settings = load_settings()
    assert settings.state_dir == "/tmp/elsewhere" and settings.teacher.enabled is False


def test_cli_names_a_misspelled_section_variable(monkeypatch):
    from flywheel.ops.cli import main

    monkeypatch.setenv("FLYWHEEL_GATWAY__PORT", "5")
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "show"])
    assert "FLYWHEEL_GATWAY__PORT" in str(exit_info.value) and "gateway" in str(exit_info.value)


def test_engine_call_timeout_above_whole_request_limit_is_refused():
    """An engine call may not outlast the request it serves (900 s whole-request default)."""
    with pytest.raises(ValidationError) as info:
        load_settings(gateway={"request_timeout_s": 1800})
    text = str(info.value)
    assert "gateway.request_timeout_s" in text and "gateway.security.request_timeout_s" in text
    raised = load_settings(
        gateway={"request_timeout_s": 1800, "security": {"request_timeout_s": 1800}}
    )
    assert raised.gateway.request_timeout_s == 1800
    unbounded = load_settings(
        gateway={"request_timeout_s": 1800, "security": {"request_timeout_s": 0}}
    )
    assert unbounded.gateway.request_timeout_s == 1800
    # a whole-request limit below the default engine timeout (300 s) is what the user asked
    # for: it ends the request first, so it loads
    tight = load_settings(gateway={"security": {"request_timeout_s": 0.2}})
    assert tight.gateway.security.request_timeout_s == 0.2
    with pytest.raises(ValidationError):  # but an engine timeout chosen above it is refused
        load_settings(gateway={"request_timeout_s": 1, "security": {"request_timeout_s": 0.2}})


def test_enabling_the_teacher_puts_it_between_reward_and_trainer():
    s = load_settings(teacher={"enabled": True})
    assert s.next_stream_after_reward() == "flywheel:scored"
    with pytest.raises(ValidationError, match="selection"):
        load_settings(teacher={"hint_judge": {"selection": "shortest"}})


def test_cli_reports_bad_settings_without_a_traceback(monkeypatch, capsys):
    from flywheel.ops.cli import main

    monkeypatch.setenv("FLYWHEEL_TRAINER__OPTIM__LR", "abc")
    with pytest.raises(SystemExit) as exit_info:
        main(["config", "show"])
    assert "invalid settings" in str(exit_info.value) and "lr" in str(exit_info.value)


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_numbers_are_refused(tmp_path, value):
    cfg = tmp_path / "f.toml"
    cfg.write_text(f"[trainer.optim]\nlr = {value}\n")  # TOML's own inf/nan literals
    with pytest.raises(ValidationError, match="finite number"):
        load_settings(cfg)


def test_a_redis_url_must_be_a_redis_url():
    with pytest.raises(ValidationError, match="'notaurl' is not a Redis URL"):
        load_settings(redis={"url": "notaurl"})
    for ok in (
        "redis://127.0.0.1:6379/0",
        "rediss://:pw@example.com:6380/0",
        "unix:///tmp/redis.sock",
    ):
        assert load_settings(redis={"url": ok}).redis.url == ok


@pytest.mark.parametrize("service", ["engine", "gateway", "reward", "teacher", "trainer"])
def test_service_entry_points_report_bad_settings_in_one_message(tmp_path, service):
    """`python -m flywheel.<service> --config F` with a bad value or a missing file ends with a
    message naming the field or the file (exit status 1), not a traceback."""
    import importlib  # noqa: PLC0415

    main = importlib.import_module(f"flywheel.{service}.main").main
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer.optim]\nlr = -1\n")
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(bad)])
    message = str(exited.value.code)  # sys.exit(str): printed to stderr, exit status 1
    assert message.startswith(f"flywheel-{service}: invalid settings") and "lr" in message
    with pytest.raises(SystemExit) as exited:
        main(["--config", str(tmp_path / "absent.toml")])
    assert str(exited.value.code) == (
        f"flywheel-{service}: config file not found: "
        f"{tmp_path / 'absent.toml'}. Pass an existing TOML, "
        "YAML or JSON file."
    )


def test_a_model_path_that_does_not_exist_is_named_before_loading(tmp_path):
    from flywheel.core.errors import ConfigurationError  # noqa: PLC0415
    from flywheel.core.paths import default_model_dir, resolve_model_path  # noqa: PLC0415
    from flywheel.engine.main import main  # noqa: PLC0415

    for missing in ("/nonexistent/model", "./no-such-dir", "~/no-such-dir-either"):
        with pytest.raises(ConfigurationError, match=f"model path {missing} does not exist"):
            resolve_model_path(missing)
    assert resolve_model_path(str(tmp_path)) == tmp_path
    assert (
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct").name == "SmolLM2-135M-Instruct"
    )  # a Hub id is left to the loader
    assert resolve_model_path("") == default_model_dir()
    cfg = tmp_path / "engine.toml"
    cfg.write_text('[engine]\nmodel_path = "/nonexistent/model"\n')
    with pytest.raises(SystemExit) as exited:  # the engine process: one line, exit status 1
        main(["--config", str(cfg)])
    assert str(exited.value.code).startswith(
        "flywheel-engine: model path /nonexistent/model does not exist"
    )


@pytest.mark.parametrize(
    "advantage", ["grpo", "dr_grpo", "rloo", "quantile", "opd_plus_rl", "zero_variance", "segment"]
)
def test_group_size_one_with_a_group_relative_advantage_is_refused(advantage):
    from flywheel.core.trainer_settings import TrainerSettings

    with pytest.raises(
        ValidationError, match=f"group-relative advantage '{advantage}'.*group_size >= 2"
    ):
        TrainerSettings(
            algorithm={"advantage": advantage}, batch={"group_size": 1, "min_group_size": 1}
        )


def test_group_size_one_is_fine_without_groups():
    from flywheel.core.trainer_settings import TrainerSettings

    s = TrainerSettings(
        algorithm={"advantage": "opd"}, batch={"group_size": 1, "min_group_size": 1}
    )
    assert s.batch.group_size == 1


def test_min_group_size_above_group_size_is_refused_saying_what_to_set(tmp_path):
    cfg = tmp_path / "f.toml"
    cfg.write_text("[trainer.batch]\ngroup_size = 4\nmin_group_size = 5\n")
    with pytest.raises(
        ValidationError, match="min_group_size = 5 > group_size = 4.*batch.min_group_size <= 4"
    ):
        load_settings(cfg)
    cfg.write_text("[trainer.batch]\ngroup_size = 4\nmin_group_size = 4\n")
    assert load_settings(cfg).trainer.batch.min_group_size == 4


def test_quantile_k_moved_to_the_part_parameters(tmp_path):
    cfg = tmp_path / "f.toml"
    cfg.write_text('[trainer.algorithm]\nadvantage = "quantile"\n[trainer]\nquantile_k = 0.3\n')
    with pytest.raises(
        ValidationError, match=r"quantile_k moved to trainer.algorithm.params.quantile.k"
    ):
        load_settings(cfg)
    cfg.write_text(
        '[trainer.algorithm]\nadvantage = "quantile"\n'
        "[trainer.algorithm.params.quantile]\nk = 0.3\n"
    )
    assert load_settings(cfg).trainer.algorithm.params == {"quantile": {"k": 0.3}}


def test_old_flat_trainer_keys_are_refused_naming_the_new_key(tmp_path, monkeypatch):
    cfg = tmp_path / "f.toml"
    cfg.write_text(
        '[trainer]\nport = 8101\nlr = 1e-5\ncheckpoint_every = 3\nstale_policy = "drop"\n'
    )
    with pytest.raises(ValidationError) as refused:
        load_settings(cfg)
    message = str(refused.value)
    assert "trainer.lr moved to trainer.optim.lr (FLYWHEEL_TRAINER__OPTIM__LR)" in message
    assert "trainer.checkpoint_every moved to trainer.checkpoint.every" in message
    assert "trainer.stale_policy moved to trainer.staleness.policy" in message
    assert "port" not in message.split("moved")[0]  # a key that stayed is not named
    monkeypatch.setenv("FLYWHEEL_TRAINER__PUSH_PAUSE", "in_place")  # the old variable
    with pytest.raises(ValidationError, match="trainer.push_pause moved to trainer.push.pause"):
        load_settings()
    monkeypatch.delenv("FLYWHEEL_TRAINER__PUSH_PAUSE")
    monkeypatch.setenv("FLYWHEEL_TRAINER__PUSH__PAUSE", "in_place")  # the new one takes effect
    assert load_settings().trainer.push.pause == "in_place"


def test_every_old_flat_key_has_a_new_home():
    from flywheel.core.trainer_settings import MOVED, TrainerSettings

    for old, new in MOVED.items():
        node: object = TrainerSettings()
        for part in new.split(".")[:2]:  # `algorithm.params.quantile.k` ends in a dict
            assert part in type(node).model_fields, f"{old} -> {new}"  # type: ignore[attr-defined]
            node = getattr(node, part)
        assert old not in TrainerSettings.model_fields  # nothing left at the old place
