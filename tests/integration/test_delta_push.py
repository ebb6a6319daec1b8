"""Delta pushes into a real engine process (`python -m flywheel.engine`, tiny model, bf16) from
real trainer steps: after several deltas the served weights equal the full weights bit for bit;
a checksum mismatch or a base the engine does not serve falls back to a full push, counted on
both sides."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.trainer.deltas import DELTA_FALLBACKS, DELTAS_APPLIED
from flywheel.trainer.service import build_trainer
from flywheel.trainer.weights import WeightsStore

from ..engine_process import engine_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir):
    with engine_process(tiny_model_dir, context_length="256", dtype="bfloat16") as url:
        yield url


def settings_for(tmp_path, model_dir, engine_url):
    return load_settings(
        engine={"dtype": "bfloat16"},
        trainer={
            "model_path": str(model_dir),
            "port": free_port(),
            "precision": "fp32",
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 1, "keep": 10},
            "logging": {"metrics_path": str(tmp_path / "m.jsonl"), "tensorboard": False},
            "data": {"source": "fake", "fake_prompt_tokens": 4, "fake_completion_tokens": 4},
            "batch": {"group_size": 2, "groups_per_step": 1},
            "staleness": {"max_staleness": 100},  # fake samples are stamped version 0
            # 2e-4 against bf16 spacings of ~1e-3 at |w| ~ 0.2: a share of the elements
            # changes per step, so the deltas hold sparse and whole-tensor entries
            "optim": {"lr": 2e-4},
            "push": {
                "engine_urls": [engine_url],
                "attempts": 1,
                "timeout_s": 30,
                "delta": True,
                "dtype": "bfloat16",
            },
        },
    )


def served_state(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Every named tensor as the engine serves it (bf16 -> float32 is exact)."""
    out = {}
    for name in names:
        r = httpx.post(
            f"{url}/get_weights_by_name",
            json={"name": name, "truncate_size": 1_000_000},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        out[name] = torch.tensor(r.json(), dtype=torch.float32)
    return out


def assert_serves_checkpoint(url: str, checkpoint: Path) -> None:
    """The engine's weights are the checkpoint's cast to bf16 (= what a full push sends), bit
    for bit, every tensor."""
    full = {k: v.to(torch.bfloat16).float() for k, v in load_file(checkpoint).items()}
    served = served_state(url, sorted(full))
    for name, tensor in full.items():
        assert torch.equal(served[name].view(tensor.shape), tensor), name


def engine_deltas(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = r'flywheel_engine_weight_deltas_total\{outcome="(\w+)"\} ([0-9.e+]+)'
    return {m[0]: float(m[1]) for m in re.findall(pattern, text)}


def model_info_version(url: str) -> str:
    return str(httpx.get(f"{url}/model_info", timeout=10).json()["weight_version"])


def fallbacks(reason: str) -> float:
    return DELTA_FALLBACKS.labels(reason)._value.get()


def test_delta_pushes_equal_full_bit_for_bit_and_fall_back(tmp_path, tiny_model_dir, engine_url):
    ckpt = tmp_path / "ckpt"
    trainer = build_trainer(settings_for(tmp_path, tiny_model_dir, engine_url))
    applied0 = DELTAS_APPLIED._value.get()
    assert trainer.run(max_steps=4) == 4
    # step 1 had no base (full); steps 2-4 went as deltas and were applied
    assert DELTAS_APPLIED._value.get() - applied0 == 3
    assert model_info_version(engine_url) == "4"
    v4 = ckpt / "weights" / "v_00000004"
    assert (v4 / "delta.safetensors").is_file() and not (v4 / "model.safetensors").exists()
    stats = trainer.parts.pusher.deltas.store.last_stats
    assert 0 < stats.changed_elements < stats.elements  # a real delta, not the whole model
    assert_serves_checkpoint(engine_url, ckpt / "step_00000004" / "model.safetensors")

    # the engine's weights change behind the trainer's back under the same label: the next
    # delta's result digests differ, the engine refuses it, the trainer pushes full (counted)
    before = engine_deltas(engine_url).get("checksum_mismatch", 0.0)
    mismatches = fallbacks("checksum_mismatch")
    tampered = load_file(ckpt / "step_00000004" / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tampered[name] = tampered[name] + 0.5
    folder = WeightsStore(tmp_path / "tampered", tiny_model_dir).write(4, tampered)
    r = httpx.post(
        f"{engine_url}/update_weights_from_disk",
        json={"model_path": str(folder), "weight_version": "4"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert trainer.run(max_steps=1) == 1
    assert fallbacks("checksum_mismatch") - mismatches == 1
    assert engine_deltas(engine_url)["checksum_mismatch"] - before == 1
    v5 = ckpt / "weights" / "v_00000005"
    assert (v5 / "model.safetensors").is_file()  # written for the fallback
    assert model_info_version(engine_url) == "5"
    assert_serves_checkpoint(engine_url, ckpt / "step_00000005" / "model.safetensors")

    # a relabelled engine (serves "0", the trainer's base is 5): base mismatch, full push
    httpx.post(f"{engine_url}/update_weight_version", json={"new_version": "0"}, timeout=10)
    base_mismatches = fallbacks("base_mismatch")
    assert trainer.run(max_steps=1) == 1
    assert fallbacks("base_mismatch") - base_mismatches == 1
    assert model_info_version(engine_url) == "6"
    assert_serves_checkpoint(engine_url, ckpt / "step_00000006" / "model.safetensors")

    # and deltas resume from there
    applied = DELTAS_APPLIED._value.get()
    assert trainer.run(max_steps=1) == 1
    assert DELTAS_APPLIED._value.get() - applied == 1
    assert_serves_checkpoint(engine_url, ckpt / "step_00000007" / "model.safetensors")
    trainer.close()
