"""deploy/k8s is checked offline: every overlay renders with `kubectl kustomize`, every object
passes `kubernetes-validate --strict`, and the manifests agree with what the services really do:
probes hit endpoints the service serves on the port its settings give it, the config map and the
FLYWHEEL_* variables parse into valid settings, only the gateway is reachable from outside, and
NetworkPolicies let exactly the needed traffic through."""

from __future__ import annotations

import copy
import re
from urllib.parse import urlparse

import pytest
import yaml

from flywheel.core.fleet import static_urls
from flywheel.core.settings import FlywheelSettings

from .k8s_manifests import (
    FLYWHEEL_GRPC,
    FLYWHEEL_HTTP,
    K8S_VERSION,
    OTHER_IMAGES,
    ROOT,
    SERVICES_SRC,
    _config_text,
    _env_values,
    _flywheel_containers,
    _flywheel_service,
    _image_repo,
    _matches,
    _of_kind,
    _pod_labels,
    _pod_spec,
    _service_ports,
    _settings_for,
    _unknown_keys,
    _workloads,
)

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
                    assert re.search(rf'\.get\("{re.escape(path)}"[,)]', routes), (
                        f"{service} serves no {path}"
                    )
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
            "gateway": static_urls(settings),  # and the fleet's (test_k8s_fleet.py)
            "trainer": settings.trainer.push.engine_urls or static_urls(settings),
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
