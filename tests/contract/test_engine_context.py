"""The context window through real engine processes: start-up rule and over-long requests.

The tiny model is trained for 2048 positions (max_position_embeddings). A larger
`engine.context_length` stops the engine at start with a message saying what to set, unless
`engine.allow_longer_context` (or SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1) asks for it; then
the engine serves the longer window and logs a warning. A prompt over the window is refused
before generation, in the native error shape on /generate and OpenAI's on /v1/*.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest

from flywheel.core.redis_server import free_port

from ..engine_process import SERVICES

pytestmark = pytest.mark.integration


def test_a_window_above_the_trained_length_stops_the_engine_at_start(tiny_model_dir):
    env = {
        **os.environ,
        "PYTHONPATH": str(SERVICES),
        "FLYWHEEL_ENGINE__CONTEXT_LENGTH": "4096",
        "FLYWHEEL_ENGINE__THREADS": "1",
    }
    env.pop("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", None)
    cmd = [sys.executable, "-m", "flywheel.engine", "--model-path", str(tiny_model_dir)]
    done = subprocess.run(
        [*cmd, "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "engine.context_length (4096) is above the model's trained length (2048" in (done.stderr)
    assert "engine.allow_longer_context = true" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_allowed_longer_window_serves_and_refuses_only_past_it(start_engine, tiny_model_dir):
    with start_engine(tiny_model_dir, context_length="2600", allow_longer_context="true") as url:
        info = httpx.get(f"{url}/server_info", timeout=10).json()
        assert info["context_length"] == 2600
        # 2200 prompt tokens: past the trained 2048, inside the allowed window
        long_ids = [100 + i % 500 for i in range(2200)]
        ok = httpx.post(
            f"{url}/generate",
            json={"input_ids": long_ids, "sampling_params": {"max_new_tokens": 3}},
            timeout=300,
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["meta_info"]["prompt_tokens"] == 2200
        # past the window: a 400 before generation, native shape
        over = httpx.post(
            f"{url}/generate",
            json={"input_ids": long_ids * 2, "sampling_params": {"max_new_tokens": 3}},
            timeout=60,
        )
        assert over.status_code == 400
        assert "exceeds the maximum allowed length (2599 tokens)" in over.json()["error"]["message"]
        # and OpenAI's shape on the OpenAI routes
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="default", prompt=long_ids * 2, max_tokens=3)
        body = err.value.body
        assert isinstance(body, dict) and body["object"] == "error" and body["code"] == 400
        assert "exceeds the maximum allowed length" in body["message"]
