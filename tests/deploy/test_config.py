"""Configuration as operators write it: one YAML file with a section per service, environment
overrides on top, `flywheel config show` with secrets masked, and invalid settings stopping a
real service at start with a message that names the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from flywheel.core.settings import (
    ConfigFileError,
    FlywheelSettings,
    describe_validation_error,
    load_settings,
    mask_secrets,
)

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_CONFIG = ROOT / "deploy/k8s/base/flywheel.yaml"
SERVICES = ("engine", "gateway", "reward", "teacher", "trainer")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(key)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}


def test_yaml_file_with_a_section_per_service_then_environment(tmp_path, monkeypatch):
    cfg = tmp_path / "flywheel.yaml"
    cfg.write_text(
        "streams:\n  prefix: exp7\ngateway:\n  port: 8081\n  engine_urls:\n"
        "    - http://e1:30000\n    - http://e2:30000\ntrainer:\n  optim:\n    lr: 2.0e-5\n"
        "  batch:\n    group_size: 4\nreward:\n  judge:\n    enabled: true\n    votes: 5\n"
    )
    monkeypatch.setenv("FLYWHEEL_TRAINER__OPTIM__LR", "3e-6")
    s = load_settings(cfg)
    assert s.trainer.optim.lr == 3e-6  # the environment wins over the file
    assert s.trainer.batch.group_size == 4 and s.gateway.port == 8081  # the file wins over defaults
    assert s.engine_urls() == ["http://e1:30000", "http://e2:30000"]
    assert s.reward.judge.votes == 5 and s.streams.key("train") == "exp7:train"
    # The same settings from TOML and YAML are equal.
    toml = tmp_path / "flywheel.toml"
    toml.write_text(
        '[streams]\nprefix = "exp7"\n[gateway]\nport = 8081\nengine_urls = '
        '["http://e1:30000", "http://e2:30000"]\n[trainer.optim]\nlr = 2.0e-5\n'
        "[trainer.batch]\ngroup_size = 4\n[reward.judge]\nenabled = true\nvotes = 5\n"
    )
    assert load_settings(toml) == s
    empty = tmp_path / "empty.yml"
    empty.write_text("# nothing set\n")
    assert load_settings(empty).trainer.optim.lr == 3e-6


def test_the_cluster_config_is_one_yaml_file_with_every_service(monkeypatch):
    data = yaml.safe_load(CLUSTER_CONFIG.read_text())
    assert set(SERVICES) <= set(data)
    monkeypatch.setenv("FLYWHEEL_CONFIG", str(CLUSTER_CONFIG))
    s = load_settings()
    assert s.gateway.engine_urls == []  # the engines come from the fleet (test_k8s_fleet.py)
    assert (s.fleet.discovery, s.fleet.dns_name) == ("dns", "engine-headless")
    assert s.teacher.engine_urls == ["http://teacher-engine:30000"]


def test_bad_files_name_the_file_and_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  optim:\n    lr: 1e-5\n     betas: [0.9, 0.99]\n")  # line 4
    with pytest.raises(ConfigFileError, match=r"(?s)bad\.yaml: not valid yaml.*line 4"):
        load_settings(bad)
    bad.write_text("- trainer\n- gateway\n")
    with pytest.raises(ConfigFileError, match="top level must be a mapping"):
        load_settings(bad)


def test_invalid_values_are_reported_by_field_and_variable(tmp_path, monkeypatch):
    cfg = tmp_path / "flywheel.yaml"
    cfg.write_text("trainer:\n  optim:\n    lr: -1\ngateway:\n  prot: 8000\n")
    with pytest.raises(ValidationError) as info:
        load_settings(cfg)
    text = describe_validation_error(info.value)  # not told the file: names the variables
    assert (
        "trainer.optim.lr (FLYWHEEL_TRAINER__OPTIM__LR): Input should be greater than 0 (got -1)"
        in text
    )
    assert "unknown setting gateway.prot (FLYWHEEL_GATEWAY__PROT)" in text
    text = describe_validation_error(
        info.value, FlywheelSettings, cfg.name, yaml.safe_load(cfg.read_text())
    )
    assert "trainer.optim.lr in flywheel.yaml: Input should be greater than 0 (got -1)" in text
    assert "unknown setting gateway.prot in flywheel.yaml; did you mean gateway.port?" in text
    monkeypatch.setenv("FLYWHEEL_REWARD__JUDGE__API_KEY", "{}")
    monkeypatch.setenv("FLYWHEEL_REWARD__JUDGE__VOTES", "99")
    with pytest.raises(ValidationError) as info:
        load_settings()
    assert "reward.judge.votes in FLYWHEEL_REWARD__JUDGE__VOTES: " in describe_validation_error(
        info.value
    )


def test_mask_secrets_hides_credentials_and_keeps_the_rest():
    data = {
        "redis": {"url": "redis://:hunter2@redis:6379/0", "port": 6379},
        "reward": {
            "judge": {
                "api_key": "sk-live-1",
                "max_tokens": 512,
                "base_url": "https://judge.example/v1",
            }
        },
        "teacher": {"hint_judge": {"api_key": None}},
        "engine_urls": ["http://user:pw@e1:30000", "http://e2:30000"],
    }
    assert mask_secrets(data) == {
        "redis": {"url": "redis://:***@redis:6379/0", "port": 6379},
        "reward": {
            "judge": {"api_key": "***", "max_tokens": 512, "base_url": "https://judge.example/v1"}
        },
        "teacher": {"hint_judge": {"api_key": None}},
        "engine_urls": ["http://user:***@e1:30000", "http://e2:30000"],
    }


def test_config_show_prints_the_resolved_config_with_secrets_masked(tmp_path):
    cfg = tmp_path / "flywheel.yaml"
    cfg.write_text(
        "redis:\n  url: redis://:s3cret-pw@redis:6379/0\nreward:\n  judge:\n"
        "    api_key: sk-judge-123\ntrainer:\n  optim:\n    lr: 2.0e-5\n"
    )
    env = {**_env(), "FLYWHEEL_TRAINER__BATCH__GROUP_SIZE": "16"}
    run = subprocess.run(
        [sys.executable, "-m", "flywheel.ops.cli", "config", "show", "--config", str(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    shown = json.loads(run.stdout)
    assert "s3cret-pw" not in run.stdout and "sk-judge-123" not in run.stdout
    assert shown["redis"]["url"] == "redis://:***@redis:6379/0"
    assert shown["reward"]["judge"]["api_key"] == "***"
    assert (shown["trainer"]["optim"]["lr"], shown["trainer"]["batch"]["group_size"]) == (2e-5, 16)
    as_yaml = subprocess.run(
        [
            sys.executable,
            "-m",
            "flywheel.ops.cli",
            "config",
            "show",
            "--config",
            str(cfg),
            "--format",
            "yaml",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert yaml.safe_load(as_yaml.stdout) == shown


def test_cli_names_the_invalid_field_without_a_traceback(tmp_path):
    cfg = tmp_path / "flywheel.yaml"
    cfg.write_text("trainer:\n  batch:\n    group_size: 0\n")
    run = subprocess.run(
        [sys.executable, "-m", "flywheel.ops.cli", "config", "show", "--config", str(cfg)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert f"trainer.batch.group_size in {cfg}: " in run.stderr
    assert "greater than or equal to 1" in run.stderr


@pytest.mark.parametrize(
    "service,bad",
    [("reward", "reward:\n  port: 0\n"), ("gateway", "gateway:\n  default_max_tokens: -5\n")],
)
def test_a_service_with_invalid_config_stops_at_start_naming_the_field(tmp_path, service, bad):
    cfg = tmp_path / "flywheel.yaml"
    cfg.write_text(bad)
    field = bad.split("\n")[1].strip().split(":")[0]
    env = {**_env(), "FLYWHEEL_CONFIG": str(cfg)}
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", f"flywheel.{service}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode != 0
    assert f"{service}.{field}" in run.stderr, run.stderr[-2000:]
    assert time.monotonic() - started < 60  # refused before any model or server starts
