"""Weight push into a real engine process (`python -m flywheel.engine`, tiny model): over the
distributed weight-update group (gloo), and the disk fallback when the group cannot form."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.trainer.service import build_trainer

from ..engine_process import engine_process

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir):
    with engine_process(tiny_model_dir, context_length="256") as url:
        yield url


def served(url: str, name: str) -> torch.Tensor:
    r = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 2})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json())


def served_version(url: str) -> str:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    return httpx.post(f"{url}/generate", json=body, timeout=30).json()["meta_info"][
        "weight_version"
    ]


def settings_for(tmp_path, model_dir, engine_url, **push):
    return load_settings(
        trainer={
            "model_path": str(model_dir),
            "port": free_port(),
            "checkpoint": {"dir": str(tmp_path / "ckpt")},
            "logging": {"metrics_path": str(tmp_path / "m.jsonl"), "tensorboard": False},
            "data": {"source": "fake", "fake_prompt_tokens": 4, "fake_completion_tokens": 4},
            "batch": {"group_size": 2, "groups_per_step": 1},
            "optim": {"lr": 1e-2},
            "push": {"engine_urls": [engine_url], "attempts": 1, "timeout_s": 15} | push,
        }
    )


def test_distributed_push_then_disk_fallback(tmp_path, tiny_model_dir, engine_url):
    name = "model.layers.0.self_attn.q_proj.weight"
    trainer = build_trainer(settings_for(tmp_path, tiny_model_dir, engine_url, mode="distributed"))
    assert trainer.run(max_steps=1) == 1
    assert trainer.last_push_via == "distributed"
    saved = load_file(tmp_path / "ckpt" / "step_00000001" / "model.safetensors")
    torch.testing.assert_close(served(engine_url, name), saved[name][:2], atol=0, rtol=0)
    assert served_version(engine_url) == "1"

    # the group breaks (the engine side is destroyed behind the trainer's back): the next push
    # falls back to the disk path and the engine still gets the newest weights
    httpx.post(
        f"{engine_url}/destroy_weights_update_group",
        json={"group_name": "weight_update_group"},
        timeout=30,
    )
    assert trainer.run(max_steps=1) == 1
    assert trainer.last_push_via == "disk"
    saved = load_file(tmp_path / "ckpt" / "step_00000002" / "model.safetensors")
    torch.testing.assert_close(served(engine_url, name), saved[name][:2], atol=0, rtol=0)
    assert served_version(engine_url) == "2"
    trainer.close()
