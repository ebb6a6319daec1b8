"""Crash safety of the trainer with real processes and a real Redis: kill -9 between
checkpoints (`checkpoint_every = 3`) while a step is in progress; restart; the newest checkpoint
is restored and the recorded step after it is trained again with the same groups; every Sample
is trained exactly once in the surviving lineage, nothing is left pending, weight versions never
go backwards on the engine, and the final weights equal an uninterrupted run's on the same
entries.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings

from .push_target import PushTarget
from .test_trainer_service import make_group, pending_count, publish

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]

HANG_IN_STEP = """
import pathlib, sys, time
import flywheel.trainer.service as service
marker, hang_at = pathlib.Path(sys.argv[1]), int(sys.argv[2])
real_step, calls = service.train_step, []
def step_hangs(*args, **kwargs):
    calls.append(1)
    if len(calls) == hang_at:
        marker.write_text(f"in step {hang_at}")
        time.sleep(600)
    return real_step(*args, **kwargs)
service.train_step = step_hangs
from flywheel.trainer.main import main
sys.exit(main(["--config", sys.argv[3]]))
"""


class HangingEngine(PushTarget):
    """Records /update_weights_from_disk calls and serves the last version it took on
    /model_info; a push of `hang_version` never answers."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.hang_version = ""
        self.release = threading.Event()
        super().__init__()

    def on_push(self, path: str, body: dict) -> tuple[int, dict]:
        self.calls.append(body["weight_version"])
        if body["weight_version"] == self.hang_version:
            self.release.wait(60)
            return 200, {}
        return super().on_push(path, body)

    def close(self) -> None:
        self.release.set()
        super().close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama_crash")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def write_config(tmp_path, redis_url, prefix, model_dir, engine_url, **trainer) -> Path:
    values = {
        "model_path": str(model_dir),
        "precision": "fp32",
        "consumer_name": "trainer-0",
        "port": free_port(),
    } | trainer
    sections = {
        "batch": {"group_size": 4, "groups_per_step": 1, "group_wait_s": 60},
        "optim": {"lr": 1e-2},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "keep": 10, "every": 3},
        "push": {"engine_urls": [engine_url], "attempts": 1, "timeout_s": 120},
        "logging": {"metrics_path": str(tmp_path / "metrics.jsonl"), "tensorboard": False},
    }
    lines = [
        f'[redis]\nurl = "{redis_url}"',
        f'[streams]\nprefix = "{prefix}"\nblock_ms = 100\nmin_idle_ms = 600000',
        "[trainer]",
    ] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    for name, fields in sections.items():
        lines += [f"[trainer.{name}]"] + [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    path = tmp_path / f"trainer-{values['port']}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def start(args: list[str], log_path: Path) -> subprocess.Popen:
    env = os.environ | {"PYTHONPATH": str(REPO / "services")}
    log = log_path.open("wb")
    return subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=log)


def wait_for(condition, proc: subprocess.Popen, log_path: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.05)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def trained_sample_ids(ckpt_dir: Path) -> dict[int, list[str]]:
    return {
        int(p.name.split("_")[1]): json.loads((p / "trainer_state.json").read_text())["sample_ids"]
        for p in sorted(ckpt_dir.glob("step_*"))
    }


def run_to_end(tmp_path, config: Path, name: str) -> None:
    log_path = tmp_path / f"{name}.log"
    proc = start(["-m", "flywheel.trainer", "--config", str(config)], log_path)
    assert proc.wait(timeout=180) == 0, log_path.read_text()[-3000:]


def commit_log_steps(ckpt_dir: Path) -> list[int]:
    path = ckpt_dir / "commits.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line)["step"] for line in lines if line.strip()]


def test_kill_between_checkpoints_then_resume_trains_each_sample_once(
    tmp_path, redis_server, prefix, model_dir
):
    engine = HangingEngine()
    groups = [make_group(model_dir, f"g{i}") for i in range(1, 6)]
    published = [s.sample_id for g in groups for s in g]
    try:
        config = write_config(tmp_path, redis_server.url, prefix, model_dir, engine.url)
        settings = load_settings(config)
        publish(settings, [s for g in groups for s in g])

        # 1. steps 1-4 commit (checkpoint 3 is durable); the process is killed inside step 5
        marker = tmp_path / "in_step_5"
        log_a = tmp_path / "a.log"
        proc = start(["-c", HANG_IN_STEP, str(marker), "5", str(config)], log_a)
        ckpt = tmp_path / "ckpt"
        wait_for(
            lambda: marker.exists() and (ckpt / "step_00000003" / "trainer_state.json").exists(),
            proc,
            log_a,
        )
        kill(proc)
        assert sorted(trained_sample_ids(ckpt)) == [3]  # one checkpoint: steps 1-3
        assert 4 in commit_log_steps(ckpt)  # step 4 is committed, not checkpointed
        assert pending_count(settings) >= 8  # steps 4 and 5 are the replay log

        # 2. a restart restores checkpoint 3, trains recorded step 4 again, trains step 5,
        #    checkpoints at its clean stop and acks everything
        config_b = write_config(
            tmp_path, redis_server.url, prefix, model_dir, engine.url, max_steps=1
        )
        run_to_end(tmp_path, config_b, "b")
    finally:
        engine.close()

    by_step = trained_sample_ids(ckpt)
    assert sorted(by_step) == [3, 5]
    trained = [sample_id for ids in by_step.values() for sample_id in ids]
    assert sorted(trained) == sorted(published)  # none lost, none trained twice
    assert pending_count(settings) == 0
    assert commit_log_steps(ckpt) == []  # every record is covered by checkpoint 5
    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step4 = [m for m in metrics if m["step"] == 4]
    assert len(step4) == 2 and step4[0]["n_samples"] == step4[1]["n_samples"] == 4
    assert [m["replayed"] for m in step4] == [False, True]  # the second line says so
    assert step4[0]["reward/mean"] == step4[1]["reward/mean"]  # the same group again
    # versions never went backwards on the engine: step 4 was not pushed again when it was
    # already served, and every push was newer than the one before
    versions = [int(v) for v in engine.calls]
    assert versions == sorted(versions) and len(set(versions)) == len(versions), versions
    assert engine.served == "5"

    # 3. an uninterrupted run on the same entries (a second stream) ends with the same weights
    prefix2 = f"{prefix}-again"
    clean = tmp_path / "clean"
    clean.mkdir()
    other = HangingEngine()
    try:
        config_c = write_config(clean, redis_server.url, prefix2, model_dir, other.url, max_steps=5)
        publish(load_settings(config_c), [s for g in groups for s in g])
        run_to_end(clean, config_c, "c")
    finally:
        other.close()
    resumed = load_file(ckpt / "step_00000005" / "model.safetensors")
    uninterrupted = load_file(clean / "ckpt" / "step_00000005" / "model.safetensors")
    for name, tensor in uninterrupted.items():
        assert torch.allclose(resumed[name], tensor, atol=1e-6, rtol=0), name
