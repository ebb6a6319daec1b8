"""`flywheel up` / `flywheel demo` start-up failures: one message (with the failing service's
log tail from this run only) and exit 1, no traceback; an engine that reports a failed model
load, and an external Redis that does not answer, fail at once instead of after the timeout.

The engine is a stand-in module (a real child process on the real port, through the real
`flywheel up`), so no model is loaded; Redis is a real local server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

FAKE_ENGINE = textwrap.dedent('''
    """Stands in for `python -m flywheel.engine`: exits, or serves a failed model load."""
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    settings = json.load(open(os.environ["FLYWHEEL_CONFIG"]))["engine"]
    print("current run: engine settings", flush=True)
    if os.environ["FAKE_ENGINE_MODE"] == "exit":
        print("current run: cannot bind", flush=True)
        sys.exit(3)
    print(f"loading {settings['model_path']} failed", flush=True)
    print("Traceback (most recent call last):", flush=True)
    print(f"OSError: no model at {settings['model_path']}", flush=True)

    class Failed(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "failed"}).encode()
            self.send_response(503)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    HTTPServer((settings["host"], settings["port"]), Failed).serve_forever()
''')

DRIVER = textwrap.dedent("""
    import os, sys
    from flywheel.ops import cli, stack

    launch = stack.Stack._launch

    def fake_launch(self, service):  # the engine is the stand-in module
        if service.module == "flywheel.engine":
            service.module = "fake_engine"
            self.env["PYTHONPATH"] = os.pathsep.join(
                [sys.argv[1], *filter(None, [os.environ.get("PYTHONPATH")])])
        launch(self, service)

    stack.Stack._launch = fake_launch
    sys.exit(cli.main(sys.argv[2:]))
""")


def _run(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run `argv` in its own session; on timeout kill the session (the stack's children too)."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(extra)
    return env


def _config(tmp_path, body: str = "") -> str:
    state = tmp_path / "state"
    path = tmp_path / "flywheel.toml"
    path.write_text(f'state_dir = "{state}"\n[engine]\nmodel_path = "/nonexistent/model"\n{body}')
    return str(path)


def _up_with_fake_engine(tmp_path, mode: str, timeout: float = 90):
    (tmp_path / "fake_engine.py").write_text(FAKE_ENGINE)
    logs = tmp_path / "state" / "logs"
    logs.mkdir(parents=True)
    (logs / "engine.log").write_text("previous run: engine exited with 3\n")
    started = time.monotonic()
    run = _run(
        [sys.executable, "-c", DRIVER, str(tmp_path), "up", "--config", _config(tmp_path)],
        _env(FAKE_ENGINE_MODE=mode),
        timeout,
    )
    return run, time.monotonic() - started


def test_a_service_that_exits_during_start_up_is_a_message_with_this_runs_log(tmp_path):
    run, _ = _up_with_fake_engine(tmp_path, "exit")
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert "flywheel: engine exited with 3 during start-up" in run.stderr
    assert "current run: cannot bind" in run.stderr
    assert "previous run" not in run.stderr  # the log tail is this run's only
    assert "flywheel is up" not in run.stdout


def test_an_engine_whose_model_failed_to_load_fails_the_start_up_at_once(tmp_path):
    run, took = _up_with_fake_engine(tmp_path, "failed")  # timeout 90 s, not the 600 s wait
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr  # one line; the log file has the traceback
    assert run.stderr.strip() == (
        "flywheel: engine cannot start: loading the model /nonexistent/model failed (OSError: "
        "no model at /nonexistent/model); check [engine] model_path "
        f"(FLYWHEEL_ENGINE__MODEL_PATH); the traceback is in {tmp_path}/state/logs/engine.log"
    )
    assert "previous run" not in run.stderr
    assert took < 60


@pytest.mark.parametrize("command", [["up"], ["demo", "--new-stack"]])
def test_an_unreachable_external_redis_fails_before_any_service_starts(tmp_path, command):
    config = _config(tmp_path, '[redis]\nurl = "redis://:pw@127.0.0.1:1/0"\n')
    out = ["--out", str(tmp_path / "demo")] if command[0] == "demo" else []
    run = _run(
        [sys.executable, "-m", "flywheel.ops.cli", *command, "--config", config, *out], _env(), 60
    )
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    message = run.stderr.strip().splitlines()[-1]
    assert message.startswith("flywheel: Redis at redis://:***@127.0.0.1:1/0 does not answer")
    assert "FLYWHEEL_REDIS__URL" in message and "pw@" not in run.stderr
    state = tmp_path / "demo" / "stack" if command[0] == "demo" else tmp_path / "state"
    assert not (state / "logs").exists() or not any((state / "logs").iterdir())


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "[trainer.algorithm.params.ppo_clip]\nfoo = 1\n",
            "algorithm part 'ppo_clip' takes no parameters",
        ),
        ("[trainer.algorithm.params.quantile]\nk = 0.5\n", "names ['quantile'], which are not"),
    ],
)
def test_algorithm_settings_the_trainer_refuses_stop_up_before_any_service(
    tmp_path, body, expected
):
    run = _run(
        [sys.executable, "-m", "flywheel.ops.cli", "up", "--config", _config(tmp_path, body)],
        _env(),
        120,
    )
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    message = run.stderr.strip().splitlines()[-1]
    assert message.startswith("flywheel: invalid [trainer] settings: ") and expected in message
    logs = tmp_path / "state" / "logs"
    assert not logs.exists() or not any(logs.iterdir())  # no service was started


@pytest.mark.parametrize("command", [["up"], ["demo", "--steps", "1"]])
def test_an_old_flat_trainer_key_stops_up_and_demo_naming_its_new_place(tmp_path, command):
    config = _config(tmp_path, "[trainer]\npush_pause = 'in_place'\n")
    out = ["--out", str(tmp_path / "demo")] if command[0] == "demo" else []
    run = _run(
        [sys.executable, "-m", "flywheel.ops.cli", *command, "--config", config, *out], _env(), 60
    )
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr
    assert "trainer.push_pause moved to trainer.push.pause (FLYWHEEL_TRAINER__PUSH__PAUSE)" in (
        run.stderr
    )
    assert not (tmp_path / "state" / "logs").exists()
