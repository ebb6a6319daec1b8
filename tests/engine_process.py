"""The embedded engine as a real process for tests: `python -m flywheel.engine` on a free port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from flywheel.core.redis_server import free_port

SERVICES = Path(__file__).resolve().parents[1] / "services"


@contextmanager
def engine_process(
    model_dir: Path,
    *args: str,
    log_path: Path | None = None,
    startup_s: float = 120,
    **env_overrides: str,
) -> Iterator[str]:
    """Serve `model_dir`; yields the engine's URL once `/health` is 200, stops it after.

    Args:
        model_dir: a Hugging Face model folder.
        *args: extra command-line arguments (e.g. "--weight-version", "7").
        log_path: a file for the engine's output (default: a pipe, shown on failure).
        startup_s: seconds the engine may take to become healthy.
        **env_overrides: engine settings as `FLYWHEEL_ENGINE__<NAME>` values (defaults:
            context_length 512, threads 1).

    Raises:
        AssertionError: the process exited, or was not healthy within `startup_s` (its output
            shown).
    """
    port = free_port()
    settings = {"context_length": "512", "threads": "1"} | env_overrides
    env = {
        **os.environ,
        "PYTHONPATH": str(SERVICES),
        **{f"FLYWHEEL_ENGINE__{k.upper()}": v for k, v in settings.items()},
    }
    cmd = [
        sys.executable,
        "-m",
        "flywheel.engine",
        "--model-path",
        str(model_dir),
        "--port",
        str(port),
        *args,
    ]
    log = log_path.open("wb") if log_path is not None else None
    proc = subprocess.Popen(cmd, env=env, stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT)

    def output() -> str:
        if log_path is not None:
            return log_path.read_text()[-3000:]
        return proc.stdout.read().decode() if proc.stdout else ""

    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            assert proc.poll() is None, output()
            assert time.monotonic() < deadline, "engine did not become healthy"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        if log is not None:
            log.close()
