"""The trainer's HTTP surface over a TrainerStatus."""

from __future__ import annotations

from fastapi.testclient import TestClient

from flywheel.trainer.http import create_app
from flywheel.trainer.telemetry import TrainerStatus


def test_health_ready_status_and_metrics():
    status = TrainerStatus()
    client = TestClient(create_app(status))
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 503  # model not loaded yet

    status.set_ready(step=3)
    status.record_drop("stale", 2)
    status.record_step(4, n_samples=8, metrics={"reward/mean": 0.5, "time/step_s": 1.0})
    assert client.get("/readyz").status_code == 200
    body = client.get("/status").json()
    assert body["step"] == 4 and body["weight_version"] == "4"
    assert body["samples_trained"] == 8
    assert body["samples_dropped"] == {"stale": 2}
    assert body["last_metrics"]["reward/mean"] == 0.5

    metrics = client.get("/metrics").text
    assert "flywheel_trainer_weight_version 4.0" in metrics
    assert 'flywheel_trainer_samples_dropped_total{reason="stale"}' in metrics
