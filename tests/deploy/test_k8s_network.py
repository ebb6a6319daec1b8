"""deploy/k8s, checked offline: what is exposed, what the NetworkPolicies let through, and where
credentials come from (see test_k8s.py for rendering, probes and configuration)."""

from __future__ import annotations

import re

import yaml

from .k8s_manifests import (
    K8S,
    _flywheel_containers,
    _matches,
    _of_kind,
    _pod_labels,
    _pod_spec,
    _settings_for,
    _workloads,
    admits,
)

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
        assert admits(docs, labels(src), w[dst], port), f"{src} cannot reach {dst}:{port}"
    assert admits(docs, None, w["gateway"], 8000), "the gateway is not reachable"
    for dst, port in [
        ("engine", 30000),
        ("redis", 6379),
        ("trainer", 8100),
        ("reward", 50051),
        ("teacher", 50052),
        ("teacher-engine", 30000),
    ]:
        assert not admits(docs, None, w[dst], port), f"{dst}:{port} is open to outside"
    forbidden = [
        ("gateway", "trainer", 8100),
        ("engine", "redis", 6379),
        ("reward", "engine", 30000),
        ("gateway", "teacher-engine", 30000),
        ("trainer", "teacher-engine", 30000),
    ]
    for src, dst, port in forbidden:
        assert not admits(docs, labels(src), w[dst], port), f"{src} may reach {dst}:{port}"


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
