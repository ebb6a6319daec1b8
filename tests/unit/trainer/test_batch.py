"""Samples -> padded tensors: alignment, right padding, temperatures, invariants, micro-batches."""

from __future__ import annotations

import pytest
import torch

from flywheel.core.errors import ContractError
from flywheel.trainer.batch import PAD_ID, collate, micro_batches

from .factories import make_sample


def test_collate_right_pads_and_aligns_per_token_arrays():
    a = make_sample(prompt_len=2, completion_len=3, logprob=-0.5, temperature=0.7, reward=1.0)
    b = make_sample(prompt_len=1, completion_len=1, logprob=-2.0, temperature=0.0, reward=0.0)
    batch = collate([a, b], torch.tensor([0.5, -0.5]))
    assert batch.input_ids_BT.shape == (2, 5)
    assert batch.input_ids_BT[0].tolist() == list(a.token_ids)
    assert batch.input_ids_BT[1].tolist() == list(b.token_ids) + [PAD_ID] * 3
    assert batch.attention_mask_BT.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.loss_mask_BT.tolist() == [
        [False, False, True, True, True],
        [False, True, False, False, False],
    ]
    assert batch.old_logprobs_BT.tolist() == [[0, 0, -0.5, -0.5, -0.5], [0, -2.0, 0, 0, 0]]
    assert batch.advantages_BT.tolist() == [[0, 0, 0.5, 0.5, 0.5], [0, -0.5, 0, 0, 0]]
    assert batch.temperature_B.tolist() == pytest.approx([0.7, 1.0])  # greedy/unset -> 1.0
    assert batch.rewards_B.tolist() == [1.0, 0.0]


def test_micro_batches_are_trimmed_to_their_longest_row():
    samples = [make_sample(prompt_len=2, completion_len=n, seed=n) for n in (6, 1, 1)]
    batch = collate(samples, torch.zeros(3))
    first, second = micro_batches(batch, 2)
    assert first.input_ids_BT.shape == (2, 8)
    assert second.input_ids_BT.shape == (1, 3)
    assert second.temperature_B.shape == (1,)


@pytest.mark.parametrize("breakage", ["length", "mask0", "positive_logprob", "nan_logprob"])
def test_collate_rejects_broken_invariants(breakage):
    sample = make_sample()
    if breakage == "length":
        sample.rollout_logprobs.append(0.0)
    elif breakage == "mask0":
        sample.loss_mask[0] = 1
    elif breakage == "positive_logprob":
        sample.rollout_logprobs[-1] = 0.5
    else:
        sample.rollout_logprobs[-1] = float("nan")
    with pytest.raises(ContractError):
        collate([sample], torch.zeros(1))
