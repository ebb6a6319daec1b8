"""Weight update round trips on a live engine, disk and distributed (gloo), SGLang's shapes.

After each update: /get_weights_by_name shows the new tensors (the tied lm_head with them), the
greedy logprobs of a fixed prompt equal a plain transformers forward pass of the new weights
(1e-4 nats), weight_version changed, nothing is served from a cache (cached_tokens 0), and a
request in flight when the update arrived completed normally (not aborted).
"""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from flywheel.trainer.weight_sync import DistributedWeightSync, WeightSyncError, unique_tensors

pytestmark = pytest.mark.integration

PROMPT = [1, 504, 3458, 314, 260, 1789]
SCORE = {
    "input_ids": PROMPT + [28, 29, 30],
    "return_logprob": True,
    "logprob_start_len": len(PROMPT) - 1,
    "sampling_params": {"max_new_tokens": 0, "temperature": 0},
}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from ..engine_process import engine_process

    with engine_process(tiny_model_dir) as url:
        yield url


def reference_scores(model_dir, state: dict[str, torch.Tensor]) -> list[float]:
    """Logprobs of tokens 28, 29, 30 after PROMPT under `state`, by a plain forward pass."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    ids = SCORE["input_ids"]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # (T, V)
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [lp[k - 1, ids[k]].item() for k in range(len(PROMPT), len(ids))]


def scores(url: str) -> tuple[list[float], dict]:
    meta = httpx.post(f"{url}/generate", json=SCORE, timeout=30).json()["meta_info"]
    return [row[0] for row in meta["input_token_logprobs"][1:]], meta


def weights(url: str, name: str, rows: int = 3) -> torch.Tensor:
    r = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": rows})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json())


def in_flight(url: str) -> tuple[threading.Thread, dict]:
    box: dict = {}
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True},
    }
    t = threading.Thread(
        target=lambda: box.update(r=httpx.post(f"{url}/generate", json=body, timeout=60).json())
    )
    t.start()
    return t, box


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def check_after(url, model_dir, state, version, before_scores, flight) -> None:
    t, box = flight
    t.join(60)
    done = box["r"]["meta_info"]
    assert done["finish_reason"] == {"type": "length", "length": 60}  # completed, not aborted
    after, meta = scores(url)
    assert meta["weight_version"] == version
    assert meta["cached_tokens"] == 0
    assert max(abs(a - b) for a, b in zip(after, before_scores, strict=True)) > 1e-3
    expected = reference_scores(model_dir, state)
    assert max(abs(a - b) for a, b in zip(after, expected, strict=True)) < 1e-4
    embed = state["model.embed_tokens.weight"][:3]
    torch.testing.assert_close(weights(url, "model.embed_tokens.weight"), embed)
    torch.testing.assert_close(weights(url, "lm_head.weight"), embed)  # tied: one tensor
    assert httpx.get(f"{url}/model_info").json()["weight_version"] == version


def test_update_from_disk_round_trip(engine, tiny_model_dir, tmp_path):
    before, _ = scores(engine)
    state = perturbed(load_file(tiny_model_dir / "model.safetensors"), seed=1)
    state.pop("lm_head.weight", None)
    (tmp_path / "ckpt").mkdir()
    save_file(state, tmp_path / "ckpt" / "model.safetensors")
    flight = in_flight(engine)
    r = httpx.post(
        f"{engine}/update_weights_from_disk",
        timeout=60,
        json={
            "model_path": str(tmp_path / "ckpt"),
            "weight_version": "disk-1",
            "flush_cache": True,
        },
    )
    assert r.status_code == 200
    assert r.json() == {
        "success": True,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": 0,
    }
    check_after(engine, tiny_model_dir, state, "disk-1", before, flight)


def test_update_over_gloo_round_trip_partial_and_refused(engine, tiny_model_dir):
    before, _ = scores(engine)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.03 * torch.randn_like(p))
    named = list(model.state_dict().items())
    assert len(unique_tensors(named)) == len(named) - 1  # lm_head aliases embed_tokens
    state = {k: v.clone() for k, v in named}
    sync = DistributedWeightSync([engine], backend="gloo", timeout_s=60)
    sync.connect()
    try:
        flight = in_flight(engine)
        assert sync.push(named, weight_version="dist-1") == len(named) - 1
        check_after(engine, tiny_model_dir, state, "dist-1", before, flight)

        # sparse update of the embedding alone: the tied head follows (BUG-18)
        new_embed = state["model.embed_tokens.weight"] * 0.5
        sync.push([("model.embed_tokens.weight", new_embed)], weight_version="dist-2")
        torch.testing.assert_close(weights(engine, "lm_head.weight"), new_embed[:3])

        # a wrong shape is refused after the broadcast; served weights and version unchanged
        norm = weights(engine, "model.norm.weight", 100)
        with pytest.raises(WeightSyncError, match="shape"):
            sync.push([("model.norm.weight", torch.ones(7))], weight_version="bad")
        torch.testing.assert_close(weights(engine, "model.norm.weight", 100), norm)
        assert httpx.get(f"{engine}/model_info").json()["weight_version"] == "dist-2"
    finally:
        sync.close()


def test_distributed_update_needs_a_session_and_a_group(engine):
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
    r = httpx.post(f"{engine}/update_weights_from_distributed", json=body)
    assert r.status_code == 400 and "begin_weight_update" in r.json()["message"]
    assert httpx.post(f"{engine}/begin_weight_update", json={}).json()["success"] is True
    try:
        assert httpx.post(f"{engine}/begin_weight_update", json={}).status_code == 400
        r = httpx.post(f"{engine}/update_weights_from_distributed", json=body)
        assert r.status_code == 400 and "group" in r.json()["message"]
    finally:
        assert httpx.post(f"{engine}/end_weight_update", json={}).json()["success"] is True
    r = httpx.post(f"{engine}/destroy_weights_update_group", json={})
    assert r.status_code == 400 and r.json()["success"] is False
