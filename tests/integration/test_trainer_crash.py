"""Crash safety of the trainer with real processes and a real Redis: kill -9 mid-step, and
after a step's checkpoint but before its weight push; restart; every Sample is trained exactly
once, nothing is left pending, and weight versions stay consistent (engine, checkpoints, state).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flywheel.core.redis_client import connect
from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings

from .test_trainer_service import make_group, pending_count, publish

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]

SLOW_SECOND_STEP = """
import pathlib, sys, time
import flywheel.trainer.service as service
marker, real_step, calls = pathlib.Path(sys.argv[1]), service.train_step, []
def second_step_hangs(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        marker.write_text("in step 2")
        time.sleep(600)
    return real_step(*args, **kwargs)
service.train_step = second_step_hangs
from flywheel.trainer.main import main
sys.exit(main(["--config", sys.argv[2]]))
"""


class HangingEngine:
    """Records /update_weights_from_disk calls; a push of `hang_version` never answers."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.hang_version = ""
        self.release = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.calls.append(body["weight_version"])
                if body["weight_version"] == engine.hang_version:
                    engine.release.wait(60)
                    return
                reply = b'{"success": true, "message": "ok"}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


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
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "metrics_path": str(tmp_path / "metrics.jsonl"),
        "group_size": 4,
        "groups_per_step": 1,
        "group_wait_s": 60,
        "lr": 1e-2,
        "keep_checkpoints": 10,
        "engine_urls": [engine_url],
        "push_attempts": 1,
        "push_timeout_s": 120,
        "consumer_name": "trainer-0",
        "tensorboard": False,
        "port": free_port(),
    } | trainer
    lines = [
        f'[redis]\nurl = "{redis_url}"',
        f'[streams]\nprefix = "{prefix}"\nblock_ms = 100\nmin_idle_ms = 600000',
        "[trainer]",
    ] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
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


def test_kill_mid_step_and_before_push_then_resume_trains_each_sample_once(
    tmp_path, redis_server, prefix, model_dir
):
    engine = HangingEngine()
    try:
        config = write_config(tmp_path, redis_server.url, prefix, model_dir, engine.url)
        settings = load_settings(config)
        groups = [make_group(model_dir, f"g{i}") for i in range(1, 4)]
        published = [s.sample_id for g in groups for s in g]
        publish(settings, [s for g in groups for s in g])

        # 1. step 1 commits; the process is killed inside step 2 (before any checkpoint of it)
        marker = tmp_path / "in_step_2"
        log_a = tmp_path / "a.log"
        proc = start(["-c", SLOW_SECOND_STEP, str(marker), str(config)], log_a)
        wait_for(marker.exists, proc, log_a)
        kill(proc)
        assert sorted(trained_sample_ids(tmp_path / "ckpt")) == [1]
        assert engine.calls == ["1"]
        assert pending_count(settings) >= 4  # the killed step's entries are still pending

        # 2. a restart (same consumer name) takes its pending entries back and trains step 2;
        #    it is killed after the checkpoint of step 2, while the engine takes the push
        engine.hang_version = "2"
        log_b = tmp_path / "b.log"
        proc = start(["-m", "flywheel.trainer", "--config", str(config)], log_b)
        wait_for(lambda: "2" in engine.calls, proc, log_b)
        kill(proc)
        assert sorted(trained_sample_ids(tmp_path / "ckpt")) == [1, 2]
        assert pending_count(settings) >= 4  # step 2 is checkpointed but not acked

        # 3. a restart acks what checkpoint 2 trained, pushes it again, trains the rest, exits
        engine.hang_version = ""
        config_c = write_config(
            tmp_path, redis_server.url, prefix, model_dir, engine.url, max_steps=1
        )
        log_c = tmp_path / "c.log"
        proc = start(["-m", "flywheel.trainer", "--config", str(config_c)], log_c)
        assert proc.wait(timeout=120) == 0, log_c.read_text()[-3000:]
    finally:
        engine.close()

    by_step = trained_sample_ids(tmp_path / "ckpt")
    assert sorted(by_step) == [1, 2, 3]
    trained = [sample_id for ids in by_step.values() for sample_id in ids]
    assert sorted(trained) == sorted(published)  # none lost, none trained twice
    assert pending_count(settings) == 0
    assert connect(redis_server.url).xlen(settings.streams.key("dead")) == 0
    # every version was pushed, re-pushed on resume, and in order: 1, (kill), 1, 2 (kill), 2, 3
    assert engine.calls == ["1", "1", "2", "2", "3"]
    state = json.loads((tmp_path / "ckpt" / "step_00000003" / "trainer_state.json").read_text())
    assert state["weight_version"] == "3" and state["source_position"]["kind"] == "redis"
    optimizer = torch.load(
        tmp_path / "ckpt" / "step_00000003" / "training" / "optimizer.pt", weights_only=False
    )
    # AdamW resumed from checkpoint 2's state: 3 steps taken in all, not 1
    assert {float(s["step"]) for s in optimizer["state"].values()} == {3.0}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 3]
