"""Weight swaps: the new tensors are read and converted off the decode loop (`prepare`), and the
swap between two decode steps only replaces references (`apply_weights`)."""

from __future__ import annotations

import threading

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from flywheel.core.settings import EngineSettings
from flywheel.engine.protocol import RowSpec, SamplingParams
from flywheel.engine.runner import ModelRunner
from flywheel.engine.worker import EngineWorker


def test_prepare_copies_and_converts_and_apply_swaps_references_keeping_ties(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, device="cpu")  # its own: this test changes weights
    embed = runner.parameter("model.embed_tokens.weight")
    norm = runner.parameter("model.norm.weight")
    assert runner.parameter("lm_head.weight") is embed  # the tiny model ties its embeddings
    state = load_file(tiny_model_dir / "model.safetensors")
    source = {
        "model.embed_tokens.weight": (state["model.embed_tokens.weight"] * 0.5).bfloat16(),
        "model.norm.weight": state["model.norm.weight"] * 2.0,
    }
    prepared = runner.prepare(source)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in prepared.values())
    source["model.norm.weight"].fill_(7.0)  # the caller's buffer is not what gets served
    runner.apply_weights(prepared)
    # the same parameter objects now hold the prepared tensors themselves: no copy at the swap
    assert runner.parameter("model.embed_tokens.weight") is embed
    assert runner.parameter("lm_head.weight") is embed
    assert runner.parameter("model.norm.weight") is norm
    assert embed.data_ptr() == prepared["model.embed_tokens.weight"].data_ptr()
    assert norm.data_ptr() == prepared["model.norm.weight"].data_ptr()
    assert runner.head.weight is runner.decoder.embed_tokens.weight  # still tied
    # the served model computes what load_state_dict of the same values gives
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref.load_state_dict(
        {
            "model.embed_tokens.weight": (state["model.embed_tokens.weight"] * 0.5)
            .bfloat16()
            .float(),
            "model.norm.weight": state["model.norm.weight"] * 2.0,
        },
        strict=False,
    )
    ids = torch.tensor([[1, 504, 3458, 314]])
    with torch.inference_mode():
        want = ref(input_ids=ids).logits[0, -1]
        got = runner.model(input_ids=ids).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_decode_loop_keeps_stepping_while_a_checkpoint_is_prepared(tiny_model_dir, tmp_path):
    """`prepare` (reading the checkpoint's pages, converting) runs in the caller's thread: it
    waits here until the worker has done 3 more decode steps, which could never happen if it
    blocked the decode loop. The swap then still lands between steps, with version spans."""
    settings = EngineSettings(
        model_path=str(tiny_model_dir), max_batch_size=8, batch_wait_ms=1, context_length=256
    )
    worker = EngineWorker(settings, tiny_model_dir).start()
    try:
        assert worker.wait_ready(60), worker.error
        runner = worker.runner
        assert runner is not None
        steps = []
        step = worker._step

        def counted_step() -> None:
            step()
            steps.append(1)

        worker._step = counted_step  # type: ignore[method-assign]
        seen: dict[str, object] = {}
        prepare = runner.prepare

        def watched_prepare(state, **kwargs):
            seen["thread"] = threading.current_thread()
            start = len(steps)
            for _ in range(3000):
                if len(steps) >= start + 3:
                    break
                threading.Event().wait(0.01)
            seen["steps"] = len(steps) - start
            return prepare(state, **kwargs)

        runner.prepare = watched_prepare  # type: ignore[method-assign]
        state = load_file(tiny_model_dir / "model.safetensors")
        state["model.norm.weight"] = state["model.norm.weight"] * 1.5
        (tmp_path / "ckpt").mkdir()
        save_file(state, tmp_path / "ckpt" / "model.safetensors")
        spec = RowSpec(
            rid="long",
            text=None,
            input_ids=[1, 504, 3458, 314],
            params=SamplingParams(max_new_tokens=200, ignore_eos=True, temperature=1.0),
            return_logprob=False,
            logprob_start_len=-1,
            top_logprobs_num=0,
            return_text_in_logprobs=False,
        )
        (job,) = worker.submit([spec])
        while len(steps) < 2:
            threading.Event().wait(0.005)
        assert worker.update_weights_from_disk(str(tmp_path / "ckpt"), "1")[0]
        assert seen["thread"] is not worker._thread
        assert seen["steps"] >= 3  # the loop decoded while the checkpoint was prepared
        meta = job.future.result(timeout=60)["meta_info"]
        assert [span["version"] for span in meta["weight_versions"]] == ["default", "1"]
        live = runner.parameter("model.norm.weight")
        torch.testing.assert_close(live.detach(), state["model.norm.weight"])
    finally:
        worker.close()


def test_a_disk_swap_takes_its_private_reads_as_the_new_weights(tiny_model_dir, tmp_path):
    # read_checkpoint reads into buffers of its own (not pages mapped from the file): changing
    # the file's bytes afterwards does not reach them, so `prepare(owned=True)` can take them as
    # the live weights without a third copy; a tensor in another dtype is still converted
    runner = ModelRunner(tiny_model_dir, device="cpu")
    state = load_file(tiny_model_dir / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] * 3.0
    file = tmp_path / "model.safetensors"
    save_file(state, file)
    read = runner.read_checkpoint(tmp_path)
    norm = read["model.norm.weight"].clone()
    data = bytearray(file.read_bytes())
    data[-4096:] = bytes(4096)  # the tail of the data section, in place
    with file.open("r+b") as f:
        f.write(data)
    torch.testing.assert_close(read["model.norm.weight"], norm, rtol=0, atol=0)
    read["model.layers.0.mlp.up_proj.weight"] = read["model.layers.0.mlp.up_proj.weight"].half()
    prepared = runner.prepare(read, owned=True)
    assert prepared["model.norm.weight"] is read["model.norm.weight"]  # taken, not copied
    up = prepared["model.layers.0.mlp.up_proj.weight"]
    assert up.dtype == torch.float32  # converted to the live dtype
    copied = runner.prepare(read)  # a caller's buffers: always copies
    assert copied["model.norm.weight"].data_ptr() != read["model.norm.weight"].data_ptr()
    runner.apply_weights(prepared)
    torch.testing.assert_close(runner.parameter("model.norm.weight").detach(), norm)
