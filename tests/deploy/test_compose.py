"""docker-compose.yml is checked offline, without a Docker engine.

- It passes the compose-spec JSON schema (check-jsonschema's vendored copy) and Debian's
  `docker-compose config` (v1), which also interpolates and merges it.
- For every profile combination users run, the active services form a valid graph: each
  dependency is active, long-running services have health checks and are waited for as
  healthy, and exactly one service answers each network name the config uses (engine,
  gateway, trainer).
- Every image's build context, Dockerfile, COPY sources, extras and entry module exist; images
  are multi-stage and run as a non-root user; the gateway/reward/teacher images cannot pull torch.
- Every FLYWHEEL_* variable parses into valid settings, every ${VAR} is defaulted or required
  with a message, and settings point at services and ports that exist.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from packaging.requirements import Requirement

from flywheel.core.settings import FlywheelSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROFILE_SETS = [
    ("cpu",),
    ("gpu",),
    ("cpu", "teacher", "observability"),
    ("gpu", "teacher-gpu", "observability"),
]
REQUIRED_ENV = {"REDIS_PASSWORD": "pw-test"}
ONE_SHOT = {"model-init", "checkpoints-init"}
# Ports each service listens on inside its container: (settings section, field).
FLYWHEEL_PORTS = {
    "engine": [("engine", "port")],
    "gateway": [("gateway", "port")],
    "reward": [("reward", "port"), ("reward", "metrics_port")],
    "teacher": [("teacher", "port"), ("teacher", "metrics_port")],
    "trainer": [("trainer", "port")],
}
OTHER_PORTS = {
    "redis": {6379},
    "sglang": {30000},
    "sglang-teacher": {30000},
    "prometheus": {9090},
    "grafana": {3000},
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} and $$ rules."""

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if op == ":-":
            return env.get(name) or arg
        if op == ":?" and not env.get(name):
            raise KeyError(f"{name}: {arg}")
        return env.get(name, "")

    out = re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", sub, value)
    return out.replace("$$", "$")


def _active(compose: dict, profiles: tuple[str, ...]) -> dict[str, dict]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)
    }


def _env(service: dict, env: dict[str, str]) -> dict[str, str]:
    raw = service.get("environment") or {}
    return {k: _interpolate(str(v), env) for k, v in raw.items()}


def _settings(service: dict, monkeypatch) -> FlywheelSettings:
    for key in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(key)
    for key, value in _env(service, REQUIRED_ENV).items():
        if key.startswith("FLYWHEEL_") and key != "FLYWHEEL_CACHE":
            monkeypatch.setenv(key, value)
    return load_settings()


def sglang_version(tag: str) -> tuple[int, ...]:
    """`v0.5.23` or `v0.5.23-cu129` -> (0, 5, 23)."""
    m = re.match(r"v?(\d+)\.(\d+)\.(\d+)", tag)
    assert m, f"unversioned SGLang tag {tag!r}"
    return tuple(int(x) for x in m.groups())


def _flywheel_module(service: dict) -> str | None:
    cmd = service.get("command") or []
    return cmd[2] if cmd[:2] == ["python", "-m"] else None


def _flywheel_service(service: dict) -> str | None:
    """`gateway` for `python -m flywheel.gateway`; None for helpers (flywheel.engine.convert)."""
    module = _flywheel_module(service) or ""
    m = re.fullmatch(r"flywheel\.(\w+)", module)
    return m.group(1) if m else None


def _names(name: str, service: dict) -> set[str]:
    """Network names a service answers to on the default network."""
    aliases = ((service.get("networks") or {}).get("default") or {}).get("aliases", [])
    return {name, *aliases}


# ---------------------------------------------------------------- schema and docker-compose


def test_compose_file_passes_the_compose_spec_schema():
    exe = shutil.which("check-jsonschema") or str(ROOT / ".venv/bin/check-jsonschema")
    if not Path(exe).exists():
        pytest.fail("check-jsonschema is missing: `make setup` installs it (dev extra)")
    run = subprocess.run(
        [exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def _docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose (Debian package) is missing: `make test` installs it (apt)")
        pytest.skip("docker-compose is not installed here")
    return exe


def test_docker_compose_config_accepts_the_file_and_requires_the_secrets(tmp_path):
    exe = _docker_compose()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **REQUIRED_ENV}
    ok = subprocess.run(
        [exe, "-f", str(COMPOSE_FILE), "config"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    rendered = yaml.safe_load(ok.stdout)
    assert set(rendered["services"]) == set(yaml.safe_load(COMPOSE_FILE.read_text())["services"])
    # Interpolated: the password reached Redis and the services' URL, nothing is left unexpanded.
    assert "pw-test" in rendered["services"]["redis"]["environment"]["REDIS_PASSWORD"]
    assert rendered["services"]["reward"]["environment"]["FLYWHEEL_REDIS__URL"] == (
        "redis://:pw-test@redis:6379/0"
    )
    assert "${" not in ok.stdout
    # Without the password, compose refuses to start and says which variable to set.
    env.pop("REDIS_PASSWORD")
    missing = subprocess.run(
        [exe, "-f", str(COMPOSE_FILE), "config", "-q"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert missing.returncode != 0 and "REDIS_PASSWORD" in missing.stderr


def test_default_profile_is_cpu():
    dotenv = dict(
        line.split("=", 1)
        for line in (ROOT / ".env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert dotenv == {"COMPOSE_PROFILES": "cpu"}, "secrets never belong in the committed .env"


# ---------------------------------------------------------------- graph per profile


@pytest.mark.parametrize("profiles", PROFILE_SETS, ids=lambda p: "+".join(p))
def test_each_profile_is_a_complete_health_gated_graph(compose, profiles):
    active = _active(compose, profiles)
    for name, svc in active.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in active, f"{name} depends on {dep}, not active in {profiles}"
            want = "service_completed_successfully" if dep in ONE_SHOT else "service_healthy"
            assert cond == {"condition": want}, (name, dep, cond)
            if want == "service_healthy":
                assert "healthcheck" in active[dep], dep
        if name in ONE_SHOT:
            assert "restart" not in svc and "healthcheck" not in svc, name
        else:
            check = svc.get("healthcheck")
            assert check and check["test"][0] in ("CMD", "CMD-SHELL"), name
            assert svc.get("restart") == "unless-stopped" or name in ("prometheus", "grafana"), name
    # One provider per network name the settings and Prometheus use.
    names = [n for name, svc in active.items() for n in _names(name, svc)]
    for needed in ("redis", "engine", "gateway", "trainer", "reward"):
        assert names.count(needed) == 1, (needed, profiles)
    if {"teacher", "teacher-gpu"} & set(profiles):
        assert names.count("teacher") == 1 and names.count("teacher-engine") == 1
    # Only the gateway is published beyond loopback.
    public = [
        n
        for n, s in active.items()
        for port in s.get("ports", [])
        if not str(port).startswith("127.0.0.1:")
    ]
    assert public == [n for n in active if "gateway" in _names(n, active[n])]


def test_gpu_profile_runs_sglang_with_the_flags_flywheel_needs(compose, monkeypatch):
    gpu = _active(compose, ("gpu",))
    sglang = gpu["sglang"]
    assert sglang["image"].startswith("lmsysorg/sglang:") and ":latest" not in sglang["image"]
    tag = _interpolate(sglang["image"], REQUIRED_ENV).split(":")[1]
    assert sglang_version(tag) >= (0, 5, 5), f"{tag}: SGLang < 0.5.5 reports no weight_version"
    cmd = [_interpolate(str(a), REQUIRED_ENV) for a in sglang["command"]]
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]

    def flag(name: str) -> str:
        return cmd[cmd.index(name) + 1]

    assert flag("--host") == "0.0.0.0" and flag("--port") == "30000"
    assert "--enable-metrics" in cmd
    # the parsers are names SGLang knows (docs/engine-protocol.md#parser-names)
    text = (ROOT / "docs/engine-protocol.md").read_text()
    assert re.search(rf"[ ,`]{re.escape(flag('--tool-call-parser'))}[`,.]", text)
    assert re.search(rf"[ ,`]{re.escape(flag('--reasoning-parser'))}[`,.]", text)
    model = flag("--model-path")
    # The gateway tokenizes with the served model and the trainer starts from it; the trainer's
    # checkpoints are visible to SGLang at the same path (/update_weights_from_disk takes it).
    gateway, trainer = gpu["gateway-gpu"], gpu["trainer-gpu"]
    gw = _settings(gateway, monkeypatch).gateway
    assert gw.tokenizer_path == model and gw.model_name == flag("--served-model-name")
    tr = _settings(trainer, monkeypatch).trainer
    assert tr.model_path == model and tr.device == "cuda"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in sglang["volumes"]}
    trainer_mounts = {v.split(":")[1]: v.split(":")[0] for v in trainer["volumes"]}
    assert mounts[tr.checkpoint.dir] == trainer_mounts[tr.checkpoint.dir] == "checkpoints"
    for svc in (sglang, trainer):
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["count"] >= 1
    for name, svc in _active(compose, ("cpu",)).items():
        assert "deploy" not in svc, f"{name} reserves a device in the CPU profile"


# ---------------------------------------------------------------- images


def _dockerignore() -> list[str]:
    return [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


def _extras() -> dict[str, list[str]]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {"": data["project"]["dependencies"], **data["project"]["optional-dependencies"]}


def _closure(extra: str) -> set[str]:
    """Distribution names an install of `.[extra]` pulls in, through flywheel's own extras and
    the installed packages' metadata (markers evaluated for this interpreter and the extras a
    requirement names)."""
    extras, seen, todo = _extras(), set(), []
    own = [extra, ""]
    while own:
        name = own.pop()
        for req in map(Requirement, extras[name]):
            if req.name == "flywheel":
                own += list(req.extras)
            else:
                todo.append(req)
    visited: set[tuple[str, frozenset[str]]] = set()
    while todo:
        req = todo.pop()
        key = req.name.lower().replace("_", "-")
        if (key, frozenset(req.extras)) in visited or (
            req.marker and not req.marker.evaluate({"extra": ""})
        ):
            continue
        visited.add((key, frozenset(req.extras)))
        seen.add(key)
        try:
            deps = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        wanted = ["", *req.extras]  # redis[hiredis] also pulls redis's "hiredis" extra
        for dep in map(Requirement, deps):
            if not dep.marker or any(dep.marker.evaluate({"extra": e}) for e in wanted):
                dep.marker = None  # evaluated here, with the extras that pulled it in
                todo.append(dep)
    return seen


def test_images_build_from_real_files_and_run_unprivileged(compose):
    builds = {}
    for name, svc in compose["services"].items():
        if "build" in svc:
            build = svc["build"]
            builds[name] = build
            context = ROOT / build["context"]
            dockerfile = context / build["dockerfile"]
            assert dockerfile.is_file(), (name, dockerfile)
            text = dockerfile.read_text()
            assert len(re.findall(r"^FROM ", text, re.M)) >= 2, f"{dockerfile} is not multi-stage"
            user = re.findall(r"^USER (\S+)", text, re.M)
            assert user and user[-1].split(":")[0] not in ("root", "0"), dockerfile
            for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
                for src in line.split()[:-1]:
                    assert (context / src).exists(), (dockerfile, src)
                    assert src not in _dockerignore(), (dockerfile, src)
            extra = build["args"]["EXTRAS"]
            assert extra in _extras(), (name, extra)
            assert "ARG EXTRAS" in text and '".[${EXTRAS}]"' in text
            module = _flywheel_module(svc)
            if module:
                assert importlib.util.find_spec(module) is not None, (name, module)
            service = _flywheel_service(svc)
            if service:
                assert extra == service, (name, extra)
        if svc.get("image", "").startswith("flywheel-"):
            assert "build" in svc, f"{name}: flywheel images are built here, never pulled"
    assert {"engine", "gateway", "reward", "teacher", "trainer", "trainer-gpu"} <= set(builds)


@pytest.mark.parametrize("extra", ["gateway", "reward", "teacher"])
def test_torch_free_images_cannot_install_torch(extra):
    pulled = _closure(extra)
    assert "pydantic" in pulled and "redis" in pulled  # the walk really follows requirements
    assert "torch" not in pulled, f".[{extra}] pulls torch"
    assert "torch" in _closure("trainer")


# ---------------------------------------------------------------- environment and settings


def test_every_interpolated_variable_is_defaulted_or_required(compose):
    text = COMPOSE_FILE.read_text()
    for m in re.finditer(r"(?<!\$)\$\{(\w+)(:[-?])?([^}]*)\}", text):
        name, op = m.group(1), m.group(2)
        assert op in (":-", ":?"), f"${{{name}}} has neither a default nor a required message"
        if op == ":?":
            assert name in REQUIRED_ENV, name
    # With only the required variables set, every value interpolates.
    for svc in compose["services"].values():
        _env(svc, REQUIRED_ENV)


@pytest.mark.parametrize("profiles", PROFILE_SETS, ids=lambda p: "+".join(p))
def test_flywheel_env_parses_and_points_at_real_services(compose, profiles, monkeypatch):
    active = _active(compose, profiles)
    ports: dict[str, set[int]] = {}
    for name, svc in active.items():
        service = _flywheel_service(svc)
        listen = set(OTHER_PORTS.get(name, set()))
        if service in FLYWHEEL_PORTS:
            settings = _settings(svc, monkeypatch)
            section = getattr(settings, service)
            assert section.host == "0.0.0.0", f"{name} listens on loopback only"
            listen |= {getattr(getattr(settings, s), f) for s, f in FLYWHEEL_PORTS[service]}
        for alias in _names(name, svc):
            ports[alias] = listen
    checked = 0
    for name, svc in active.items():
        if not _flywheel_service(svc):
            continue
        settings = _settings(svc, monkeypatch)
        redis_url = urlparse(settings.redis_url())
        assert redis_url.password == REQUIRED_ENV["REDIS_PASSWORD"], name
        assert redis_url.port in ports[redis_url.hostname], name
        urls = (
            settings.engine_urls() + settings.trainer_engine_urls() + (settings.teacher.engine_urls)
        )
        for url in map(urlparse, urls):
            assert url.port in ports.get(url.hostname, set()), (name, url.geturl())
        assert settings.teacher.enabled is False  # on only with FLYWHEEL_TEACHER_ENABLED=true
        checked += 1
    assert checked >= 3  # gateway, reward, trainer (+ engine on CPU, + teacher)


def test_teacher_switch_moves_the_reward_output_to_the_teacher(compose, monkeypatch):
    reward = compose["services"]["reward"]
    assert _settings(reward, monkeypatch).next_stream_after_reward() == "flywheel:train"
    monkeypatch.setenv("FLYWHEEL_TEACHER_ENABLED", "true")
    env = _env(reward, {**REQUIRED_ENV, "FLYWHEEL_TEACHER_ENABLED": "true"})
    monkeypatch.setenv("FLYWHEEL_TEACHER__ENABLED", env["FLYWHEEL_TEACHER__ENABLED"])
    assert load_settings().next_stream_after_reward() == "flywheel:scored"


# ---------------------------------------------------------------- observability


def test_prometheus_scrapes_every_metrics_endpoint(compose, monkeypatch):
    prometheus = compose["services"]["prometheus"]
    assert prometheus["profiles"] == ["observability"]
    mount = next(v for v in prometheus["volumes"] if ":/etc/prometheus/prometheus.yml" in v)
    config = yaml.safe_load((ROOT / mount.split(":")[0]).read_text())
    targets = {}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                targets[host] = int(port)
    metrics_port = {
        "gateway": ("gateway", "port"),
        "engine": ("engine", "port"),
        "reward": ("reward", "metrics_port"),
        "trainer": ("trainer", "port"),
        "teacher": ("teacher", "metrics_port"),
        "teacher-engine": ("engine", "port"),
    }
    assert set(targets) == set(metrics_port)
    for profiles in (("cpu", "teacher"), ("gpu", "teacher-gpu")):
        active = _active(compose, profiles)
        by_name = {n: svc for name, svc in active.items() for n in _names(name, svc)}
        for host, (section, field) in metrics_port.items():
            svc = by_name[host]
            if _flywheel_service(svc):
                settings = _settings(svc, monkeypatch)
                assert targets[host] == getattr(getattr(settings, section), field), host
            else:
                assert "--enable-metrics" in svc["command"] and targets[host] == 30000


def test_grafana_is_provisioned_with_the_flywheel_dashboard(compose):
    grafana = compose["services"]["grafana"]
    assert grafana["profiles"] == ["observability"]
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]
    mounts = {
        v.split(":")[1]: ROOT / v.split(":")[0] for v in grafana["volumes"] if v.startswith("./")
    }
    provisioning = mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert urlparse(datasource["url"]).hostname == "prometheus"
    assert urlparse(datasource["url"]).port == 9090
    (provider,) = yaml.safe_load((provisioning / "dashboards/flywheel.yml").read_text())[
        "providers"
    ]
    dashboards_dir = provider["options"]["path"]
    assert dashboards_dir in mounts
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    dashboard_file = mounts[dashboards_dir] / Path(home).relative_to(dashboards_dir)
    dashboard = json.loads(dashboard_file.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {datasource["uid"]}


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_gateway_reads_the_trainer_metrics_log_for_the_dashboard(compose, profile, monkeypatch):
    active = _active(compose, (profile,))
    gateway = next(s for n, s in active.items() if "gateway" in _names(n, s))
    trainer = next(s for n, s in active.items() if "trainer" in _names(n, s))
    path = _settings(gateway, monkeypatch).trainer.logging.metrics_path
    assert path == _settings(trainer, monkeypatch).trainer.logging.metrics_path

    def volume_of(svc: dict) -> str:
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
        (where,) = [m for m in mounts if path.startswith(m.rstrip("/") + "/")]
        return mounts[where]

    assert volume_of(gateway) == volume_of(trainer) == "checkpoints"


# ---------------------------------------------------------------- image contents


def _import_nodes(path: Path) -> list[tuple[ast.AST, bool]]:
    """(import node, at module level) for every import not guarded by `try/except ImportError`
    or `if TYPE_CHECKING`."""
    out: list[tuple[ast.AST, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in child.handlers
            ):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                out.append((child, top))
            inner = top and not isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            visit(child, inner)

    visit(ast.parse(path.read_text()), True)
    return out


def _module_file(name: str) -> Path | None:
    """Source file of a flywheel module (None for a name that is not a module)."""
    base = ROOT / "services" / Path(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _third_party_imports(service: str) -> dict[str, str]:
    """Top-level third-party modules the service's processes import -> the flywheel module
    that imports them. Every module of flywheel.<service> counts with its lazy (function-level)
    imports; other flywheel modules it reaches count with their module-level imports."""
    own = {
        ".".join(p.relative_to(ROOT / "services").with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "services/flywheel" / service).rglob("*.py")
    }
    todo, seen, found = sorted(own), set(), {}
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node, top in _import_nodes(path):
            if not top and name not in own:
                continue
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1]
                        + ([base] if base else [])
                    )
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                targets = [a.name for a in node.names]
            for target in targets:
                root = target.split(".")[0]
                if root == "flywheel":
                    if _module_file(target):
                        todo.append(target)
                elif root and root not in sys.stdlib_module_names:
                    found.setdefault(root, name)
    return found


OPTIONAL_IMPORTS = {"wandb"}
"""Imported only when installed and configured (trainer.logging.wandb_project; checked with
find_spec)."""


@pytest.mark.parametrize("service", ["gateway", "reward", "teacher", "engine", "trainer"])
def test_each_image_installs_every_package_its_service_imports(compose, service):
    """The image built with EXTRAS=<service> (only that extra) has every third-party package
    the service's code imports; e.g. the teacher's tokenizer needs transformers."""
    extra = next(
        s["build"]["args"]["EXTRAS"]
        for s in compose["services"].values()
        if _flywheel_service(s) == service and "build" in s
    )
    installed = _closure(extra)
    dists = metadata.packages_distributions()
    missing = {}
    for module, importer in _third_party_imports(service).items():
        if module in OPTIONAL_IMPORTS:
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & installed:
            missing[module] = importer
    assert not missing, f".[{extra}] lacks packages imported by: {missing}"
