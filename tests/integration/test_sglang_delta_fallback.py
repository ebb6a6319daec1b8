"""Delta pushes into a launched "SGLang" (`engine.backend = "sglang"`, the stand-in in
tests/sglang_standin.py): like a real SGLang server it has no `/update_weights_from_delta` and
answers FastAPI's 404 there, so the trainer, with `trainer.push.delta` on, falls back to full
disk pushes, counts each in `flywheel_trainer_weight_delta_fallbacks_total{reason="unsupported"}`,
logs it once, and the engine ends up with the full weights bit for bit."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import httpx
import pytest

from flywheel.core.settings import load_settings
from flywheel.ops.stack import Stack
from flywheel.trainer.deltas import DELTAS_APPLIED
from flywheel.trainer.service import build_trainer

from .test_delta_push import assert_serves_checkpoint, fallbacks, settings_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STANDIN = [sys.executable, str(Path(__file__).resolve().parents[1] / "sglang_standin.py")]


def test_sglang_without_the_delta_route_gets_full_pushes(
    tmp_path, redis_server, tiny_model_dir, caplog
):
    s = load_settings(
        redis={"url": redis_server.url},
        engine={
            "backend": "sglang",
            "sglang_launcher": STANDIN,
            "model_path": str(tiny_model_dir),
            "port": 31761,
            "dtype": "bfloat16",
            "context_length": 256,
        },
        state_dir=str(tmp_path / "state"),
    )
    with Stack(s, echo=lambda _: None, only=("engine",)) as stack:
        url = stack.services[0].url
        body = {"delta_path": str(tmp_path), "base_version": "default", "weight_version": "1"}
        missing = httpx.post(f"{url}/update_weights_from_delta", json=body, timeout=10)
        assert (missing.status_code, missing.json()) == (404, {"detail": "Not Found"})
        assert httpx.post(f"{url}/no_such_route", json={}, timeout=10).json() == missing.json()

        trainer = build_trainer(settings_for(tmp_path, tiny_model_dir, url))
        unsupported, applied = fallbacks("unsupported"), DELTAS_APPLIED._value.get()
        with caplog.at_level(logging.INFO, logger="flywheel.trainer"):
            assert trainer.run(max_steps=3) == 3
        # step 1 is full (no base); steps 2 and 3 wrote deltas, each fell back to a full push
        assert fallbacks("unsupported") - unsupported == 2
        assert DELTAS_APPLIED._value.get() == applied
        refusals = [r for r in caplog.records if "did not take the delta" in r.getMessage()]
        assert len(refusals) == 1 and "(unsupported: no /update_weights_from_delta" in (
            refusals[0].getMessage()
        )
        v3 = tmp_path / "ckpt" / "weights" / "v_00000003"
        assert (v3 / "delta.safetensors").is_file() and (v3 / "model.safetensors").is_file()
        # SGLang's own way to say what it serves (the trainer reads it to skip a served version)
        info = httpx.get(f"{url}/model_info", timeout=120).json()
        assert info["weight_version"] == "3"
        assert_serves_checkpoint(url, tmp_path / "ckpt" / "step_00000003" / "model.safetensors")
        trainer.close()
