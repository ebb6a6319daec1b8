"""Sample fields -> batch inputs: wrong-hint logprobs, per-turn step scores, teacher top-k and
turn index, aligned to token positions and masked where a Sample lacks them."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flywheel.trainer.algorithms.pipeline import advantage_inputs
from flywheel.trainer.batch import TOPK_ABSENT, collate, micro_batches
from flywheel.trainer.samples import sampled_runs, step_reward_positions

from ..factories import make_sample

A = TOPK_ABSENT


def two_turn_sample(step_rewards: dict[str, float], assistants: int = 2, **fields):
    """7 tokens: prompt 0-1, turn one 2-3, a template token 4, turn two 5-6.

    loss mask [0, 0, 1, 1, 0, 1, 1]: sampled runs (2, 4) and (5, 7).
    """
    sample = make_sample(prompt_len=2, completion_len=5, rewards=step_rewards, **fields)
    sample.loss_mask[4], sample.rollout_logprobs[4], sample.weight_versions[4] = 0, 0.0, -1
    sample.messages.add(role="user", content_json='"q"')
    for k in range(assistants):
        sample.messages.add(role="assistant", content_json=f'"a{k}"')
        sample.messages.add(role="user", content_json='"more"')
    del sample.messages[-1]
    return sample


def test_sampled_runs_worked_example():
    assert sampled_runs([0, 1, 1, 0, 0, 1]) == [(1, 3), (5, 6)]
    assert sampled_runs([1, 1]) == [(0, 2)] and sampled_runs([0, 0]) == []


def test_step_scores_land_on_the_last_token_of_their_turn():
    # step/0 scores assistant message 0 = run (2, 4): its last token is 3; step/1 -> run (5, 7)
    sample = two_turn_sample({"step/0": 0.5, "step/1": -1.0, "step": -0.25, "outcome": 1.0})
    assert step_reward_positions(sample) == {3: 0.5, 6: -1.0}


def test_step_score_of_an_unsampled_assistant_message_is_left_out():
    # 3 assistant messages, 2 sampled runs: the first message was in the prompt (offset 1), so
    # step/0 has no trained token, step/1 -> run 0 (last token 3), step/2 -> run 1 (token 6)
    sample = two_turn_sample({"step/0": 9.0, "step/1": 0.5, "step/2": 0.25}, assistants=3)
    assert step_reward_positions(sample) == {3: 0.5, 6: 0.25}


@pytest.mark.parametrize(
    "assistants,rewards",
    [
        (1, {"step/0": 1.0}),  # 2 runs but 1 assistant message
        (2, {"step/2": 1.0}),  # no assistant message 2
        (2, {"step/0": float("nan")}),  # a non-finite score
    ],
)
def test_step_scores_that_cannot_be_aligned_give_none(assistants, rewards):
    assert step_reward_positions(two_turn_sample(rewards, assistants=assistants)) is None


def test_samples_without_step_scores_give_an_empty_map():
    assert step_reward_positions(two_turn_sample({"outcome": 1.0})) == {}


def test_collate_places_step_scores_and_masks_everything_else():
    a = two_turn_sample({"step/0": 0.5, "step/1": -1.0})
    b = make_sample(prompt_len=1, completion_len=2, rewards={"step/0": 2.0})  # no messages
    batch = collate([a, b], torch.zeros(2))
    assert batch.step_mask_BT.tolist() == [
        [False, False, False, True, False, False, True],
        [False] * 7,  # unaligned (no assistant message): no step score at all
    ]
    assert batch.step_rewards_BT[0].tolist() == [0, 0, 0, 0.5, 0, 0, -1.0]
    assert float(batch.step_rewards_BT[1].abs().sum()) == 0.0


def test_collate_wrong_hint_logprobs_masked_by_teacher_mask():
    # sample a: prompt 2, completion 2; teacher on both sampled tokens, wrong hint -3, -2.5
    # sample b: same teacher, no wrong hint -> mask all False
    # sample c: wrong hint but the teacher masked token 3 (no teacher logprob there)
    teacher = {"teacher_logprobs": [0.0, 0.0, -1.0, -1.0], "teacher_mask": [0, 0, 1, 1]}
    a = make_sample(
        prompt_len=2,
        completion_len=2,
        wrong_hint="w",
        wrong_hint_logprobs=[0.0, 0.0, -3.0, -2.5],
        **teacher,
    )
    b = make_sample(prompt_len=2, completion_len=2, **teacher)
    c = make_sample(
        prompt_len=2,
        completion_len=2,
        wrong_hint="w",
        wrong_hint_logprobs=[0.0, 0.0, -3.0, 0.0],
        teacher_logprobs=[0.0, 0.0, -1.0, 0.0],
        teacher_mask=[0, 0, 1, 0],
    )
    batch = collate([a, b, c], torch.zeros(3))
    assert batch.wrong_hint_mask_BT.tolist() == [
        [False, False, True, True],
        [False] * 4,
        [False, False, True, False],
    ]
    assert batch.wrong_hint_logprobs_BT.tolist() == [[0, 0, -3.0, -2.5], [0] * 4, [0, 0, -3.0, 0]]


def test_collate_teacher_topk_aligned_per_position_with_absent_slots():
    # sample a (k = 2, 4 tokens): flattened entry t * 2 + j = slot j of position t. The teacher
    # writes zeros outside its scored turn (positions 0, 1: logprob 0 would read as p = 1, so
    # the teacher mask drops them) and -1e30 for a non-finite value (position 3, slot 1).
    a = make_sample(
        prompt_len=2,
        completion_len=2,
        teacher_logprobs=[0, 0, -0.5, -0.1],
        teacher_mask=[0, 0, 1, 1],
        teacher_topk=2,
        teacher_topk_ids=[0, 0, 0, 0, 5, 6, 7, 9],
        teacher_topk_logprobs=[0, 0, 0, 0, -0.5, -1.5, -0.1, -1e30],
    )
    # sample b (k = 1, 3 tokens): slot 1 is beyond its k -> absent
    b = make_sample(
        prompt_len=1,
        completion_len=2,
        teacher_logprobs=[0, -0.2, -0.3],
        teacher_topk=1,
        teacher_topk_ids=[0, 11, 12],
        teacher_topk_logprobs=[0, -0.2, -0.3],
    )
    # sample c: no top-k at all
    c = make_sample(prompt_len=1, completion_len=1)
    batch = collate([a, b, c], torch.zeros(3))
    assert batch.teacher_topk_ids_BTK.shape == (3, 4, 2)  # K = the largest k in the batch
    assert batch.teacher_topk_ids_BTK.tolist() == [
        [[0, 0], [0, 0], [5, 6], [7, 0]],
        [[0, 0], [11, 0], [12, 0], [0, 0]],
        [[0, 0]] * 4,
    ]
    assert_close(
        batch.teacher_topk_logprobs_BTK,
        torch.tensor(
            [
                [[A, A], [A, A], [-0.5, -1.5], [-0.1, A]],
                [[A, A], [-0.2, A], [-0.3, A], [A, A]],
                [[A, A]] * 4,
            ]
        ),
    )
    assert batch.teacher_topk_mask_BT.tolist() == [
        [False, False, True, True],
        [False, True, True, False],
        [False] * 4,
    ]


def test_collate_without_teacher_topk_has_an_empty_k_dimension():
    batch = collate([make_sample()], torch.zeros(1))
    assert batch.teacher_topk_ids_BTK.shape == (1, 8, 0)
    assert not bool(batch.teacher_topk_mask_BT.any())


def test_collate_carries_turn_index():
    batch = collate([make_sample(turn_index=3), make_sample(turn_index=0)], torch.zeros(2))
    assert batch.turn_index_B.tolist() == [3, 0]


def test_micro_batches_trim_the_top_k_tensors_with_their_rows():
    long = make_sample(
        prompt_len=2,
        completion_len=4,
        teacher_logprobs=[0.0] * 6,
        teacher_topk=1,
        teacher_topk_ids=list(range(6)),
        teacher_topk_logprobs=[-1.0] * 6,
    )
    short = make_sample(prompt_len=1, completion_len=1)
    first, second = micro_batches(collate([long, short], torch.zeros(2)), 1)
    assert first.teacher_topk_logprobs_BTK.shape == (1, 6, 1)
    assert second.teacher_topk_logprobs_BTK.shape == (1, 2, 1)
    assert second.step_mask_BT.shape == (1, 2) and second.turn_index_B.shape == (1,)


def test_advantage_inputs_mark_absent_values_nan():
    # row 0 has a wrong hint on token 2 and a step score on token 3; row 1 has neither
    a = two_turn_sample(
        {"step/0": 0.5},
        teacher_logprobs=[0.0, 0.0, -1.0] + [0.0] * 4,
        teacher_mask=[0, 0, 1, 0, 0, 0, 0],
        wrong_hint="w",
        wrong_hint_logprobs=[0.0, 0.0, -2.0] + [0.0] * 4,
    )
    b = two_turn_sample({})
    inputs = advantage_inputs(collate([a, b], torch.zeros(2)))
    nan = math.nan
    assert_close(
        inputs.wrong_hint_logprobs_BT,
        torch.tensor([[nan, nan, -2.0, nan, nan, nan, nan], [nan] * 7]),
        equal_nan=True,
    )
    assert_close(
        inputs.step_rewards_BT,
        torch.tensor([[nan, nan, nan, 0.5, nan, nan, nan], [nan] * 7]),
        equal_nan=True,
    )
    rows = advantage_inputs(collate([a, b], torch.zeros(2)), torch.tensor([1]), torch.tensor([0]))
    assert rows.turn_index_B.tolist() == [0] and rows.group_index_B.tolist() == [0]
