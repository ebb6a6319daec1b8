"""A misspelled or invalid setting is named with where it came from (the config file, or the
FLYWHEEL_ variable when the environment set it) and, for an unknown key, the closest known
settings of its section, by `flywheel config show` and `flywheel up` alike."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from flywheel.core.config_files import READ_VARIABLES
from flywheel.core.settings import load_settings
from flywheel.ops.cli import main
from flywheel.ops.demo_cli import API_KEY_ENV


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(key)


def _refusal(*argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    return str(exited.value.code)


@pytest.mark.parametrize("command", [["config", "show"], ["up"]])
def test_a_misspelled_key_in_a_file_names_the_file_and_the_closest_setting(
    tmp_path, monkeypatch, command
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.toml").write_text("[gateway]\nprot = 8000\n[trainer.optim]\nlrr = 1e-5\n")
    message = _refusal(*command, "--config", "a.toml")
    assert "unknown setting gateway.prot in a.toml; did you mean gateway.port?" in message
    assert "unknown setting trainer.optim.lrr in a.toml; did you mean trainer.optim.lr?" in message
    assert "FLYWHEEL_GATEWAY__PROT" not in message and "Extra inputs" not in message


def test_a_key_like_no_setting_lists_the_settings_of_its_section(tmp_path):
    cfg = tmp_path / "b.yaml"
    cfg.write_text("trainer:\n  optim:\n    xyzzy: 1\n")
    message = _refusal("config", "show", "--config", str(cfg))
    assert (
        f"unknown setting trainer.optim.xyzzy in {cfg}; the settings of trainer.optim are: "
        "betas, lr, lr_schedule, max_grad_norm, state_dtype, total_steps, warmup_steps, "
        "weight_decay"
    ) in message


def test_a_misspelled_variable_names_the_variable_and_the_one_to_use(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_GATEWAY__PROT", "8001")
    monkeypatch.setenv("FLYWHEEL_TRAINER__OPTIM__LR", "-1")
    cfg = tmp_path / "a.toml"
    cfg.write_text("[gateway]\nhost = '127.0.0.1'\n[trainer.optim]\nlr = 1e-5\n")
    message = _refusal("config", "show", "--config", str(cfg))
    assert (
        "unknown setting gateway.prot in FLYWHEEL_GATEWAY__PROT; did you mean gateway.port "
        "(FLYWHEEL_GATEWAY__PORT)?"
    ) in message
    # The environment wins over the file, so the bad value is the variable's.
    assert (
        "trainer.optim.lr in FLYWHEEL_TRAINER__OPTIM__LR: Input should be greater than 0 (got '-1')"
    ) in message
    assert str(cfg) not in message


def test_a_section_set_as_json_in_one_variable_names_that_variable(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TRAINER__OPTIM", '{"lrr": 1e-5}')
    message = _refusal("config", "show")
    assert (
        "unknown setting trainer.optim.lrr in FLYWHEEL_TRAINER__OPTIM; did you mean "
        "trainer.optim.lr?"
    ) in message


def test_a_bad_value_in_the_file_from_flywheel_config_names_the_file(tmp_path, monkeypatch):
    cfg = tmp_path / "b.yaml"
    cfg.write_text("trainer:\n  optim:\n    lr: -1\n")
    monkeypatch.setenv("FLYWHEEL_CONFIG", str(cfg))
    message = _refusal("config", "show")
    assert f"trainer.optim.lr in {cfg}: Input should be greater than 0 (got -1)" in message


def test_a_moved_setting_set_in_a_variable_names_that_variable(tmp_path, monkeypatch):
    """The [trainer] section's own check refuses `trainer.lr` (moved to trainer.optim.lr): the
    error is the whole section's, and names the variable set, not FLYWHEEL_TRAINER."""
    monkeypatch.setenv("FLYWHEEL_TRAINER__LR", "1e-5")
    monkeypatch.setenv("FLYWHEEL_TRAINER__OPTIM__WEIGHT_DECAY", "0.1")  # valid: not named
    message = _refusal("config", "show")
    assert "  trainer in FLYWHEEL_TRAINER__LR: trainer.lr moved" in message, message
    assert "Value error" not in message, message
    assert "trainer.lr moved to trainer.optim.lr (FLYWHEEL_TRAINER__OPTIM__LR)" in message
    assert "(FLYWHEEL_TRAINER)" not in message and "WEIGHT_DECAY" not in message, message


def test_a_moved_setting_in_the_file_still_names_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.toml").write_text("[trainer]\nlr = 1e-5\n")
    monkeypatch.setenv("FLYWHEEL_TRAINER__OPTIM__WEIGHT_DECAY", "0.1")  # valid: not the cause
    message = _refusal("config", "show", "--config", "a.toml")
    assert "  trainer in a.toml: " in message, message


@pytest.mark.parametrize(
    ("name", "fixed"),
    [
        ("FLYWHEEL_STATEDIR", "FLYWHEEL_STATE_DIR"),
        ("FLYWHEEL_LOGLEVEL", "FLYWHEEL_LOG_LEVEL"),
        ("FLYWHEEL_CONFIG_FILE", "FLYWHEEL_CONFIG"),
        ("flywheel_cache", "FLYWHEEL_CACHE"),
    ],
)
@pytest.mark.parametrize("command", [["status"], ["config", "show"]])
def test_a_variable_that_names_no_setting_is_refused_with_the_closest_name(
    monkeypatch, tmp_path, name, fixed, command
):
    """FLYWHEEL_STATEDIR=/some/dir would otherwise run on .flywheel without a word."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, str(tmp_path / "state"))
    message = _refusal(*command)
    assert f"{name}: not read (no setting has this name); did you mean {fixed}?" in message
    assert not (tmp_path / "state").exists() and not (tmp_path / ".flywheel").exists()


def test_a_variable_like_no_name_lists_the_settings_and_the_variables_read(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_XYZZY", "1")
    message = _refusal("config", "show")
    assert "FLYWHEEL_XYZZY: not read (no setting has this name); settings are " in message
    assert "FLYWHEEL_<SECTION>__<FIELD> or one of FLYWHEEL_ENGINE, " in message
    assert "FLYWHEEL_STATE_DIR" in message and "other variables read: FLYWHEEL_API_KEY" in message


def _variables_read_outside_settings() -> set[str]:
    """The FLYWHEEL_ names read from the environment as they are (os.environ, ${...}) by the
    code, the compose file, the images, the benchmarks and the tests."""
    root = Path(__file__).resolve().parents[3]
    read = re.compile(r"""(?:environ(?:\.get)?\(|environ\[|getenv\(|\$\{?)["']?(FLYWHEEL_\w+)""")
    files = [root / "docker-compose.yml", root / "Makefile"]
    for folder in ("services", "bench", "deploy", "tools", "tests"):
        files += [
            p
            for p in (root / folder).rglob("*")
            if p.is_file() and (p.suffix in {".py", ".sh", ".yml", ".yaml"} or "Docker" in p.name)
        ]
    names = {m for p in files for m in read.findall(p.read_text(errors="replace"))}
    return {n for n in names if "__" not in n} | {API_KEY_ENV}


def test_every_variable_read_outside_the_settings_is_accepted(monkeypatch, tmp_path):
    """FLYWHEEL_CONFIG, FLYWHEEL_CACHE, the compose file's FLYWHEEL_MODEL, ... are read as they
    are: none of them is refused, and the top-level settings still take effect."""
    names = _variables_read_outside_settings()
    assert {"FLYWHEEL_CONFIG", "FLYWHEEL_CACHE", "FLYWHEEL_MODEL"} <= names
    for name in sorted(names - {"FLYWHEEL_CONFIG"}):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("FLYWHEEL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FLYWHEEL_LOG_LEVEL", "DEBUG")
    settings = load_settings()
    assert settings.state_dir == str(tmp_path / "state") and settings.log_level == "DEBUG"
    assert names <= READ_VARIABLES


def test_a_log_level_in_lower_case_is_read_in_upper_case(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_LOG_LEVEL", "debug")
    assert load_settings().log_level == "DEBUG"
    monkeypatch.delenv("FLYWHEEL_LOG_LEVEL")
    assert load_settings(log_level="Warning").log_level == "WARNING"


def test_an_unknown_log_level_is_refused_naming_the_variable_or_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_LOG_LEVEL", "verbose")
    message = _refusal("config", "show")
    assert "log_level in FLYWHEEL_LOG_LEVEL: not a log level; use one of DEBUG, " in message
    assert "INFO, WARNING, ERROR, " in message, message
    assert "CRITICAL (got 'verbose')" in message, message
    monkeypatch.delenv("FLYWHEEL_LOG_LEVEL")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.toml").write_text('log_level = "LOUD"\n')
    message = _refusal("up", "--config", "a.toml")
    assert "log_level in a.toml: " in message and "(got 'LOUD')" in message, message
