"""deploy/k8s and the engine fleet, checked offline in both overlays: more than one engine
replica, a headless Service selecting exactly the engine pods on the engine port, and the
gateway and the trainer discovering the engines through its DNS name (no fixed engine list
that would bypass the fleet, and never the load-balanced ClusterIP Service)."""

from __future__ import annotations

from flywheel.core.fleet import static_urls

from .k8s_manifests import (
    _flywheel_service,
    _matches,
    _of_kind,
    _pod_labels,
    _pod_spec,
    _settings_for,
    _workloads,
)


def _engine(docs) -> dict:
    (engine,) = [w for w in _workloads(docs) if w["metadata"]["name"] == "engine"]
    return engine


def _headless(docs) -> dict:
    (service,) = [
        s
        for s in _of_kind(docs, "Service")
        if s["spec"].get("clusterIP") == "None"
        and _matches({"matchLabels": s["spec"]["selector"]}, _pod_labels(_engine(docs)))
    ]
    return service


def test_the_overlays_run_more_than_one_engine_behind_a_headless_service(docs):
    engine = _engine(docs)
    assert engine["spec"]["replicas"] >= 2
    # a rolling update never takes every engine down at once
    assert (
        engine["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] < engine["spec"]["replicas"]
    )
    service = _headless(docs)
    assert service["spec"]["publishNotReadyAddresses"] is False  # only pods that pass /health
    # it selects the engine pods and nothing else
    for workload in _workloads(docs):
        selected = _matches({"matchLabels": service["spec"]["selector"]}, _pod_labels(workload))
        assert selected == (workload["metadata"]["name"] == "engine"), workload["metadata"]
    (port,) = service["spec"]["ports"]
    (container,) = _pod_spec(engine)["containers"]
    assert {"name": "http", "containerPort": port["port"]} in container["ports"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_gateway_and_trainer_discover_the_engines_through_the_headless_service(
    docs, tmp_path, monkeypatch
):
    service = _headless(docs)
    engine_port = service["spec"]["ports"][0]["port"]
    seen = set()
    for workload in _workloads(docs):
        for container in _pod_spec(workload)["containers"]:
            name = _flywheel_service(container)
            if name not in ("gateway", "trainer"):
                continue
            settings = _settings_for(docs, workload, container, tmp_path, monkeypatch)
            fleet = settings.fleet
            assert fleet.discovery == "dns", name
            assert fleet.dns_name.split(".")[0] == service["metadata"]["name"], name
            assert fleet.dns_port == engine_port, name
            assert static_urls(settings) == [], name  # every engine comes from the fleet
            assert not settings.trainer.push.engine_urls, name  # pushes follow the fleet
            assert fleet.push_deadline_s > 0, name
            seen.add(name)
    assert seen == {"gateway", "trainer"}
