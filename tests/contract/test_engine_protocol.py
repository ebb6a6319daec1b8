"""The engine's HTTP surface has SGLang's shapes (docs/engine-protocol.md), in process and live."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load_file

from flywheel.engine.app import EngineDeps, create_app

PROMPT = [1, 504, 3458, 314, 260, 1789]


def is_logprob_row(row) -> bool:
    return (
        isinstance(row, list)
        and len(row) == 3
        and (row[0] is None or isinstance(row[0], float))
        and isinstance(row[1], int)
        and (row[2] is None or isinstance(row[2], str))
    )


def test_generate_single_shape(client):
    r = client.post(
        "/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0},
            "return_logprob": True,
            "rid": "single-1",
        },
    )
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"text", "output_ids", "meta_info"}
    meta = body["meta_info"]
    assert meta["id"] == "single-1"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == len(body["output_ids"]) == 5
    assert meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default"
    assert isinstance(meta["e2e_latency"], float)
    assert meta["input_token_logprobs"] == []  # logprob_start_len -1: output only
    rows = meta["output_token_logprobs"]
    assert all(is_logprob_row(row) and row[2] is None for row in rows)
    assert [row[1] for row in rows] == body["output_ids"]
    assert all(row[0] <= 0 for row in rows)


def test_generate_batch_is_an_array_with_suffixed_rids_and_text_in_logprobs(client):
    r = client.post(
        "/generate",
        json={
            "input_ids": [PROMPT, PROMPT[:3]],
            "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3, "sampling_seed": 1}],
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "rid": "batch",
        },
    )
    assert r.status_code == 200
    out = r.json()
    assert isinstance(out, list)
    assert [o["meta_info"]["id"] for o in out] == ["batch_0", "batch_1"]
    assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 3]
    assert all(
        isinstance(row[2], str) for o in out for row in o["meta_info"]["output_token_logprobs"]
    )


def test_text_prompt_and_stop_token_is_included_in_output_ids(client):
    first = client.post(
        "/generate",
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
    ).json()
    stop_id = first["output_ids"][2]
    cut = first["output_ids"].index(stop_id) + 1
    r = client.post(
        "/generate",
        json={
            "text": "Hello",
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": [stop_id]},
        },
    ).json()
    assert r["output_ids"] == first["output_ids"][:cut]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_scoring_recipe_prefill_only(client):
    prompt, response = PROMPT, [28, 29, 30]
    r = client.post(
        "/generate",
        json={
            "input_ids": prompt + response,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": len(prompt) - 1,
            "top_logprobs_num": 2,
        },
    ).json()
    meta = r["meta_info"]
    assert r["output_ids"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == []
    rows = meta["input_token_logprobs"]
    assert len(rows) == len(response) + 1
    assert rows[0][0] is None and rows[0][1] == prompt[-1]
    assert [row[1] for row in rows[1:]] == response
    assert all(isinstance(row[0], float) for row in rows[1:])
    assert meta["input_top_logprobs"][0] is None
    assert all(len(top) == 2 for top in meta["input_top_logprobs"][1:])


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"input_ids": PROMPT, "sampling_params": {"foo": 1}}, "foo"),
        ({"input_ids": PROMPT, "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": PROMPT, "sampling_params": {"presence_penalty": 0.5}}, "presence_penalty"),
        ({"sampling_params": {}}, "input_ids"),
    ],
)
def test_invalid_generate_bodies_are_400_with_an_error(client, body, fragment):
    r = client.post("/generate", json=body)
    assert r.status_code == 400
    assert fragment in json.dumps(r.json()["error"])


def test_scheduler_side_errors_are_400_with_a_message(client):
    r = client.post("/generate", json={"input_ids": [5] * 300})
    assert r.status_code == 400
    assert "Input length" in r.json()["error"]["message"]
    r = client.post(
        "/generate", json={"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 3}
    )
    assert r.status_code == 400


def test_control_endpoints_need_a_body(client):
    for path in ("/update_weights_from_disk", "/abort_request", "/generate"):
        r = client.post(path)
        assert r.status_code == 400, path
        assert "error" in r.json()
    r = client.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert r.status_code == 400
    body = r.json()
    assert body["success"] is False and body["num_paused_requests"] == 0 and body["message"]


def test_info_health_flush_abort_metrics(client, tiny_model_dir):
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert info["model_path"] == str(tiny_model_dir)
        assert info["is_generation"] is True
        assert info["preferred_sampling_params"] is None
        assert info["weight_version"] == "default"
        assert info["model_type"] == "llama"
        assert info["architectures"] == ["LlamaForCausalLM"]
        assert info["served_model_name"]
    for path in ("/server_info", "/get_server_info"):
        info = client.get(path).json()
        assert info["status"] == "ready"
        assert info["context_length"] == 256 and info["max_total_num_tokens"] > 0
        assert info["version"] and info["tp_size"] == 1
    for path in ("/health", "/health_generate"):
        r = client.get(path)
        assert r.status_code == 200 and r.content == b""
    assert client.get("/healthz").status_code == 200
    for method in ("GET", "POST"):
        r = client.request(method, "/flush_cache")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    r = client.post("/abort_request", json={"rid": "nothing-running"})
    assert r.status_code == 200 and r.content == b""
    metrics = client.get("/metrics").text
    assert "flywheel_engine_generated_tokens_total" in metrics
    assert 'flywheel_engine_weight_info{version="default"} 1.0' in metrics


def test_health_is_503_while_the_model_loads(tiny_model_dir):
    from flywheel.core.settings import EngineSettings
    from flywheel.engine.worker import EngineWorker

    settings = EngineSettings(model_path=str(tiny_model_dir))
    loading = EngineWorker(settings, tiny_model_dir)  # not started: still "loading"
    c = TestClient(create_app(EngineDeps(loading, settings, tiny_model_dir)))
    assert c.get("/health").status_code == 503
    assert c.get("/healthz").status_code == 200
    assert c.get("/server_info").json()["status"] == "loading"
    r = c.post("/generate", json={"input_ids": [1]})
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]


def test_pause_and_continue_generation(client):
    assert client.post("/pause_generation").status_code == 400
    r = client.post("/pause_generation", json={"mode": "in_place"})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    assert client.get("/ready").status_code == 503
    r = client.post("/continue_generation", json={})
    assert r.json() == {"message": "Generation continued successfully.", "status": "ok"}
    assert client.get("/ready").status_code == 200


def test_get_weights_by_name(client, tiny_model_dir):
    state = load_file(tiny_model_dir / "model.safetensors")
    r = client.post("/get_weights_by_name", json={"name": "model.norm.weight", "truncate_size": 5})
    assert r.status_code == 200
    assert r.json() == pytest.approx(state["model.norm.weight"][:5].tolist())
    rows = client.post(
        "/get_weights_by_name", json={"name": "model.embed_tokens.weight", "truncate_size": 2}
    ).json()
    assert len(rows) == 2 and len(rows[0]) == 64
    r = client.post("/get_weights_by_name", json={"name": "nope"})
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_a_model_that_fails_to_load_is_reported(tmp_path):
    from flywheel.core.settings import EngineSettings
    from flywheel.engine.worker import EngineWorker

    settings = EngineSettings(model_path=str(tmp_path))
    broken = EngineWorker(settings, tmp_path).start()  # empty folder: no model
    assert not broken.wait_ready(60)
    c = TestClient(create_app(EngineDeps(broken, settings, tmp_path)))
    assert c.get("/health").status_code == 503
    r = c.get("/healthz")
    assert r.status_code == 503 and r.json()["status"] == "failed"
    assert c.post("/generate", json={"input_ids": [1]}).status_code == 503
