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
    public = [n for n, s in services.items()
              if any(not str(port).startswith("127.0.0.1:") for port in s.get("ports", []))]
    assert public == ["gateway"]


# Where each service serves Prometheus metrics: (settings section, field naming the port).
METRICS_PORTS = {"gateway": ("gateway", "port"), "engine": ("engine", "port"),
                 "reward": ("reward", "metrics_port"), "trainer": ("trainer", "port")}


def _service_settings(service, monkeypatch):
    for key, value in (service.get("environment") or {}).items():
        if key.startswith("FLYWHEEL_") and key != "FLYWHEEL_CACHE":
            monkeypatch.setenv(key, str(value).replace("${REDIS_PASSWORD:?set REDIS_PASSWORD}",
                                                      "pw"))
    return load_settings()


def test_observability_profile_scrapes_every_metrics_endpoint(compose, monkeypatch):
    prometheus = compose["services"]["prometheus"]
    assert prometheus["profiles"] == ["observability"]
    assert ":" in prometheus["image"] and not prometheus["image"].endswith(":latest")
    config_mount = next(v for v in prometheus["volumes"]
                        if v.split(":")[1] == "/etc/prometheus/prometheus.yml")
    config_file = ROOT / config_mount.split(":")[0]
    assert f"--config.file={config_mount.split(':')[1]}" in prometheus["command"]
    config = yaml.safe_load(config_file.read_text())
    targets = {}
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                targets[host] = int(port)
    assert set(targets) == set(METRICS_PORTS), "every service with /metrics is scraped"
    for name, (section, field) in METRICS_PORTS.items():
        assert name in compose["services"], name
        with monkeypatch.context() as m:
            settings = _service_settings(compose["services"][name], m)
        assert targets[name] == getattr(getattr(settings, section), field), name
    # The scraped services really serve /metrics (FastAPI routes; reward: prometheus_client).
    src = ROOT / "services" / "flywheel"
    for routes in ("engine/app.py", "gateway/app.py", "trainer/http.py"):
        assert '.get("/metrics")' in (src / routes).read_text(), routes
    assert "start_http_server(rs.metrics_port" in (src / "reward/main.py").read_text()
