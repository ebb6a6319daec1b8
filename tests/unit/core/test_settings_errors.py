"""A misspelled or invalid setting is named with where it came from (the config file, or the
FLYWHEEL_ variable when the environment set it) and, for an unknown key, the closest known
settings of its section, by `flywheel config show` and `flywheel up` alike."""

from __future__ import annotations

import os

import pytest

from flywheel.ops.cli import main


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
    assert "  trainer in FLYWHEEL_TRAINER__LR: " in message, message
    assert "trainer.lr moved to trainer.optim.lr (FLYWHEEL_TRAINER__OPTIM__LR)" in message
    assert "(FLYWHEEL_TRAINER)" not in message and "WEIGHT_DECAY" not in message, message


def test_a_moved_setting_in_the_file_still_names_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.toml").write_text("[trainer]\nlr = 1e-5\n")
    monkeypatch.setenv("FLYWHEEL_TRAINER__OPTIM__WEIGHT_DECAY", "0.1")  # valid: not the cause
    message = _refusal("config", "show", "--config", "a.toml")
    assert "  trainer in a.toml: " in message, message
