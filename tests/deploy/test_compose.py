"""docker-compose.yml is checked offline: files it builds from exist, the modules it runs exist,
and every FLYWHEEL_* variable it sets is a real, valid setting."""

import importlib.util
from pathlib import Path

import pytest
import yaml

from flywheel.core.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_build_has_a_dockerfile(compose):
    builds = [s["build"] for s in compose["services"].values() if "build" in s]
    assert builds
    for build in builds:
        assert (ROOT / build["context"] / build["dockerfile"]).is_file(), build


def test_every_python_command_is_an_existing_module(compose):
    for name, service in compose["services"].items():
        cmd = service.get("command", [])
        if cmd[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(cmd[2]) is not None, f"{name}: {cmd[2]}"


def test_flywheel_env_parses_into_settings(compose, monkeypatch):
    for name, service in compose["services"].items():
        env = service.get("environment") or {}
        keys = {k: str(v) for k, v in env.items() if k.startswith("FLYWHEEL_")
                and k != "FLYWHEEL_CACHE"}
        for key, value in keys.items():
            monkeypatch.setenv(key, value.replace("${REDIS_PASSWORD:?set REDIS_PASSWORD}", "pw"))
        settings = load_settings()
        if "FLYWHEEL_GATEWAY__ENGINE_URLS" in keys:
            assert settings.gateway.engine_urls == ["http://engine:30000"], name
        for key in keys:
            monkeypatch.delenv(key)


def test_services_have_health_checks_and_only_gateway_is_published(compose):
    services = compose["services"]
    for name, service in services.items():
        if name != "model-init":
            assert "healthcheck" in service, name
    published = [n for n, s in services.items() if s.get("ports")]
    assert published == ["gateway"]
