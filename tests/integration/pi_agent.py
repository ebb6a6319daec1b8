"""The `pi` coding agent (npm `@mariozechner/pi-coding-agent`, pinned in tools/pi/package.json
and package-lock.json) as a client of the gateway: installed once with `npm ci` into
tools/pi/node_modules, configured through a models.json and settings.json in a private config
folder (`PI_CODING_AGENT_DIR`, with HOME pointed there too, so the user's own ~/.pi is never
read), and run in print mode (`pi -p`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

PI_DIR = Path(__file__).resolve().parents[2] / "tools" / "pi"
PI_BIN = PI_DIR / "node_modules" / ".bin" / "pi"
STAMP = PI_DIR / "node_modules" / ".flywheel-lock-sha256"
PROVIDER = "flywheel"
API_MODES = ("openai-completions", "openai-responses", "anthropic-messages")


def ensure_pi() -> Path:
    """Install the pinned pi into tools/pi/node_modules with `npm ci`, once per lock file.

    Returns the `pi` executable. Skips the calling test (with what to install) when node or npm
    is missing; fails it when `npm ci` fails (the message holds npm's output).
    """
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"`{tool}` is not installed: install Node.js >= 20 with npm to run pi")
    digest = hashlib.sha256((PI_DIR / "package-lock.json").read_bytes()).hexdigest()
    if PI_BIN.exists() and STAMP.exists() and STAMP.read_text() == digest:
        return PI_BIN
    # Install scripts are not needed by pi (its optional native helpers are unused in print
    # mode), so none run.
    done = subprocess.run(
        ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
        cwd=PI_DIR,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0 or not PI_BIN.exists():
        pytest.fail(f"`npm ci` in {PI_DIR} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    STAMP.write_text(digest)
    return PI_BIN


def base_url(gateway: str, api: str) -> str:
    """What pi's `baseUrl` is for each API: the OpenAI SDK appends `/chat/completions` or
    `/responses` to it, the Anthropic SDK appends `/v1/messages`."""
    return gateway.rstrip("/") + ("" if api == "anthropic-messages" else "/v1")


def write_config(
    agent_dir: Path, *, api: str, url: str, api_key: str, session_id: str, model: str
) -> None:
    """Write pi's models.json (one provider, one model) and settings.json into `agent_dir`.

    The model's window and output budget are SmolLM2's (2048 tokens; 48 sampled tokens per
    turn keep runs short). Automatic compaction is off (with a 2048-token window pi would
    otherwise summarize on every turn, asking for 0.8 x 16384 output tokens) and so are retries
    (a retried turn would be recorded as a regenerated branch, and a protocol error must show).
    """
    agent_dir.mkdir(parents=True, exist_ok=True)
    provider = {
        "baseUrl": base_url(url, api),
        "api": api,
        "apiKey": api_key,
        "headers": {"X-Session-Id": session_id},
        "models": [{"id": model, "contextWindow": 2048, "maxTokens": 48}],
    }
    (agent_dir / "models.json").write_text(json.dumps({"providers": {PROVIDER: provider}}))
    settings = {
        "compaction": {"enabled": False},
        "retry": {"enabled": False, "provider": {"maxRetries": 0}},
        "quietStartup": True,
        "enableInstallTelemetry": False,
    }
    (agent_dir / "settings.json").write_text(json.dumps(settings))


@dataclass
class PiRun:
    returncode: int
    stdout: str
    stderr: str


def run_pi(
    pi: Path, agent_dir: Path, workdir: Path, prompt: str, *, model: str, resume: bool
) -> PiRun:
    """`pi -p PROMPT` in `workdir` with only the read and bash tools; `resume` continues the
    latest pi session saved in `agent_dir/sessions` (its whole history is sent again).

    Raises:
        subprocess.TimeoutExpired: pi ran longer than 600 s.
    """
    env = {
        **os.environ,
        "HOME": str(agent_dir),
        "PI_CODING_AGENT_DIR": str(agent_dir),
        "PI_OFFLINE": "1",
        "NO_COLOR": "1",
    }
    args = [
        str(pi),
        "-p",
        "--provider",
        PROVIDER,
        "--model",
        model,
        "--tools",
        "read,bash",
        "--session-dir",
        str(agent_dir / "sessions"),
        "--no-extensions",
        "--no-skills",
        "--no-prompt-templates",
        "--no-themes",
        "--no-context-files",
        *(["--continue"] if resume else []),
        prompt,
    ]
    done = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    return PiRun(done.returncode, done.stdout, done.stderr)
