"""`flywheel demo --config FILE` refused by a gateway that requires an API key: the commands
its hint prints (create a key, list the keys, run the demo with the key) carry the same
`--config FILE`, so they reach the same stack as printed. A real `flywheel demo` process against
a stub gateway over real HTTP that answers 401 to `GET /v1/models`; the stack it finds is the
one the config file's state_dir names."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from flywheel.ops.demo.failures import describe_failure
from flywheel.ops.stack import STATE_FILE

from ..core.http_stub import JsonHandler


class _KeysRequired(JsonHandler):
    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/healthz":
            self._json(200, {})
        else:
            self._json(401, {"error": {"message": "missing or invalid API key"}})


@pytest.fixture
def config_file(tmp_path) -> Iterator[Path]:
    """A config file (in a folder with a space in its name) whose state_dir names the stub
    as a running stack; this process's pid stands for the stack's."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeysRequired)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    state = tmp_path / "state"
    state.mkdir()
    (state / STATE_FILE).write_text(json.dumps({"pid": os.getpid(), "gateway": url, "engine": url}))
    batch = {"group_size": 2, "groups_per_step": 1}
    (state / "settings.json").write_text(json.dumps({"trainer": {"batch": batch}}))
    folder = tmp_path / "my configs"
    folder.mkdir()
    path = folder / "lab.toml"
    path.write_text(f'state_dir = "{state}"\n')
    try:
        yield path
    finally:
        server.shutdown()
        server.server_close()


def _demo(config: Path, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    argv = ["demo", "--config", str(config), "--out", str(tmp_path / "demo")]
    return subprocess.run(
        [sys.executable, "-m", "flywheel.ops.cli", *argv, *flags]
        + ["--problems-per-step", "1", "--group-size", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_a_key_the_hint_repeats_the_config_file(config_file, tmp_path):
    run = _demo(config_file, tmp_path)
    assert run.returncode == 2, run.stderr
    config = f"--config {shlex.quote(str(config_file))}"
    assert f"`flywheel keys create {config} --role agent`" in run.stderr, run.stderr
    assert f"`flywheel demo {config} --api-key KEY`" in run.stderr, run.stderr


def test_a_refused_key_the_hint_repeats_the_config_file(config_file, tmp_path):
    run = _demo(config_file, tmp_path, "--api-key", "fw-wrong")
    assert run.returncode == 2, run.stderr
    config = f"--config {shlex.quote(str(config_file))}"
    assert f"`flywheel keys list {config}`" in run.stderr, run.stderr
    assert f"`flywheel keys create {config} --role agent`" in run.stderr, run.stderr
    assert f"`flywheel demo {config} --api-key KEY`" in run.stderr, run.stderr


def test_an_episode_refused_401_names_the_config_file_in_its_hint():
    request = httpx.Request("POST", "http://gateway.invalid/v1/sessions")
    reply = httpx.Response(401, json={"error": {"message": "invalid API key"}}, request=request)
    refused = httpx.HTTPStatusError("401", request=request, response=reply)
    said = describe_failure(refused, config="my configs/lab.toml")
    assert "`flywheel demo --config 'my configs/lab.toml' --api-key KEY`" in said, said
    assert "`flywheel keys create --config 'my configs/lab.toml' --role agent`" in said, said
    plain = describe_failure(refused)
    assert "`flywheel demo --api-key KEY`" in plain and "--config" not in plain, plain
