"""deploy/k8s and the distributed weight push (trainer.push.mode = "distributed"), checked
offline in both overlays: the trainer publishes the group's rendezvous port, tells the engines
an address they can reach (its pod IP), and the NetworkPolicies let the group's ranks (trainer
and engines) connect to each other on the rendezvous and the gloo / NCCL ports, and nobody else.
"""

from __future__ import annotations

from .k8s_manifests import (
    _of_kind,
    _pod_labels,
    _pod_spec,
    _settings_for,
    _workloads,
    admits,
)

GROUP_PORT = 29600
EPHEMERAL = 45123
"""A port gloo / NCCL may pick for a rank's connections (Linux's ephemeral range)."""


def _workload(docs, name: str) -> dict:
    (w,) = [x for x in _workloads(docs) if x["metadata"]["name"] == name]
    return w


def test_the_trainer_publishes_the_rendezvous_port_and_its_pod_ip(docs, tmp_path, monkeypatch):
    trainer = _workload(docs, "trainer")
    container = _pod_spec(trainer)["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["weight-sync"] == GROUP_PORT
    (service,) = [s for s in _of_kind(docs, "Service") if s["metadata"]["name"] == "trainer"]
    assert {"name": "weight-sync", "port": GROUP_PORT, "targetPort": "weight-sync"} in service[
        "spec"
    ]["ports"]
    (address,) = [
        e for e in container["env"] if e["name"] == "FLYWHEEL_TRAINER__PUSH__MASTER_ADDRESS"
    ]
    assert address["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    settings = _settings_for(docs, trainer, container, tmp_path, monkeypatch)
    assert settings.trainer.push.master_port == GROUP_PORT
    assert settings.trainer.push.master_address == "pod-0"  # the stand-in of a fieldRef value
    assert settings.trainer.push.mode in ("disk", "distributed")


def test_only_the_group_ranks_reach_each_other_on_the_group_ports(docs):
    w = {x["metadata"]["name"]: x for x in _workloads(docs)}

    def labels(name: str) -> dict:
        return _pod_labels(w[name])

    for port in (GROUP_PORT, EPHEMERAL):  # the rendezvous listens on the trainer only
        assert admits(docs, labels("engine"), w["trainer"], port), f"engine -> trainer:{port}"
    assert admits(docs, labels("trainer"), w["engine"], EPHEMERAL), "trainer -> engine"
    assert admits(docs, labels("engine"), w["engine"], EPHEMERAL), "engine -> engine"
    assert not admits(docs, labels("trainer"), w["engine"], GROUP_PORT)
    for port in (GROUP_PORT, EPHEMERAL):
        assert not admits(docs, None, w["trainer"], port), f"trainer:{port} open to outside"
        assert not admits(docs, None, w["engine"], port), f"engine:{port} open to outside"
        for other in ("gateway", "reward", "teacher", "teacher-engine", "redis"):
            assert not admits(docs, labels(other), w["trainer"], port), f"{other} -> trainer"
            assert not admits(docs, labels(other), w["engine"], port), f"{other} -> engine"
    # the group's rule does not open the trainer's control port to the engines, nor Redis
    assert not admits(docs, labels("engine"), w["trainer"], 8100)
    assert not admits(docs, labels("engine"), w["redis"], 6379)
    assert not admits(docs, labels("trainer"), w["teacher-engine"], EPHEMERAL)
