"""The worker thread: aborts, weight swaps between decode steps or batches, version stamping,
limits."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from flywheel.core.errors import InvalidRequestError
from flywheel.core.settings import EngineSettings
from flywheel.engine.protocol import RowSpec, SamplingParams
from flywheel.engine.worker import EngineWorker


@pytest.fixture
def worker(tiny_model_dir):
    settings = EngineSettings(
        model_path=str(tiny_model_dir), max_batch_size=8, batch_wait_ms=1, context_length=256
    )
    w = EngineWorker(settings, tiny_model_dir).start()
    assert w.wait_ready(60), w.error
    yield w
    w.close()


def spec(rid: str, ids: list[int], **params) -> RowSpec:
    return RowSpec(
        rid=rid,
        text=None,
        input_ids=ids,
        params=SamplingParams(**params),
        return_logprob=True,
        logprob_start_len=-1,
        top_logprobs_num=0,
        return_text_in_logprobs=False,
    )


def generate(w: EngineWorker, rid: str, ids: list[int], **params) -> dict:
    (job,) = w.submit([spec(rid, ids, **params)])
    return job.future.result(timeout=60)


def modified_checkpoint(src, dst, scale: float = 1.5):
    state = load_file(src / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] * scale
    dst.mkdir()
    save_file(state, dst / "model.safetensors")
    return dst


def wait_for_progress(w: EngineWorker, since: float) -> None:
    deadline = time.monotonic() + 30
    while w.last_progress <= since and time.monotonic() < deadline:
        time.sleep(0.005)


def test_abort_returns_the_partial_output(worker):
    t0 = time.monotonic()
    (job,) = worker.submit([spec("abc123", [1, 2, 3], max_new_tokens=240, ignore_eos=True)])
    wait_for_progress(worker, t0)
    assert worker.abort("abc") == 1
    out = job.future.result(timeout=30)
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert 0 < meta["completion_tokens"] < 240
    assert len(out["output_ids"]) == len(meta["output_token_logprobs"]) == meta["completion_tokens"]


def test_step_swap_continues_rows_in_flight_under_the_new_weights(worker, tiny_model_dir, tmp_path):
    """The default swap (engine.weight_swap "step") lands between two decode steps.

    The checkpoint scales only the final norm, which leaves every cached key/value unchanged,
    so each token's logprob must equal a full forward pass of the weights its span names:
    the old model before the span boundary, the new one from it on.
    """
    prompt = [1, 504, 3458, 314]
    ckpt = modified_checkpoint(tiny_model_dir, tmp_path / "ckpt")
    t0 = time.monotonic()
    (long_job,) = worker.submit(
        [spec("long", prompt, max_new_tokens=200, ignore_eos=True, temperature=1.0)]
    )
    wait_for_progress(worker, t0)
    assert worker.update_weights_from_disk(str(ckpt), "1") == (
        True,
        "Succeeded to update model weights.",
    )
    assert not long_job.future.done()  # the update did not wait for the row
    out = long_job.future.result(timeout=60)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 200}
    (old, new) = meta["weight_versions"]
    assert old["version"] == "default" and new["version"] == "1"
    k = old["end"]
    assert old["start"] == 0 and new["start"] == k and new["end"] == 200 and 0 < k < 200
    full = prompt + out["output_ids"]
    got = torch.tensor([row[0] for row in meta["output_token_logprobs"]])
    picked = torch.tensor(out["output_ids"])[:, None]
    state = load_file(ckpt / "model.safetensors")
    for weights, lo, hi in ((None, 0, k), (state, k, 200)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if weights is not None:
            model.load_state_dict(weights, strict=False)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([full])).logits[0]  # (T, V)
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, picked)[:, 0]
        torch.testing.assert_close(got[lo:hi], ref[lo:hi], atol=1e-4, rtol=0)
        other = ref[k:] if weights is None else ref[:k]  # the other version's numbers differ
        assert (got[k:] if weights is None else got[:k]).sub(other).abs().max() > 1e-3


def test_drain_update_waits_for_the_inflight_batch_and_stamps_versions(tiny_model_dir, tmp_path):
    settings = EngineSettings(
        model_path=str(tiny_model_dir),
        max_batch_size=8,
        batch_wait_ms=1,
        context_length=256,
        weight_swap="drain",
    )
    worker = EngineWorker(settings, tiny_model_dir).start()
    assert worker.wait_ready(60), worker.error
    try:
        _drain_update(worker, tiny_model_dir, tmp_path)
    finally:
        worker.close()


def _drain_update(worker, tiny_model_dir, tmp_path):
    prompt = [1, 504, 3458, 314]
    before = generate(worker, "b0", prompt, temperature=0, max_new_tokens=4)
    ckpt = modified_checkpoint(tiny_model_dir, tmp_path / "ckpt")

    t0 = time.monotonic()
    (long_job,) = worker.submit([spec("long", prompt, max_new_tokens=200, ignore_eos=True)])
    wait_for_progress(worker, t0)
    result: dict = {}
    updater = threading.Thread(
        target=lambda: result.update(ok=worker.update_weights_from_disk(str(ckpt), "1"))
    )
    updater.start()
    long_out = long_job.future.result(timeout=60)
    updater.join(60)
    assert result["ok"] == (True, "Succeeded to update model weights.")
    # the in-flight request finished on the old weights, not aborted
    assert long_out["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    assert long_out["meta_info"]["weight_version"] == "default"

    after = generate(worker, "a0", prompt, temperature=0, max_new_tokens=4)
    assert after["meta_info"]["weight_version"] == "1"
    lp_before = [row[0] for row in before["meta_info"]["output_token_logprobs"]]
    lp_after = [row[0] for row in after["meta_info"]["output_token_logprobs"]]
    assert abs(lp_before[0] - lp_after[0]) > 1e-3


def test_incompatible_checkpoint_is_refused_and_the_old_weights_keep_serving(
    worker, tiny_model_dir, tmp_path
):
    prompt = [7, 8, 9]
    before = generate(worker, "x0", prompt, temperature=0, max_new_tokens=3)
    state = load_file(tiny_model_dir / "model.safetensors")
    state["model.norm.weight"] = torch.zeros(65)  # wrong shape
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"] * 3
    (tmp_path / "bad").mkdir()
    save_file(state, tmp_path / "bad" / "model.safetensors")
    ok, message = worker.update_weights_from_disk(str(tmp_path / "bad"), "9")
    assert not ok
    assert "model.norm.weight" in message
    ok, message = worker.update_weights_from_disk(str(tmp_path / "missing"), "9")
    assert not ok
    after = generate(worker, "x1", prompt, temperature=0, max_new_tokens=3)
    assert after["meta_info"]["weight_version"] == "default"
    assert (
        after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    )


def _truncated(state, folder):
    save_file(state, folder / "model.safetensors")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])  # a half-written file


def _missing_shard(state, folder):
    names = sorted(state)
    half = len(names) // 2
    save_file({k: state[k] for k in names[:half]}, folder / "model-00001-of-00002.safetensors")
    weight_map = dict.fromkeys(names[:half], "model-00001-of-00002.safetensors")
    weight_map |= dict.fromkeys(names[half:], "model-00002-of-00002.safetensors")  # never written
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _unknown_tensor(state, folder):
    save_file(
        {**state, "model.layers.99.mlp.up_proj.weight": torch.ones(2, 2)},
        folder / "model.safetensors",
    )


@pytest.mark.parametrize("write", [_truncated, _missing_shard, _unknown_tensor])
def test_bug17_partial_or_foreign_checkpoints_are_refused_whole(
    worker, tiny_model_dir, tmp_path, write
):
    prompt = [7, 8, 9]
    before = generate(worker, "p0", prompt, temperature=0, max_new_tokens=3)
    state = {k: v * 2 for k, v in load_file(tiny_model_dir / "model.safetensors").items()}
    write(state, tmp_path)
    ok, message = worker.update_weights_from_disk(str(tmp_path), "5")
    assert not ok and message
    after = generate(worker, "p1", prompt, temperature=0, max_new_tokens=3)
    assert after["meta_info"]["weight_version"] == "default"
    # Not one tensor of the refused checkpoint was applied: the same greedy ids and logprobs.
    assert after["output_ids"] == before["output_ids"]
    assert (
        after["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]
    )


def test_duplicate_rid_context_limit_and_vocab_checks(worker):
    (job,) = worker.submit([spec("dup", [1, 2], max_new_tokens=200, ignore_eos=True)])
    with pytest.raises(InvalidRequestError, match="Duplicate"):
        worker.submit([spec("dup", [1, 2])])
    worker.abort("dup")
    job.future.result(timeout=30)

    # context 256: a 250-token prompt leaves 256 - 250 - 1 = 5 new tokens
    out = generate(worker, "c0", [5] * 250, max_new_tokens=100, ignore_eos=True)
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    (job,) = worker.submit([spec("c1", [5] * 256)])
    with pytest.raises(InvalidRequestError, match="Input length"):
        job.future.result(timeout=30)
    (job,) = worker.submit([spec("c2", [49152])])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        job.future.result(timeout=30)


def test_pause_holds_new_rows_until_continue_and_weights_can_swap_meanwhile(
    worker, tiny_model_dir, tmp_path
):
    worker.pause("abort")
    assert worker.paused
    (job,) = worker.submit([spec("held", [1, 2, 3], max_new_tokens=2)])
    ckpt = modified_checkpoint(tiny_model_dir, tmp_path / "ckpt")
    assert worker.update_weights_from_disk(str(ckpt), "2")[0]  # controls run while paused
    time.sleep(0.5)
    assert not job.future.done()
    worker.resume()
    out = job.future.result(timeout=30)
    assert out["meta_info"]["weight_version"] == "2"
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_aborting_a_held_row_releases_it_at_once(worker):
    worker.pause("in_place")
    (job,) = worker.submit([spec("held-abort", [1, 2, 3], max_new_tokens=2)])
    worker.abort("held-abort")
    out = job.future.result(timeout=10)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["output_ids"] == []
    worker.resume()


def test_a_disconnected_client_aborts_its_rows(worker, monkeypatch):
    import asyncio

    from flywheel.engine import app as app_module

    class GoneRequest:
        async def is_disconnected(self) -> bool:
            return True

    monkeypatch.setattr(app_module, "DISCONNECT_POLL_S", 0.05)
    jobs = worker.submit([spec("gone", [1, 2, 3], max_new_tokens=240, ignore_eos=True)])
    (out,) = asyncio.run(app_module._wait(GoneRequest(), jobs))  # type: ignore[arg-type]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 240


def test_a_row_that_cannot_be_prepared_fails_alone_and_the_worker_keeps_serving(
    worker, monkeypatch
):
    real = worker._sequence
    calls = {"n": 0}

    def flaky(runner, job):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OverflowError("seed out of range")
        return real(runner, job)

    monkeypatch.setattr(worker, "_sequence", flaky)
    (bad,) = worker.submit([spec("bad-row", [1, 2, 3], max_new_tokens=2)])
    with pytest.raises(InvalidRequestError, match="OverflowError"):
        bad.future.result(timeout=30)
    (good,) = worker.submit([spec("good-row", [1, 2, 3], max_new_tokens=2)])
    assert len(good.future.result(timeout=30)["output_ids"]) >= 1
    assert worker.status == "ready"
