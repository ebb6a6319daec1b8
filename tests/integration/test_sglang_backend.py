"""`flywheel up`'s engine backends through real processes: a launched "SGLang" (the stand-in in
tests/sglang_standin.py, which serves the embedded engine behind SGLang's command line and
nothing else), health-gated, answering a chat through the gateway; a launched engine that exits,
during start-up or later, reported with its log tail; and attach mode, which starts no engine.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from flywheel.core.errors import ConfigurationError
from flywheel.core.settings import EngineSettings, load_settings
from flywheel.ops.engine_launch import wait_attached
from flywheel.ops.stack import Stack

from ..engine_process import engine_process
from .up_cli import run_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STANDIN = [sys.executable, str(Path(__file__).resolve().parents[1] / "sglang_standin.py")]


def _settings(tmp_path, redis_server, tiny_model_dir, engine: dict, port: int):
    return load_settings(
        redis={"url": redis_server.url},
        streams={"prefix": f"sglang{port}"},
        engine={"model_path": str(tiny_model_dir), "port": port, **engine},
        gateway={"port": port - 22000, "default_max_tokens": 4},
        state_dir=str(tmp_path / "state"),
    )


def test_a_launched_sglang_serves_the_gateway_with_the_flags_it_was_given(
    tmp_path, redis_server, tiny_model_dir
):
    engine = {
        "backend": "sglang",
        "sglang_launcher": STANDIN,
        "served_model_name": "policy-under-test",
        "weight_version": "3",
        # Above the tiny model's trained 2048 positions: served only because flywheel up sets
        # SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN for the launched server (the stand-in drops
        # Flywheel's own engine settings, so the flag and that variable are all it gets).
        "context_length": 4096,
        "allow_longer_context": True,
        "max_batch_size": 8,
        "sglang_args": ["--mem-fraction-static", "0.8"],
    }
    s = _settings(tmp_path, redis_server, tiny_model_dir, engine, 31731)
    stack = Stack(s, echo=lambda _: None, only=("engine", "gateway"))
    with stack:
        served, gateway = stack.services
        assert served.name == "engine" and served.proc is not None
        assert served.argv(sys.executable)[:2] == STANDIN
        info = httpx.get(f"{served.url}/get_server_info", timeout=10).json()
        assert info["served_model_name"] == "policy-under-test"
        assert info["weight_version"] == "3"
        assert info["context_length"] == 4096
        assert info["max_running_requests"] == 8
        reply = httpx.post(
            f"{gateway.url}/v1/chat/completions",
            json={
                "model": "SmolLM2-135M-Instruct",
                "messages": [{"role": "user", "content": "Hi"}],
            },
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] >= 1
        assert body["choices"][0]["finish_reason"] in ("stop", "length")

        # Later, the engine dies: the stack names it with the tail of its log.
        served.proc.kill()
        served.proc.wait(30)
        assert stack.exited() == [served]
        report = served.exit_report()
        assert report.startswith(f"engine exited with -9; the end of its log {served.log_path}")
        assert "sglang stand-in: --model-path" in report  # its first line, this run's


def test_a_launched_engine_that_exits_during_start_up_is_reported_with_its_log_tail(
    tmp_path, redis_server, tiny_model_dir
):
    engine = {"backend": "sglang", "sglang_launcher": STANDIN, "sglang_args": ["--no-such-flag"]}
    s = _settings(tmp_path, redis_server, tiny_model_dir, engine, 31741)
    stack = Stack(s, echo=lambda _: None, only=("engine", "gateway"))
    with pytest.raises(RuntimeError) as failure:
        stack.start()
    message = str(failure.value)
    assert message.startswith("engine exited with 2 during start-up")
    assert "pip install 'flywheel[sglang]'" in message  # what to do
    assert "unrecognized arguments: --no-such-flag" in message  # from its log
    assert stack.services == []  # stopped: the gateway never started


def test_flywheel_up_says_why_a_launched_engine_did_not_start(tmp_path, tiny_model_dir):
    state = tmp_path / "state"
    cfg = tmp_path / "flywheel.toml"
    launcher = ", ".join(f'"{part}"' for part in STANDIN)
    cfg.write_text(
        f'state_dir = "{state}"\n[redis]\nport = 16411\n'
        f'[engine]\nbackend = "sglang"\nmodel_path = "{tiny_model_dir}"\nport = 31751\n'
        f'sglang_launcher = [{launcher}]\nsglang_args = ["--tp-size", "two"]\n'
        f"[gateway]\nport = 8751\n[reward]\nport = 50751\nmetrics_port = 9751\n"
        f"[trainer]\nport = 8761\n"
    )
    done = run_up(cfg, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "flywheel: engine exited with 2 during start-up" in done.stderr
    assert "argument --tp-size/--tensor-parallel-size: invalid int value: 'two'" in done.stderr
    assert "Traceback" not in done.stderr


def test_attach_mode_waits_for_the_engines_and_never_starts_one(
    tmp_path, redis_server, tiny_model_dir
):
    s = load_settings(
        engine={
            "backend": "external",
            "urls": ["http://127.0.0.1:9"],
            "startup_timeout_s": 2,
            "model_path": str(tiny_model_dir),
        },
        state_dir=str(tmp_path / "down"),
        redis={"url": redis_server.url},
    )
    stack = Stack(s, echo=lambda _: None, only=("engine",))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"engine http://127.0.0.1:9 did not answer /health"):
        stack.start()
    assert time.monotonic() - started < 30 and stack.services == []

    with engine_process(tiny_model_dir) as url:  # context length 512
        # An engine serving a shorter context than the gateway would allow is refused.
        too_long = EngineSettings(
            backend="external", urls=[url], model_path=str(tiny_model_dir), context_length=1024
        )
        with pytest.raises(ConfigurationError, match="its context length is 512, below engine"):
            wait_attached([url], too_long, 10, lambda _: None)
        lines: list[str] = []
        s = load_settings(
            redis={"url": redis_server.url},
            streams={"prefix": "attached"},
            engine={
                "backend": "external",
                "urls": [url],
                "model_path": str(tiny_model_dir),
                "context_length": 512,
            },
            gateway={"port": 8771, "default_max_tokens": 4},
            state_dir=str(tmp_path / "state"),
        )
        with Stack(s, echo=lines.append, only=("engine", "gateway")) as stack:
            assert [svc.name for svc in stack.services] == ["gateway"]
            assert any(
                ln.startswith(f"engine    {url}  healthy") and "attached" in ln for ln in lines
            )
            reply = httpx.post(
                f"{stack.services[0].url}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
                timeout=120,
            )
            assert reply.status_code == 200, reply.text
            state = (tmp_path / "state" / "stack.json").read_text()
            assert f'"engine": "{url}"' in state  # `flywheel status` probes the attached engine
        # The stack stopped; the engine it attached to, not its own, still serves.
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
