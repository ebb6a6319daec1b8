"""What tests/deploy checks the Kubernetes manifests with: the rendered overlays' objects,
and helpers that read workloads, containers, services and settings out of them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

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


def _kubectl_ok() -> bool:
    if shutil.which("kubectl") is None:
        return False
    run = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True)
    return run.returncode == 0


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


def admits(docs, src_labels: dict | None, dst: dict, port: int) -> bool:
    """Would ingress to `dst` pods on TCP `port` be allowed from a pod with `src_labels` in the
    same namespace (None: a client outside the namespace)? Port ranges (`endPort`) count."""
    policies = [
        p
        for p in _of_kind(docs, "NetworkPolicy")
        if _matches(p["spec"]["podSelector"], _pod_labels(dst))
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(
                p.get("protocol", "TCP") == "TCP"
                and p["port"] <= port <= p.get("endPort", p["port"])
                for p in ports
            ):
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
