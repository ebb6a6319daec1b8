"""Field-failure cases (docs/failure-cases.md) about weight sync, stops and logprobs,
each with the correct behaviour as its expectation."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from flywheel.core.settings import EngineSettings
from flywheel.engine.protocol import RowSpec, SamplingParams
from flywheel.engine.worker import EngineWorker
from flywheel.gateway.engines.generation import parse_generation
from flywheel.trainer.weight_sync import DistributedWeightSync

PROMPT = [1, 504, 3458, 314, 260, 1789]


@pytest.fixture
def worker(tiny_model_dir):
    settings = EngineSettings(model_path=str(tiny_model_dir), batch_wait_ms=1, context_length=256)
    w = EngineWorker(settings, tiny_model_dir).start()
    assert w.wait_ready(60), w.error
    yield w
    w.close()


def spec(rid: str, **params) -> RowSpec:
    return RowSpec(rid, None, PROMPT, SamplingParams(**params), True, -1, 0, False)


def run(w: EngineWorker, rid: str, **params) -> dict:
    (job,) = w.submit([spec(rid, **params)])
    return job.future.result(timeout=60)


def test_bug11_stop_on_the_last_allowed_token_is_stop_not_length(tiny_engine):
    probe = run(tiny_engine, "b11-probe", temperature=0, max_new_tokens=5, ignore_eos=True)
    tok = tiny_engine.tokenizer
    ids = probe["output_ids"]
    stop = tok.decode(ids[2:5])  # completed exactly by the 5th (last allowed) token
    assert stop not in tok.decode(ids[:4])
    out = run(tiny_engine, "b11", temperature=0, max_new_tokens=5, ignore_eos=True, stop=stop)
    assert out["output_ids"] == ids
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    capped = run(
        tiny_engine, "b11-cap", temperature=0, max_new_tokens=4, ignore_eos=True, stop=stop
    )
    assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


def test_bug10_no_token_after_the_one_completing_a_stop_string(tiny_engine):
    probe = run(tiny_engine, "b10-probe", temperature=0, max_new_tokens=10, ignore_eos=True)
    tok = tiny_engine.tokenizer
    stop = tok.decode(probe["output_ids"][3:5])
    out = run(tiny_engine, "b10", temperature=0, max_new_tokens=10, ignore_eos=True, stop=stop)
    ids = out["output_ids"]
    assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])  # ends on the match
    assert len(out["meta_info"]["output_token_logprobs"]) == len(ids)


@pytest.mark.parametrize(
    "params", [{"temperature": 0.6}, {"temperature": 1.0}, {"temperature": 0.6, "top_p": 0.75}]
)
def test_bug07_bug08_engine_logprobs_are_the_trainers_at_the_sampling_temperature(
    tiny_engine, tiny_model_dir, params
):
    """The engine's logprob of each sampled token equals what the trainer recomputes with the
    same weights at the sampling temperature (importance ratio 1 at step 0), and differs from
    the trainer's at another temperature; with top_p the engine reports the tempered full-vocab
    logprob too (the trainer's; truncation is the trainer's `allow_truncated_sampling` rule)."""
    from transformers import AutoModelForCausalLM

    from flywheel.trainer.logprobs import selected_token_logprobs

    out = run(
        tiny_engine, f"b07-{params}", max_new_tokens=12, ignore_eos=True, sampling_seed=3, **params
    )
    engine_lp = torch.tensor([r[0] for r in out["meta_info"]["output_token_logprobs"]])
    ids_BT = torch.tensor([PROMPT + out["output_ids"]])
    score_BT = torch.zeros_like(ids_BT, dtype=torch.bool)
    score_BT[0, len(PROMPT) :] = True
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)

    def trainer_lp(t: float) -> torch.Tensor:
        with torch.no_grad():
            return selected_token_logprobs(
                model.eval(), ids_BT, torch.ones_like(ids_BT), torch.tensor([t]), score_BT
            ).logprobs_BT[0, len(PROMPT) :]

    t = params["temperature"]
    assert (trainer_lp(t) - engine_lp).abs().max() < 1e-4  # measured: 4e-6 to 7e-6
    assert (trainer_lp(1.6 - t) - engine_lp).abs().max() > 0.5  # measured: 1.8 to 2.7


def test_bug19_swap_while_paused_in_place_records_weight_version_spans(
    worker, tiny_model_dir, tmp_path
):
    state = load_file(tiny_model_dir / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] * 1.5
    (tmp_path / "v2").mkdir()
    save_file(state, tmp_path / "v2" / "model.safetensors")
    seen = threading.Event()
    (job,) = worker.submit(
        [spec("b19", temperature=0, max_new_tokens=60, ignore_eos=True)],
        listeners=[lambda r: seen.set() if len(r["output_ids"]) >= 3 else None],
    )
    assert seen.wait(30)
    worker.pause("in_place")
    assert worker.update_weights_from_disk(str(tmp_path / "v2"), "7")[0]  # runs while paused
    time.sleep(0.2)
    assert not job.future.done()  # frozen, not aborted, not drained
    worker.resume()
    out = job.future.result(timeout=60)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 60}
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "7"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"]
    assert 3 <= spans[1]["start"] < 60 and spans[1]["end"] == 60
    assert meta["weight_version"] == "7"
    # The gateway reads these spans as each token's version ("default": the initial weights, 0).
    gen = parse_generation(out, set())
    cut = spans[1]["start"]
    assert gen.token_versions() == [0] * cut + [7] * (60 - cut)


class _Broadcast:
    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, root: int):
        assert root == 0
        self.sent.append(tensor)
        return self

    def wait(self) -> None:
        return None


def test_bug16_bug18_push_body_is_explicit_and_tied_weights_go_once():
    calls: list[tuple[str, dict]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"success": True, "message": "ok"})

    sync = DistributedWeightSync(["http://engine"], backend="gloo")
    sync._http = httpx.Client(transport=httpx.MockTransport(handler))
    fake = _Broadcast()
    sync._group = fake
    embed = torch.randn(4, 3)
    norm = torch.ones(3)
    sent = sync.push(
        [
            ("model.embed_tokens.weight", embed),
            ("lm_head.weight", embed),
            ("model.norm.weight", norm),
        ],
        weight_version="7",
    )
    assert sent == 2 and len(fake.sent) == 2  # the tied head is not sent twice
    paths = [p for p, _ in calls]
    assert paths == [
        "/begin_weight_update",
        "/update_weights_from_distributed",
        "/end_weight_update",
    ]
    assert calls[1][1] == {
        "names": ["model.embed_tokens.weight", "model.norm.weight"],
        "dtypes": ["float32", "float32"],
        "shapes": [[4, 3], [3]],
        "group_name": "weight_update_group",
        "weight_version": "7",
        "flush_cache": True,
        "abort_all_requests": False,  # always explicit: in-flight rollouts are never aborted
    }
