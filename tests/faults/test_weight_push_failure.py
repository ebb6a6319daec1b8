"""A weight update that fails on one engine, under load, with two real engine processes.

Engine `good` serves the tiny model; engine `bad` was started (misconfigured) with a model of
another shape, so it refuses every `/update_weights_from_disk` of the trainer's checkpoints with
a 400. While agents keep chatting through a gateway in front of both engines, the trainer (real,
in this process, random groups as its source) steps twice; each push:

* gives `good` the new version;
* tries `bad` exactly `push_attempts` times (bounded), then reports it: the push-failure metric
  counts it, `/status` lists it as behind with the engine's reason, its version gauge stays old;
* leaves serving untouched: every chat request of the load is answered.

Then `bad` is restarted on its port with the right model, and the next step's push catches it up
to the newest version (nothing behind any more).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client import REGISTRY

from flywheel.core.redis_server import free_port
from flywheel.core.settings import load_settings
from flywheel.trainer.service import build_trainer

from .conftest import Procs, wait_http

ATTEMPTS = 2


def _wrong_shape_model(tiny: Path, out: Path) -> Path:
    """The tiny model's files, but an MLP of width 96 instead of the tiny model's 128."""
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    out.mkdir()
    for f in tiny.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = LlamaConfig.from_pretrained(tiny)
    assert config.intermediate_size != 96
    config.intermediate_size = 96
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def _engine(procs: Procs, model: Path, port: int, name: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env |= {"FLYWHEEL_ENGINE__CONTEXT_LENGTH": "512", "FLYWHEEL_ENGINE__THREADS": "1"}
    procs.spawn(
        [sys.executable, "-m", "flywheel.engine", "--model-path", str(model), "--port", str(port)],
        name,
        env=env,
    )


def _version(url: str) -> str:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    return httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"][
        "weight_version"
    ]


def _refused_updates(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = 'flywheel_engine_weight_updates_total{outcome="failed"}'
    return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line))


def _gauge(name: str, engine: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"engine": engine})


def test_a_push_refused_by_one_engine_is_retried_reported_and_caught_up(
    procs, tmp_path, tiny_model_dir, inproc_gateway
):
    wrong = _wrong_shape_model(tiny_model_dir, tmp_path / "wrong")
    good_port = free_port()
    _engine(procs, tiny_model_dir, good_port, "engine-good")
    while (bad_port := free_port()) == good_port:  # `good` may not have bound its port yet
        time.sleep(0.1)
    _engine(procs, wrong, bad_port, "engine-bad")
    bad_proc = procs.procs[-1]
    good, bad = f"http://127.0.0.1:{good_port}", f"http://127.0.0.1:{bad_port}"
    for url in (good, bad):
        wait_http(f"{url}/health", 180)
    gateway = inproc_gateway([good, bad])

    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=gateway, timeout=120) as http:
            i = 0
            while not stop.is_set():
                i += 1
                reply = http.post(
                    "/v1/chat/completions",
                    json={
                        "model": "m",
                        "max_tokens": 4,
                        "messages": [{"role": "user", "content": f"What is {i} + 1?"}],
                    },
                )
                statuses.append(reply.status_code)

    agents = [threading.Thread(target=load) for _ in range(2)]
    for t in agents:
        t.start()
    settings = load_settings(
        trainer={
            "model_path": str(tiny_model_dir),
            "checkpoint": {"dir": str(tmp_path / "ckpt")},
            "logging": {"metrics_path": str(tmp_path / "m.jsonl"), "tensorboard": False},
            "data": {"source": "fake", "fake_prompt_tokens": 4, "fake_completion_tokens": 4},
            "batch": {"group_size": 2, "groups_per_step": 1},
            "optim": {"lr": 1e-2},
            "push": {"engine_urls": [good, bad], "attempts": ATTEMPTS, "timeout_s": 60},
            "port": free_port(),
        }
    )
    trainer = build_trainer(settings)
    try:
        for step in (1, 2):
            served_before = len(statuses)
            assert trainer.run(max_steps=1) == 1  # one engine took the version: training goes on
            behind = trainer.parts.status.snapshot()["engines_behind"]
            assert list(behind) == [bad], behind
            assert "refused weights" in behind[bad] and "400" in behind[bad], behind[bad]
            # bounded: each push tried `bad` exactly ATTEMPTS times (2 per step), then reported
            assert _refused_updates(bad) == ATTEMPTS * step
            assert _gauge("flywheel_trainer_weight_push_failures_total", bad) == step
            assert _gauge("flywheel_trainer_engine_weight_version", good) == step
            assert _gauge("flywheel_trainer_engine_weight_version", bad) is None  # never took one
            assert REGISTRY.get_sample_value("flywheel_trainer_engines_behind") == 1
            assert _version(good) == str(step) and _version(bad) == "default"
            deadline = time.monotonic() + 60
            while len(statuses) <= served_before:  # the load is being served meanwhile
                assert time.monotonic() < deadline, "no request was served during the push"
                time.sleep(0.05)
        stop.set()
        for t in agents:
            t.join(timeout=120)
        assert statuses and set(statuses) == {200}, sorted(set(statuses))

        # the operator fixes `bad` (right model, same port): the next push catches it up
        procs.kill(bad_proc)
        _engine(procs, tiny_model_dir, bad_port, "engine-bad-fixed")
        wait_http(f"{bad}/health", 180)
        assert trainer.run(max_steps=1) == 1
        assert trainer.parts.status.snapshot()["engines_behind"] == {}
        assert _version(good) == _version(bad) == "3"
        assert _gauge("flywheel_trainer_engine_weight_version", bad) == 3
        assert _gauge("flywheel_trainer_weight_push_failures_total", bad) == 2  # no new failure
        assert REGISTRY.get_sample_value("flywheel_trainer_engines_behind") == 0
    finally:
        stop.set()
        trainer.close()
