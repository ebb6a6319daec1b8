"""deploy/k8s is checked offline: every overlay renders with `kubectl kustomize`, every object
passes `kubernetes-validate --strict`, and the manifests agree with what the services really do:
probes hit endpoints the service serves on the port its settings give it, the config map and the
FLYWHEEL_* variables parse into valid settings, only the gateway is reachable from outside, and
NetworkPolicies let exactly the needed traffic through."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from pydantic import BaseModel

from flywheel.core.settings import FlywheelSettings, load_settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ["cpu-dev", "gpu"]
K8S_VERSION = "1.32"
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
SERVICES_SRC = ROOT / "services" / "flywheel"

# What each image really serves. Flywheel services: HTTP routes (checked against the source
# below) on the port their settings section names; liveness must not depend on other services.
FLYWHEEL_HTTP = {
    "engine": {
        "routes": "engine/app.py",
        "paths": {"/health", "/healthz", "/ready"},
        "liveness": {"/healthz"},
    },
    "gateway": {
        "routes": "gateway/app.py",
        "paths": {"/healthz", "/readyz"},
        "liveness": {"/healthz"},
    },
    "trainer": {
        "routes": "trainer/http.py",
        "paths": {"/healthz", "/readyz"},
        "liveness": {"/healthz"},
    },
}
FLYWHEEL_GRPC = {"reward", "teacher"}  # grpc.health.v1 on settings.<service>.port
OTHER_IMAGES = {
    "lmsysorg/sglang": {"http": {30000: {"/health", "/health_generate"}}},
    "redis": {"tcp": {6379}, "exec": True},
}


# ---------------------------------------------------------------- rendering helpers


def _kubectl_ok() -> bool:
    if shutil.which("kubectl") is None:
        return False
    run = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True)
    return run.returncode == 0


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    if not _kubectl_ok():
        pytest.skip("kubectl is not installed here (needed for `kubectl kustomize`)")
    out = {}
    for overlay in OVERLAYS:
        run = subprocess.run(
            ["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        out[overlay] = [d for d in yaml.safe_load_all(run.stdout) if d]
    return out


@pytest.fixture(params=OVERLAYS)
def docs(request, rendered) -> list[dict]:
    return rendered[request.param]


def _of_kind(docs: list[dict], *kinds: str) -> list[dict]:
    return [d for d in docs if d["kind"] in kinds]


def _workloads(docs):
    return _of_kind(docs, *WORKLOAD_KINDS)


def _pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def _image_repo(image: str) -> str:
    return image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image


def _flywheel_service(container: dict) -> str | None:
    """`gateway` for `python -m flywheel.gateway` (None for other commands)."""
    cmd = container.get("command", [])
    if cmd[:2] == ["python", "-m"] and re.fullmatch(r"flywheel\.(\w+)", cmd[2]):
        return cmd[2].split(".")[1]
    return None


def _matches(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels + matchExpressions)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _env_values(container: dict) -> dict[str, str]:
    """Container env as the kubelet resolves it: secrets -> a stand-in, $(VAR) expanded from
    variables defined earlier in the list (later or unknown ones stay literal, as in k8s)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(item["value"])
            )
        elif "secretKeyRef" in item.get("valueFrom", {}):
            value = "secret-from-" + item["valueFrom"]["secretKeyRef"]["key"]
        else:
            value = "pod-0"
        env[item["name"]] = value
    return env


def _config_text(docs: list[dict], workload: dict, container: dict, config_path: str) -> str:
    """Text of the file FLYWHEEL_CONFIG names, found through the container's volume mounts."""
    volumes = {v["name"]: v for v in _pod_spec(workload).get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        prefix = mount["mountPath"].rstrip("/") + "/"
        if config_path.startswith(prefix):
            source = volumes[mount["name"]]
            assert "configMap" in source, f"{config_path} is not mounted from a ConfigMap"
            key = config_path[len(prefix) :]
            (cm,) = [
                d
                for d in _of_kind(docs, "ConfigMap")
                if d["metadata"]["name"] == source["configMap"]["name"]
            ]
            assert key in cm["data"], f"ConfigMap {cm['metadata']['name']} has no {key}"
            return cm["data"][key]
    raise AssertionError(f"{container['name']}: FLYWHEEL_CONFIG={config_path} is not mounted")


def _settings_for(docs, workload, container, tmp_path, monkeypatch) -> FlywheelSettings:
    env = _env_values(container)
    for key in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(key)
    if "FLYWHEEL_CONFIG" in env:
        suffix = Path(env["FLYWHEEL_CONFIG"]).suffix
        config_file = tmp_path / f"{workload['metadata']['name']}-{container['name']}{suffix}"
        config_file.write_text(_config_text(docs, workload, container, env["FLYWHEEL_CONFIG"]))
        monkeypatch.setenv("FLYWHEEL_CONFIG", str(config_file))
    for key, value in env.items():
        if key.startswith("FLYWHEEL_") and key not in ("FLYWHEEL_CONFIG", "FLYWHEEL_CACHE"):
            assert "$(" not in value, f"{key}={value}: unresolved reference"
            monkeypatch.setenv(key, value)
    return load_settings()


def _unknown_keys(data: dict, model: type, where: str) -> list[str]:
    """Keys the settings model has no field for (nested sections ignore them silently)."""
    unknown = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            unknown.append(f"{where}{key}")
        elif (
            isinstance(value, dict)
            and isinstance(field.annotation, type)
            and issubclass(field.annotation, BaseModel)
        ):
            unknown += _unknown_keys(value, field.annotation, f"{where}{key}.")
    return unknown


def _flywheel_containers(docs):
    for workload in _workloads(docs):
        for container in _pod_spec(workload)["containers"]:
            service = _flywheel_service(container)
            if service:
                yield workload, container, service


def _service_ports(docs) -> dict[str, set[int]]:
    return {
        s["metadata"]["name"]: {p["port"] for p in s["spec"]["ports"]}
        for s in _of_kind(docs, "Service")
    }


# ---------------------------------------------------------------- rendering and schema


def test_every_overlay_renders_and_passes_strict_schema_validation(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for overlay, objs in rendered.items():
        kinds = {d["kind"] for d in objs}
        assert {
            "Deployment",
            "StatefulSet",
            "Service",
            "ConfigMap",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "HorizontalPodAutoscaler",
        } <= kinds, overlay
        for obj in objs:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # The validator really rejects an unknown field (a guard against a no-op validation).
    bad = copy.deepcopy(_of_kind(rendered["cpu-dev"], "Deployment")[0])
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_expected_workloads_and_kinds(docs):
    kinds = {d["metadata"]["name"]: d["kind"] for d in _workloads(docs)}
    assert kinds == {
        "engine": "Deployment",
        "gateway": "Deployment",
        "reward": "Deployment",
        "teacher": "Deployment",
        "teacher-engine": "Deployment",
        "trainer": "StatefulSet",
        "redis": "StatefulSet",
    }
    (redis,) = [d for d in _workloads(docs) if d["metadata"]["name"] == "redis"]
    args = _pod_spec(redis)["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert redis["spec"]["volumeClaimTemplates"], "redis data must be on a PVC"
    (trainer,) = [d for d in _workloads(docs) if d["metadata"]["name"] == "trainer"]
    claims = {
        v["persistentVolumeClaim"]["claimName"]
        for v in _pod_spec(trainer)["volumes"]
        if "persistentVolumeClaim" in v
    }
    pvcs = {d["metadata"]["name"] for d in _of_kind(docs, "PersistentVolumeClaim")}
    assert claims and claims <= pvcs


def test_images_are_pinned_and_flywheel_images_match_their_command(docs):
    for workload in _workloads(docs):
        spec = _pod_spec(workload)
        for container in spec.get("initContainers", []) + spec["containers"]:
            image = container["image"]
            assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), image
            service = _flywheel_service(container)
            if service and service in FLYWHEEL_HTTP.keys() | FLYWHEEL_GRPC:
                assert _image_repo(image) == f"flywheel-{service}", (container["name"], image)


# ---------------------------------------------------------------- probes and ports


def _probe_target(container: dict, probe: dict) -> tuple[str, int | None, str | None]:
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    for kind in ("httpGet", "grpc", "tcpSocket"):
        if kind in probe:
            port = probe[kind]["port"]
            if isinstance(port, str):
                assert port in ports, f"{container['name']}: probe port {port!r} is not declared"
                port = ports[port]
            assert port in ports.values(), f"{container['name']}: probe port {port} undeclared"
            return kind, port, probe[kind].get("path")
    assert "exec" in probe, probe
    return "exec", None, None


def test_every_container_has_probes_on_real_endpoints(docs, tmp_path, monkeypatch):
    checked = set()
    for workload in _workloads(docs):
        for container in _pod_spec(workload)["containers"]:
            probes = {
                k: container.get(k) for k in ("startupProbe", "livenessProbe", "readinessProbe")
            }
            missing = [k for k, v in probes.items() if not v]
            assert not missing, f"{workload['metadata']['name']}/{container['name']}: {missing}"
            service = _flywheel_service(container)
            repo = _image_repo(container["image"])
            if service:
                settings = _settings_for(docs, workload, container, tmp_path, monkeypatch)
                section = getattr(settings, service)
                for kind, probe in probes.items():
                    how, port, path = _probe_target(container, probe)
                    assert port == section.port, (service, kind, port, section.port)
                    if service in FLYWHEEL_GRPC:
                        assert how == "grpc", (service, kind)
                        continue
                    spec = FLYWHEEL_HTTP[service]
                    assert how == "httpGet" and path in spec["paths"], (service, kind, path)
                    routes = (SERVICES_SRC / spec["routes"]).read_text()
                    assert f'.get("{path}")' in routes, f"{service} serves no {path}"
                    if kind == "livenessProbe":
                        assert path in spec["liveness"], (service, path)
            else:
                assert repo in OTHER_IMAGES, f"no endpoint list for image {repo}"
                known = OTHER_IMAGES[repo]
                for kind, probe in probes.items():
                    how, port, path = _probe_target(container, probe)
                    if how == "httpGet":
                        assert path in known["http"].get(port, set()), (repo, kind, port, path)
                    elif how == "tcpSocket":
                        assert port in known["tcp"], (repo, kind, port)
                    else:
                        assert known.get(how), (repo, kind, how)
            checked.add(workload["metadata"]["name"])
    assert checked == {
        "engine",
        "gateway",
        "reward",
        "teacher",
        "teacher-engine",
        "trainer",
        "redis",
    }


def test_grpc_services_metrics_port_matches_settings(docs, tmp_path, monkeypatch):
    seen = set()
    for workload, container, service in _flywheel_containers(docs):
        if service in FLYWHEEL_GRPC:
            settings = _settings_for(docs, workload, container, tmp_path, monkeypatch)
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["metrics"] == getattr(settings, service).metrics_port, service
            seen.add(service)
    assert seen == FLYWHEEL_GRPC


def test_services_select_workloads_and_target_declared_ports(docs):
    workloads = _workloads(docs)
    for svc in _of_kind(docs, "Service"):
        selected = [
            w
            for w in workloads
            if _matches({"matchLabels": svc["spec"]["selector"]}, _pod_labels(w))
        ]
        assert len(selected) == 1, svc["metadata"]["name"]
        containers = _pod_spec(selected[0])["containers"]
        declared = {p.get("name") for c in containers for p in c.get("ports", [])} | {
            p["containerPort"] for c in containers for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            assert port.get("targetPort", port["port"]) in declared, (svc["metadata"]["name"], port)


# ---------------------------------------------------------------- configuration


def test_config_and_env_parse_into_settings_that_point_at_real_services(
    docs, tmp_path, monkeypatch
):
    services = _service_ports(docs)
    seen = set()
    for workload, container, service in _flywheel_containers(docs):
        env = _env_values(container)
        assert env.get("FLYWHEEL_CONFIG"), f"{service}: FLYWHEEL_CONFIG is not set"
        settings = _settings_for(docs, workload, container, tmp_path, monkeypatch)
        assert getattr(settings, service).host == "0.0.0.0", service
        assert env["FLYWHEEL_CONFIG"].endswith(".yaml"), "the cluster config is one YAML file"
        config = yaml.safe_load(_config_text(docs, workload, container, env["FLYWHEEL_CONFIG"]))
        assert not _unknown_keys(config, FlywheelSettings, ""), service
        env_keys = {
            k.removeprefix("FLYWHEEL_").lower().replace("__", "."): None
            for k in env
            if k.startswith("FLYWHEEL_") and k not in ("FLYWHEEL_CONFIG", "FLYWHEEL_CACHE")
        }
        nested: dict = {}
        for dotted in env_keys:
            *parents, leaf = dotted.split(".")
            node = nested
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = None
        assert not _unknown_keys(nested, FlywheelSettings, "env:"), service
        if service != "engine":
            url = urlparse(settings.redis_url())
            assert url.password and url.password.startswith("secret-from-"), service
            assert url.hostname in services and url.port in services[url.hostname], service
        urls = {
            "gateway": settings.engine_urls(),
            "trainer": settings.trainer_engine_urls(),
            "teacher": settings.teacher.engine_urls,
        }.get(service, [])
        if service == "teacher":
            assert urls and not set(urls) & set(settings.trainer_engine_urls()), (
                "the teacher's frozen engine must never receive weight pushes"
            )
        for engine_url in urls:
            url = urlparse(engine_url)
            assert url.hostname in services and url.port in services[url.hostname], engine_url
        seen.add(service)
    assert seen == {"engine", "gateway", "reward", "teacher", "trainer"} or seen == {
        "gateway",
        "reward",
        "teacher",
        "trainer",
    }


def test_gpu_overlay_runs_sglang_and_the_trainer_on_gpus(rendered, tmp_path, monkeypatch):
    docs = rendered["gpu"]
    by_name = {w["metadata"]["name"]: w for w in _workloads(docs)}
    engine = _pod_spec(by_name["engine"])
    (sglang,) = engine["containers"]
    assert _image_repo(sglang["image"]) == "lmsysorg/sglang"
    version = re.match(r"v?(\d+)\.(\d+)\.(\d+)", sglang["image"].rsplit(":", 1)[1])
    assert version and tuple(map(int, version.groups())) >= (0, 5, 5), (
        "SGLang < 0.5.5 reports no weight_version"
    )
    cmd = sglang["command"]
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert "--enable-metrics" in cmd
    doc = (ROOT / "docs/engine-protocol.md").read_text()
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        value = cmd[cmd.index(flag) + 1]
        # a parser name SGLang knows (docs/engine-protocol.md#parser-names)
        assert re.search(rf"[ ,`]{re.escape(value)}[`,.]", doc), (flag, value)
    engine_port = int(cmd[cmd.index("--port") + 1])
    assert engine_port == 30000 and engine_port in _service_ports(docs)["engine"]
    model_path = cmd[cmd.index("--model-path") + 1]
    mounts = [m["mountPath"] for m in sglang["volumeMounts"]]
    assert any(model_path.startswith(m + "/") for m in mounts), model_path
    trainer = _pod_spec(by_name["trainer"])
    for spec in (engine, trainer):
        (container,) = spec["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert spec["nodeSelector"], "GPU pods need a node selector"
    settings = _settings_for(
        docs, by_name["trainer"], trainer["containers"][0], tmp_path, monkeypatch
    )
    assert settings.trainer.device == "cuda"
    # The CPU overlay schedules nothing on GPUs.
    for workload in _workloads(rendered["cpu-dev"]):
        for container in _pod_spec(workload)["containers"]:
            assert "nvidia.com/gpu" not in container["resources"].get("limits", {})


# ---------------------------------------------------------------- resources and availability


def test_every_container_has_resource_requests_and_limits(docs):
    for workload in _workloads(docs):
        spec = _pod_spec(workload)
        for container in spec.get("initContainers", []) + spec["containers"]:
            res = container.get("resources", {})
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(kind, {})), (container["name"], kind)


def test_pdbs_and_hpa_target_real_workloads(docs):
    workloads = {w["metadata"]["name"]: w for w in _workloads(docs)}
    covered = set()
    for pdb in _of_kind(docs, "PodDisruptionBudget"):
        hits = [
            n for n, w in workloads.items() if _matches(pdb["spec"]["selector"], _pod_labels(w))
        ]
        assert len(hits) == 1, pdb["metadata"]["name"]
        covered.add(hits[0])
    assert {"gateway", "reward", "teacher"} <= covered
    (hpa,) = _of_kind(docs, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert workloads[ref["name"]]["kind"] == ref["kind"] and ref["name"] == "gateway"
    assert any(
        m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"]
    )
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


# ---------------------------------------------------------------- exposure and network policy


def test_only_the_gateway_is_exposed(docs):
    exposed = [
        s["metadata"]["name"]
        for s in _of_kind(docs, "Service")
        if s["spec"].get("type", "ClusterIP") in ("LoadBalancer", "NodePort")
    ]
    for ingress in _of_kind(docs, "Ingress"):
        for rule in ingress["spec"].get("rules", []):
            exposed += [p["backend"]["service"]["name"] for p in rule["http"]["paths"]]
    assert sorted(set(exposed)) == ["gateway"]


def _allowed(docs, src_labels: dict | None, dst: dict, port: int) -> bool:
    """Would ingress to `dst` pods on `port` be allowed from a pod with `src_labels` in the same
    namespace (None: a client outside the cluster / another namespace)?"""
    labels = _pod_labels(dst)
    policies = [
        p
        for p in _of_kind(docs, "NetworkPolicy")
        if _matches(p["spec"]["podSelector"], labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and port not in {p["port"] for p in rule["ports"]}:
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                if (
                    src_labels is not None
                    and set(peer) == {"podSelector"}
                    and _matches(peer["podSelector"], src_labels)
                ):
                    return True
    return False


def test_network_policies_select_every_pod_and_allow_only_needed_traffic(docs):
    policies = _of_kind(docs, "NetworkPolicy")
    assert any(
        p["spec"]["podSelector"] == {}
        and p["spec"].get("policyTypes") == ["Ingress"]
        and not p["spec"].get("ingress")
        for p in policies
    ), "no default-deny policy"
    w = {x["metadata"]["name"]: x for x in _workloads(docs)}
    for name, workload in w.items():
        specific = [
            p
            for p in policies
            if p["spec"]["podSelector"]
            and _matches(p["spec"]["podSelector"], _pod_labels(workload))
        ]
        assert specific, f"no NetworkPolicy selects {name} pods"

    def labels(name):
        return _pod_labels(w[name])

    needed = [
        ("gateway", "engine", 30000),
        ("trainer", "engine", 30000),
        ("gateway", "redis", 6379),
        ("reward", "redis", 6379),
        ("trainer", "redis", 6379),
        ("teacher", "redis", 6379),
        ("teacher", "teacher-engine", 30000),
        ("trainer", "teacher", 50052),
        ("trainer", "reward", 50051),
    ]
    for src, dst, port in needed:
        assert _allowed(docs, labels(src), w[dst], port), f"{src} cannot reach {dst}:{port}"
    assert _allowed(docs, None, w["gateway"], 8000), "the gateway is not reachable"
    for dst, port in [
        ("engine", 30000),
        ("redis", 6379),
        ("trainer", 8100),
        ("reward", 50051),
        ("teacher", 50052),
        ("teacher-engine", 30000),
    ]:
        assert not _allowed(docs, None, w[dst], port), f"{dst}:{port} is open to outside"
    forbidden = [
        ("gateway", "trainer", 8100),
        ("engine", "redis", 6379),
        ("reward", "engine", 30000),
        ("gateway", "teacher-engine", 30000),
        ("trainer", "teacher-engine", 30000),
    ]
    for src, dst, port in forbidden:
        assert not _allowed(docs, labels(src), w[dst], port), f"{src} may reach {dst}:{port}"


# ---------------------------------------------------------------- secrets


def test_no_real_secret_values_are_committed(rendered):
    for overlay, objs in rendered.items():
        secret_names = {s["metadata"]["name"] for s in _of_kind(objs, "Secret")}
        for secret in _of_kind(objs, "Secret"):
            annotations = secret["metadata"].get("annotations", {})
            assert "flywheel.dev/placeholder" in annotations, (overlay, secret["metadata"])
        refs = {
            e["valueFrom"]["secretKeyRef"]["name"]
            for w in _workloads(objs)
            for c in _pod_spec(w)["containers"]
            for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        assert refs, overlay
        if overlay == "gpu":
            assert not secret_names, "the gpu overlay must not ship a Secret"
            assert refs == {"flywheel-secrets"}
        else:
            assert refs <= secret_names
    base = "\n".join(p.read_text() for p in (K8S / "base").glob("*"))
    assert "kind: Secret" not in base and "secretGenerator" not in base


def _all_keys(data: dict) -> set[str]:
    keys = set(data)
    for value in data.values():
        if isinstance(value, dict):
            keys |= _all_keys(value)
    return keys


def test_credentials_come_only_from_secrets(rendered):
    """API keys, tokens and the Redis password reach containers through secretKeyRef (never a
    literal or the ConfigMap), and every required key exists in the dev overlay's Secret."""
    sensitive = re.compile(r"(API_KEY|PASSWORD|TOKEN)$")
    for overlay, objs in rendered.items():
        required, optional = set(), set()
        for workload in _workloads(objs):
            spec = _pod_spec(workload)
            for container in spec.get("initContainers", []) + spec["containers"]:
                for item in container.get("env", []):
                    if not sensitive.search(item["name"]):
                        continue
                    ref = item.get("valueFrom", {}).get("secretKeyRef")
                    assert ref, f"{overlay} {container['name']}: {item['name']} is not a secret"
                    (optional if ref.get("optional") else required).add(ref["key"])
        assert "redis-password" in required and "judge-api-key" in optional, overlay
        for cm in _of_kind(objs, "ConfigMap"):
            for name, text in cm["data"].items():
                keys = _all_keys(yaml.safe_load(text))
                assert not keys & {"api_key", "password", "token"}, (name, keys)
                assert "redis://:" not in text, f"{name} carries a Redis password"
        if overlay == "cpu-dev":
            (secret,) = _of_kind(objs, "Secret")
            assert required <= set(secret.get("data", {})), required


def test_gateway_reads_the_trainer_metrics_log_for_the_dashboard(docs, tmp_path, monkeypatch):
    paths, claims = {}, {}
    for workload, container, service in _flywheel_containers(docs):
        if service in ("gateway", "trainer"):
            settings = _settings_for(docs, workload, container, tmp_path, monkeypatch)
            path = settings.trainer.logging.metrics_path
            volumes = {v["name"]: v for v in _pod_spec(workload)["volumes"]}
            (mount,) = [
                m
                for m in container["volumeMounts"]
                if path.startswith(m["mountPath"].rstrip("/") + "/")
            ]
            claims[service] = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
            paths[service] = path
    assert paths["gateway"] == paths["trainer"] and claims["gateway"] == claims["trainer"]
