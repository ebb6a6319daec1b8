"""Samples -> right-padded training tensors, and their split into micro-batches.

Shapes: B = samples, T = the longest sample in the batch (a micro-batch is trimmed to its own
longest row), K = the largest `Sample.teacher_topk` in the batch (0 when no sample has a
teacher top-k). Per-token tensors are aligned with `Sample.token_ids`: position t holds what
belongs to token t (its logprob given tokens < t, the distribution it was drawn from); padding
sits on the right, with attention 0, loss mask 0 and advantage 0. Every optional per-token input
(teacher, wrong-hint, top-k, step scores) comes with a mask that is False wherever the Sample
does not carry it and off the loss mask; its value there is 0 (TOPK_ABSENT for top-k logprobs).

Micro-batches are cut by sample count and, optionally, by a token budget (rows x longest row,
the padded tokens one forward pass holds). Rows are taken longest first, so rows of similar
length share a micro-batch and little padding is computed; the loss normalizer is step-wide, so
the order never changes the gradient (BUG-14).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from flywheel._proto import sample_pb2
from flywheel.trainer.samples import check_trainable, sample_temperature, step_reward_positions

PAD_ID = 0
"""Token id written into padding (never attended to, never scored)."""

TOPK_ABSENT = -1e30
"""Logprob of a top-k slot without a teacher entry (positions without a top-k, slots beyond a
sample's k, and the teacher's non-finite values, which it writes as -1e30). Finite, so
p log p terms give exactly 0 there (exp(-1e30) = 0), never NaN."""


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
    renormalized_BT: Tensor
    """(B, T) bool: a loss token whose rollout logprob is renormalised over a grammar's allowed
    tokens (Sample.logprob_renormalized): not the distribution the trainer scores, so its ratio
    is taken against the trainer's own logprob (step.token_loss)."""
    advantages_BT: Tensor
    """(B, T) float32 the sample's advantage on each loss token, 0 elsewhere."""
    temperature_B: Tensor
    """(B,) float32 sampling temperature of each sample (greedy/unset -> 1.0)."""
    rewards_B: Tensor
    """(B,) float32 Sample.reward (for metrics)."""
    sample_weight_B: Tensor
    """(B,) float32 multiplier of each sample's token losses (stale down-weighting; 1.0)."""
    is_correct_B: Tensor
    """(B,) bool: take this sample's ratio against the trainer's own logprobs and weight its
    tokens by the truncated IS weight pi_train / pi_rollout (a stale sample, IS-corrected)."""
    group_index_B: Tensor
    """(B,) int64 group of each sample (0..G-1), for token-level algorithm parts."""
    live_B: Tensor
    """(B,) bool: a live sample (no group_id; the live estimator gives its advantage)."""
    teacher_logprobs_BT: Tensor
    """(B, T) float32 Sample.teacher_logprobs (0 where absent)."""
    teacher_mask_BT: Tensor
    """(B, T) bool: a teacher logprob exists on a loss token (Sample.teacher_mask, or 1 wherever
    the sample has teacher_logprobs and no mask)."""
    turn_index_B: Tensor
    """(B,) int64 Sample.turn_index (the turn's index in its session)."""
    wrong_hint_logprobs_BT: Tensor
    """(B, T) float32 Sample.wrong_hint_logprobs: the teacher's logprob of token t under the
    task's wrong hint (RLCSD); 0 off `wrong_hint_mask_BT`."""
    wrong_hint_mask_BT: Tensor
    """(B, T) bool: the sample has wrong-hint logprobs, the value is finite and the token has a
    teacher logprob (`teacher_mask_BT`), as the teacher service writes them."""
    step_rewards_BT: Tensor
    """(B, T) float32 per-turn score ("step/<k>" rewards) on the last sampled token of its turn
    (samples.step_reward_positions); 0 elsewhere."""
    step_mask_BT: Tensor
    """(B, T) bool: True where `step_rewards_BT` holds a score."""
    teacher_topk_ids_BTK: Tensor
    """(B, T, K) int64 Sample.teacher_topk_ids: the teacher's K most likely tokens at position t
    (the distribution token t was drawn from), most likely first; 0 on absent slots."""
    teacher_topk_logprobs_BTK: Tensor
    """(B, T, K) float32 their teacher logprobs (temperature 1); TOPK_ABSENT on absent slots."""
    teacher_topk_mask_BT: Tensor
    """(B, T) bool: a teacher top-k exists at t (the sample has `teacher_topk` > 0, the token
    has a teacher logprob, at least one slot is finite)."""

    @property
    def size(self) -> int:
        return int(self.input_ids_BT.shape[0])

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @property
    def lengths_B(self) -> Tensor:
        """(B,) int64 real tokens of each row."""
        return self.attention_mask_BT.sum(dim=1)

    def rows(self, start: int, end: int) -> TrainBatch:
        """Rows [start, end), trimmed on the right to their longest real sequence."""
        return self.select(torch.arange(start, end))

    def select(self, index_N: Tensor) -> TrainBatch:
        """Rows `index_N` (in that order), trimmed on the right to their longest sequence."""
        length = max(int(self.lengths_B[index_N].max()), 1) if index_N.numel() else 1
        parts = {}
        for f in fields(self):
            value = getattr(self, f.name)[index_N]
            parts[f.name] = value[:, :length] if f.name.endswith(("_BT", "_BTK")) else value
        return TrainBatch(**parts)


def anchor_renormalized(batch: TrainBatch, train_logprobs_BT: Tensor) -> TrainBatch:
    """`batch` with the rollout logprob of every `renormalized_BT` token replaced by the
    trainer's own detached logprob `train_logprobs_BT` (B, T) at the weights taking the step.

    Such a token was drawn from the grammar-masked q(t) = p(t) allowed(t) / sum_allowed p and
    its recorded logprob is log q (SGLang), while the trainer scores the unmasked log p: the
    recorded value is not the behaviour logprob of the distribution the trainer differentiates.
    It is treated as unknown and replaced by the old-policy logprob recomputed by the trainer,
    as in recompute-style PPO (Hilton et al. 2021, arXiv:2110.00641; AReaL, arXiv:2505.24298,
    proximal logprobs): its ratio exp(log p_theta - sg(log p_theta)) is 1 in value with the
    gradient of log p_theta, a correction sees k = 1 on it, and it adds 0 to the
    train-inference gap statistics. Every other token is unchanged. What is lost is only the
    staleness correction of those tokens (their ratio is 1 even when the weights moved since
    they were sampled).

    Worked example (one token, T = 1): p(t) = 0.2 over the full vocabulary, the grammar allows
    t and one other token of p 0.3, so q(t) = 0.2 / 0.5 = 0.4. SGLang records log 0.4 = -0.916;
    the trainer at the same weights scores log 0.2 = -1.609, so the ratio against the recorded
    value would be exp(-1.609 + 0.916) = 0.5: PPO (eps 0.2) would halve the token's gradient
    for a positive advantage and give it none for a negative one (min(0.5 A, 0.8 A) = 0.8 A, the
    clipped term). Anchored, the old logprob is -1.609 and the ratio is exactly 1.
    """
    if not bool(batch.renormalized_BT.any()):
        return batch
    own_BT = train_logprobs_BT.detach().to(batch.old_logprobs_BT.dtype)
    old_BT = torch.where(batch.renormalized_BT, own_BT, batch.old_logprobs_BT)
    return replace(batch, old_logprobs_BT=old_BT)


def collate(
    samples_B: Sequence[sample_pb2.Sample],
    advantages_B: Tensor,
    *,
    sample_weight_B: Tensor | None = None,
    is_correct_B: Tensor | None = None,
    group_index_B: Tensor | None = None,
) -> TrainBatch:
    """Pad `samples_B` on the right into one batch; each sample's advantage fills its loss tokens.

    Args:
        samples_B: B valid Samples.
        advantages_B: (B,) advantage of each sample.
        sample_weight_B: (B,) loss multiplier per sample; None = 1.0.
        is_correct_B: (B,) bool, samples to IS-correct against the trainer; None = none.

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
    teacher_BT = torch.zeros(batch, seq, dtype=torch.float32)
    teacher_mask_BT = torch.zeros(batch, seq, dtype=torch.bool)
    wrong_BT = torch.zeros(batch, seq, dtype=torch.float32)
    has_wrong_BT = torch.zeros(batch, seq, dtype=torch.bool)
    step_BT = torch.zeros(batch, seq, dtype=torch.float32)
    step_mask_BT = torch.zeros(batch, seq, dtype=torch.bool)
    renormalized_BT = torch.zeros(batch, seq, dtype=torch.bool)
    for row, sample in enumerate(samples_B):
        check_trainable(sample)
        n = len(sample.token_ids)
        input_ids_BT[row, :n] = torch.tensor(sample.token_ids, dtype=torch.int64)
        attention_mask_BT[row, :n] = 1
        loss_mask_BT[row, :n] = torch.tensor(sample.loss_mask, dtype=torch.bool)
        old_logprobs_BT[row, :n] = torch.tensor(sample.rollout_logprobs, dtype=torch.float32)
        if len(sample.logprob_renormalized) == n:
            renormalized_BT[row, :n] = torch.tensor(list(sample.logprob_renormalized)) > 0
        if len(sample.teacher_logprobs):
            teacher_BT[row, :n] = torch.tensor(sample.teacher_logprobs, dtype=torch.float32)
            mask = sample.teacher_mask if len(sample.teacher_mask) else [1] * n
            teacher_mask_BT[row, :n] = torch.tensor(list(mask), dtype=torch.bool)
        if len(sample.wrong_hint_logprobs) == n:
            wrong_BT[row, :n] = torch.tensor(sample.wrong_hint_logprobs, dtype=torch.float32)
            has_wrong_BT[row, :n] = True
        for position, score in (step_reward_positions(sample) or {}).items():
            step_BT[row, position], step_mask_BT[row, position] = score, True
    teacher_mask_BT &= loss_mask_BT
    wrong_mask_BT = has_wrong_BT & teacher_mask_BT & torch.isfinite(wrong_BT)
    old_logprobs_BT = torch.where(loss_mask_BT, old_logprobs_BT, 0.0)
    advantages_BT = torch.where(loss_mask_BT, advantages_B.float()[:, None], 0.0)
    topk_ids_BTK, topk_BTK, topk_mask_BT = _teacher_topk(samples_B, seq, teacher_mask_BT)
    return TrainBatch(
        input_ids_BT=input_ids_BT,
        attention_mask_BT=attention_mask_BT,
        loss_mask_BT=loss_mask_BT,
        old_logprobs_BT=old_logprobs_BT,
        renormalized_BT=renormalized_BT & loss_mask_BT,
        advantages_BT=advantages_BT,
        temperature_B=torch.tensor([sample_temperature(s) for s in samples_B]),
        rewards_B=torch.tensor([s.reward for s in samples_B], dtype=torch.float32),
        sample_weight_B=(torch.ones(batch) if sample_weight_B is None else sample_weight_B.float()),
        is_correct_B=(
            torch.zeros(batch, dtype=torch.bool) if is_correct_B is None else is_correct_B.bool()
        ),
        group_index_B=(torch.arange(batch) if group_index_B is None else group_index_B.long()),
        live_B=torch.tensor([not s.group_id for s in samples_B], dtype=torch.bool),
        teacher_logprobs_BT=torch.where(teacher_mask_BT, teacher_BT, 0.0),
        teacher_mask_BT=teacher_mask_BT,
        turn_index_B=torch.tensor([s.turn_index for s in samples_B], dtype=torch.int64),
        wrong_hint_logprobs_BT=torch.where(wrong_mask_BT, wrong_BT, 0.0),
        wrong_hint_mask_BT=wrong_mask_BT,
        step_rewards_BT=step_BT,
        step_mask_BT=step_mask_BT & loss_mask_BT,
        teacher_topk_ids_BTK=topk_ids_BTK,
        teacher_topk_logprobs_BTK=topk_BTK,
        teacher_topk_mask_BT=topk_mask_BT,
    )


def _teacher_topk(
    samples_B: Sequence[sample_pb2.Sample],
    seq: int,
    teacher_mask_BT: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """(B, T, K) ids, (B, T, K) logprobs and (B, T) mask of the samples' teacher top-k.

    `Sample.teacher_topk_ids` / `teacher_topk_logprobs` hold k entries per token, flattened
    (entry t * k + j = the j-th most likely token at position t). A slot is kept where the
    token has a teacher logprob (`teacher_mask_BT`; the teacher writes zeros outside the turn
    it scored, which would read as probability 1) and its logprob is finite and above
    TOPK_ABSENT; every other slot gets id 0 and TOPK_ABSENT.
    """
    batch = len(samples_B)
    k_max = max((s.teacher_topk for s in samples_B if len(s.teacher_topk_ids)), default=0)
    ids_BTK = torch.zeros(batch, seq, k_max, dtype=torch.int64)
    logprobs_BTK = torch.full((batch, seq, k_max), TOPK_ABSENT, dtype=torch.float32)
    for row, sample in enumerate(samples_B):
        k, n = sample.teacher_topk, len(sample.token_ids)
        if k and len(sample.teacher_topk_ids) == len(sample.teacher_topk_logprobs) == k * n:
            ids_BTK[row, :n, :k] = torch.tensor(sample.teacher_topk_ids).view(n, k)
            logprobs_BTK[row, :n, :k] = torch.tensor(
                sample.teacher_topk_logprobs, dtype=torch.float32
            ).view(n, k)
    valid_BTK = (
        teacher_mask_BT[..., None]
        & torch.isfinite(logprobs_BTK)
        & (logprobs_BTK > TOPK_ABSENT / 2)
        & (ids_BTK >= 0)
    )
    return (
        torch.where(valid_BTK, ids_BTK, 0),
        torch.where(valid_BTK, logprobs_BTK, TOPK_ABSENT),
        valid_BTK.any(dim=-1),
    )


def micro_batch_rows(
    batch: TrainBatch, size: int, token_budget: int = 0, packed: bool = False
) -> list[Tensor]:
    """Row indices of each micro-batch of `batch`: at most `size` rows and, when `token_budget`
    > 0, at most `token_budget` tokens (a longer row goes alone). Every pass over the step batch
    (the training pass and the entropy scoring pass) cuts its micro-batches here.

    Padded (`packed` False): the budget counts padded tokens (rows x longest row). Without a
    budget the rows stay in order (consecutive slices); with one, rows are taken longest first,
    so each micro-batch holds rows of similar length. Packed: consecutive rows, the budget counts
    real tokens, since a packed pass costs the sum of the lengths, whatever their order.
    Example (packed): lengths (5, 30, 4, 3), size 8, budget 32 -> rows (0), (1), (2, 3):
    5 + 30 > 32, 30 + 4 > 32, 4 + 3 <= 32.
    """
    lengths = [int(n) for n in batch.lengths_B.tolist()]
    if packed:
        order = list(range(batch.size))
    elif token_budget <= 0:
        return [
            torch.arange(start, min(start + size, batch.size))
            for start in range(0, batch.size, size)
        ]
    else:
        order = sorted(range(batch.size), key=lambda i: (-lengths[i], i))
    out: list[Tensor] = []
    current: list[int] = []
    tokens = longest = 0
    for row in order:
        n = lengths[row] if packed else max(lengths[row], 1)
        if packed:
            over = token_budget > 0 and tokens + n > token_budget
        else:
            over = (len(current) + 1) * max(longest, n) > token_budget
        if current and (len(current) >= size or over):
            out.append(torch.tensor(current))
            current, tokens, longest = [], 0, 0
        current.append(row)
        tokens += n
        longest = max(longest, n)
    if current:
        out.append(torch.tensor(current))
    return out


def micro_batches(
    batch: TrainBatch, size: int, token_budget: int = 0, packed: bool = False
) -> list[TrainBatch]:
    """The micro-batches of `micro_batch_rows` (same arguments), each trimmed on the right."""
    return [batch.select(rows) for rows in micro_batch_rows(batch, size, token_budget, packed)]
