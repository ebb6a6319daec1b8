"""Batched decoding against references: a request alone, and a full forward pass."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from flywheel.engine.batcher import RunningBatch, decode_batch
from flywheel.engine.protocol import RowSpec, SamplingParams
from flywheel.engine.runner import ModelRunner
from flywheel.engine.sequence import Job, Sequence

PROMPTS = [[1, 9038, 2683, 28], [1, 504, 3458, 314, 260, 1789, 253, 2683, 30, 198], [1719], [5, 6]]


def make_seq(
    runner: ModelRunner, ids: list[int], *, seed: int = 0, logprob_start_len: int = -1, **params
) -> Sequence:
    spec = RowSpec(
        rid="r",
        text=None,
        input_ids=ids,
        params=SamplingParams(**params),
        return_logprob=True,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=0,
        return_text_in_logprobs=False,
    )
    seq = Sequence(
        Job(spec),
        ids,
        max_new_tokens=spec.params.max_new_tokens or 0,
        eos_ids=runner.eos_ids,
        generator=torch.Generator().manual_seed(seed),
    )
    seq.start()
    return seq


def reference_logprobs(runner: ModelRunner, ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of every next token of `ids`, from one plain forward pass."""
    with torch.inference_mode():
        logits = runner.model(input_ids=torch.tensor([ids])).logits[0].float()  # (T, V)
    return torch.log_softmax(logits / temperature, dim=-1)


def test_greedy_batch_equals_each_request_alone(runner):
    alone = []
    for ids in PROMPTS:
        seq = make_seq(runner, ids, temperature=0, max_new_tokens=12)
        decode_batch(runner, [seq])
        alone.append(seq.output_ids)
    batch = [make_seq(runner, ids, temperature=0, max_new_tokens=12) for ids in PROMPTS]
    decode_batch(runner, batch)
    assert [s.output_ids for s in batch] == alone
    assert all(len(ids) == 12 for ids in alone)


def test_seeded_sampling_is_the_same_alone_and_batched(runner):
    alone = make_seq(runner, PROMPTS[0], seed=7, temperature=1.0, max_new_tokens=10)
    decode_batch(runner, [alone])
    batch = [
        make_seq(runner, ids, seed=7 + i, temperature=1.0, max_new_tokens=10)
        for i, ids in enumerate(PROMPTS)
    ]
    decode_batch(runner, batch)
    assert batch[0].output_ids == alone.output_ids
    other = make_seq(runner, PROMPTS[0], seed=8, temperature=1.0, max_new_tokens=10)
    decode_batch(runner, [other])
    assert other.output_ids != alone.output_ids


@pytest.mark.parametrize(
    ("temperature", "extra"),
    [(0.0, {}), (0.7, {"top_p": 0.9, "top_k": 50}), (1.3, {"min_p": 0.01})],
)
def test_output_logprobs_match_a_full_forward_pass(runner, temperature, extra):
    seqs = [
        make_seq(runner, ids, seed=i, temperature=temperature, max_new_tokens=8, **extra)
        for i, ids in enumerate(PROMPTS)
    ]
    decode_batch(runner, seqs)
    for seq in seqs:
        full = seq.input_ids + seq.output_ids
        ref = reference_logprobs(runner, full, temperature if temperature > 0 else 1.0)
        n = len(seq.input_ids)
        expected = ref[n - 1 : len(full) - 1].gather(1, torch.tensor(seq.output_ids)[:, None])
        assert_close(torch.tensor(seq.output_logprobs), expected[:, 0], atol=1e-4, rtol=0)


def test_input_logprobs_alignment_and_prefill_only(runner):
    ids = PROMPTS[1]
    start = 3
    seqs = [
        make_seq(runner, ids, logprob_start_len=start, max_new_tokens=0),
        make_seq(runner, PROMPTS[0], temperature=0, max_new_tokens=5),
    ]
    decode_batch(runner, seqs)
    scored = seqs[0]
    assert scored.output_ids == []
    assert scored.finish_reason == {"type": "length", "length": 0}
    assert len(scored.input_logprobs) == len(ids) - start
    assert scored.input_logprobs[0] is None
    ref = reference_logprobs(runner, ids, 1.0)
    expected = [ref[start + k - 1, ids[start + k]].item() for k in range(1, len(ids) - start)]
    assert_close(torch.tensor(scored.input_logprobs[1:]), torch.tensor(expected), atol=1e-4, rtol=0)
    assert len(seqs[1].output_ids) == 5


def test_stop_token_and_stop_string_end_the_row(runner):
    probe = make_seq(runner, PROMPTS[0], temperature=0, max_new_tokens=8)
    decode_batch(runner, [probe])
    stop_id = probe.output_ids[3]
    first = probe.output_ids.index(stop_id)
    seq = make_seq(runner, PROMPTS[0], temperature=0, max_new_tokens=8, stop_token_ids=[stop_id])
    decode_batch(runner, [seq])
    assert seq.output_ids == probe.output_ids[: first + 1]
    assert seq.finish_reason == {"type": "stop", "matched": stop_id}
    assert len(seq.output_logprobs) == len(seq.output_ids)
    assert seq.text(runner.tokenizer) == runner.tokenizer.decode(seq.output_ids[:-1])

    text = runner.tokenizer.decode(probe.output_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    seq = make_seq(runner, PROMPTS[0], temperature=0, max_new_tokens=8, stop=[stop])
    decode_batch(runner, [seq])
    assert seq.finish_reason == {"type": "stop", "matched": stop}
    assert stop not in seq.text(runner.tokenizer)
    assert text.startswith(seq.text(runner.tokenizer))
    assert len(seq.output_ids) < 8


def test_eos_is_included_in_the_output_unless_ignored(runner):
    eos = min(runner.eos_ids)
    # Force EOS: a stop token list that matches nothing but EOS would not help with random
    # weights, so use stop_token_ids to prove inclusion, and ignore_eos to prove it is optional.
    seq = make_seq(runner, PROMPTS[2], temperature=0, max_new_tokens=6, ignore_eos=True)
    assert eos not in seq.stop_ids
    seq = make_seq(runner, PROMPTS[2], temperature=0, max_new_tokens=6)
    assert eos in seq.stop_ids


def test_refresh_logits_recomputes_the_next_token_under_the_weights_loaded_now(tiny_model_dir):
    """A swap between decode steps: the rows' next-token logits come from the new weights.

    Only the final norm changes (x2), which leaves every cached key/value as it was, so the
    refreshed logits must equal a full forward pass of the new model over each row's tokens;
    without the refresh they are still the old model's.
    """
    runner = ModelRunner(tiny_model_dir, device="cpu")  # its own copy: its weights change
    seqs = [
        make_seq(runner, ids, seed=i, max_new_tokens=12, ignore_eos=True)
        for i, ids in enumerate(PROMPTS)
    ]
    batch = RunningBatch(runner)
    batch.add(seqs[:2])
    batch.step()
    batch.add(seqs[2:])  # rows prefilled at another width join the running ones
    for _ in range(3):
        batch.step()
    assert batch.next_logits is not None
    before = batch.next_logits.clone()
    batch.refresh_logits()  # same weights: the same numbers
    assert_close(batch.next_logits, before, atol=1e-4, rtol=0)
    old = runner.parameter("model.norm.weight").detach().clone()
    runner.apply_weights({"model.norm.weight": old * 2})
    batch.refresh_logits()
    for i, seq in enumerate(batch.seqs):
        full = seq.input_ids + seq.output_ids
        new_ref = reference_logprobs(runner, full, 1.0)[-1]
        assert_close(torch.log_softmax(batch.next_logits[i], -1), new_ref, atol=1e-4, rtol=0)
        assert not torch.allclose(torch.log_softmax(before[i], -1), new_ref, atol=1e-3)
    while batch.seqs:  # decoding goes on from the refreshed state
        batch.step()
    assert all(len(s.output_ids) == 12 for s in seqs)
