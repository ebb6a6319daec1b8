"""Samples -> right-padded training tensors, and their split into micro-batches.

Shapes: B = samples, T = the longest sample in the batch (a micro-batch is trimmed to its own
longest row). Per-token tensors are aligned with `Sample.token_ids`; padding sits on the right,
with attention 0, loss mask 0 and advantage 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from flywheel._proto import sample_pb2
from flywheel.trainer.samples import check_trainable, sample_temperature

PAD_ID = 0
"""Token id written into padding (never attended to, never scored)."""


@dataclass(frozen=True)
class TrainBatch:
    input_ids_BT: Tensor
    """(B, T) int64 token ids, right-padded with PAD_ID."""
    attention_mask_BT: Tensor
    """(B, T) int64, 1 on real tokens."""
    loss_mask_BT: Tensor
    """(B, T) bool, True on sampled tokens (Sample.loss_mask)."""
    old_logprobs_BT: Tensor
    """(B, T) float32 rollout logprobs (Sample.rollout_logprobs), 0 off the loss mask."""
    advantages_BT: Tensor
    """(B, T) float32 the sample's advantage on each loss token, 0 elsewhere."""
    temperature_B: Tensor
    """(B,) float32 sampling temperature of each sample (greedy/unset -> 1.0)."""
    rewards_B: Tensor
    """(B,) float32 Sample.reward (for metrics)."""

    @property
    def size(self) -> int:
        return int(self.input_ids_BT.shape[0])

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def rows(self, start: int, end: int) -> TrainBatch:
        """Rows [start, end), trimmed on the right to their longest real sequence."""
        length = max(int(self.attention_mask_BT[start:end].sum(dim=1).max()), 1)
        parts = {}
        for f in fields(self):
            value = getattr(self, f.name)[start:end]
            parts[f.name] = value[:, :length] if f.name.endswith("_BT") else value
        return TrainBatch(**parts)


def collate(samples_B: Sequence[sample_pb2.Sample], advantages_B: Tensor) -> TrainBatch:
    """Pad `samples_B` on the right into one batch; each sample's advantage fills its loss tokens.

    Raises:
        ContractError: a sample breaks `check_trainable` (a bug upstream: it should have been
            dead-lettered at admission).
    """
    if len(samples_B) != advantages_B.shape[0]:
        raise ValueError(f"{len(samples_B)} samples but {advantages_B.shape[0]} advantages")
    batch, seq = len(samples_B), max((len(s.token_ids) for s in samples_B), default=1)
    input_ids_BT = torch.full((batch, seq), PAD_ID, dtype=torch.int64)
    attention_mask_BT = torch.zeros(batch, seq, dtype=torch.int64)
    loss_mask_BT = torch.zeros(batch, seq, dtype=torch.bool)
    old_logprobs_BT = torch.zeros(batch, seq, dtype=torch.float32)
    for row, sample in enumerate(samples_B):
        check_trainable(sample)
        n = len(sample.token_ids)
        input_ids_BT[row, :n] = torch.tensor(sample.token_ids, dtype=torch.int64)
        attention_mask_BT[row, :n] = 1
        loss_mask_BT[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        old_logprobs_BT[row, :n] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
    old_logprobs_BT = torch.where(loss_mask_BT, old_logprobs_BT, 0.0)
    advantages_BT = torch.where(loss_mask_BT, advantages_B.float()[:, None], 0.0)
    return TrainBatch(
        input_ids_BT=input_ids_BT,
        attention_mask_BT=attention_mask_BT,
        loss_mask_BT=loss_mask_BT,
        old_logprobs_BT=old_logprobs_BT,
        advantages_BT=advantages_BT,
        temperature_B=torch.tensor([sample_temperature(s) for s in samples_B]),
        rewards_B=torch.tensor([s.reward for s in samples_B], dtype=torch.float32),
    )


def micro_batches(batch: TrainBatch, size: int) -> list[TrainBatch]:
    """Consecutive micro-batches of at most `size` rows, each trimmed to its longest row."""
    starts = range(0, batch.size, size)
    return [batch.rows(start, min(start + size, batch.size)) for start in starts]
