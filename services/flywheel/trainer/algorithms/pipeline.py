"""Composition of the selected parts around the trainer step, and the input contract.

    prepare      samples -> advantage estimator (token fields it declares) -> [dynamic
                 sampling: zero-variance groups dropped] -> padded batch
    batch_stage  once per step, whole batch: [no-grad scoring pass, only when a selected part
                 declares `entropy_BT`] -> late advantage estimators (those reading entropy)
                 -> token weights in configured order (folded into advantages_BT)
    token_terms  per micro-batch, with grad: regularizer terms (coef * term_BT) added to the
                 token policy loss before aggregation

The input contract: every part declares the inputs it reads in `catalog.py`; `needs` unions
them for the selected parts, and the step computes an extra model output (the entropy pass,
top-k logprobs) only when that union names it. A part whose input the step cannot provide
fails at start-up (`AlgoConfig.check`) with a message naming the input.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from flywheel.trainer.algorithms import catalog
from flywheel.trainer.algorithms.advantages import (
    ADVANTAGES,
    AdvantageConfig,
    AdvantageInputs,
    AdvantageOutputs,
)
from flywheel.trainer.algorithms.context import TokenContext, masked
from flywheel.trainer.algorithms.weights import apply_weight

log = logging.getLogger(__name__)

STEP_INPUTS = frozenset({
    "rewards_B", "group_index_B", "token_ids_BT", "loss_mask_BT", "rollout_logprobs_BT",
    "old_logprobs_BT", "train_logprobs_BT", "logprobs_BT", "advantages_BT", "token_loss_BT",
    "ref_logprobs_BT", "teacher_logprobs_BT", "teacher_mask_BT", "entropy_BT", "turn_index_B",
    "step", "student_topk_logprobs_BTK",
})
"""Inputs the step can provide today. `entropy_BT` costs one no-grad scoring pass of the batch.
`student_topk_logprobs_BTK` costs a second, full-vocabulary forward pass with grad per
micro-batch (`student_topk`). Not provided yet: `student_logprobs_at_teacher_topk_BTK` (the
batch does not carry the teacher's top-k ids), `wrong_hint_logprobs_BT` (the Sample schema
has no field for a second teacher pass) and `step_rewards_BT` (no per-step score field in
the Sample)."""


def needs(names: Sequence[str]) -> set[str]:
    """Union of the declared inputs of the parts `names` (catalog rows)."""
    rows = {row.name: row for row in catalog.CATALOG}
    out: set[str] = set()
    for name in names:
        out |= {i.strip().split(" ")[0] for i in rows[name].inputs.split(",") if i.strip() != "-"}
    return out


@dataclass(frozen=True)
class AlgoConfig:
    """The selected parts beyond advantage / policy loss / aggregation / correction."""

    advantage: str = "grpo"
    policy_loss: str = "ppo_clip"
    token_weights: tuple[str, ...] = ()
    regularizers: tuple[tuple[str, float], ...] = ()
    """(name, coefficient) of each regularizer term added to the token loss."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: groups without reward spread are dropped from the step."""
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per-part hyperparameter overrides (`[trainer.algorithm_params.<part>]`)."""

    @classmethod
    def from_settings(cls, s: Any) -> AlgoConfig:
        cfg = cls(
            advantage=s.advantage,
            policy_loss=s.policy_loss,
            token_weights=tuple(s.token_weights),
            regularizers=tuple(sorted(s.regularizers.items())),
            dynamic_sampling=s.dynamic_sampling,
            params={k: dict(v) for k, v in s.algorithm_params.items()},
        )
        cfg.check()
        return cfg

    def selected(self) -> list[str]:
        return [self.advantage, self.policy_loss, *self.token_weights,
                *(n for n, _ in self.regularizers)]

    def check(self) -> None:
        """Raise ValueError for a part whose inputs the step cannot provide or bad params."""
        from flywheel.trainer.algorithms.advantages_token import (  # noqa: PLC0415
            TOKEN_ADVANTAGE_PARAMS,
        )
        from flywheel.trainer.algorithms.losses import LOSS_PARAMS  # noqa: PLC0415
        from flywheel.trainer.algorithms.params import resolve  # noqa: PLC0415
        from flywheel.trainer.algorithms.regularizers import TERM_PARAMS  # noqa: PLC0415
        from flywheel.trainer.algorithms.weights import WEIGHT_PARAMS  # noqa: PLC0415

        for name in self.selected():
            missing = needs([name]) - STEP_INPUTS
            if missing:
                raise ValueError(f"algorithm part {name!r} needs {sorted(missing)}, which the "
                                 "trainer step does not compute yet; choose another part")
        for name in self.token_weights:
            resolve(WEIGHT_PARAMS[name], self.params.get(name), name)
        for name, _ in self.regularizers:
            resolve(TERM_PARAMS[name], self.params.get(name), name)
        if self.advantage in TOKEN_ADVANTAGE_PARAMS:
            resolve(TOKEN_ADVANTAGE_PARAMS[self.advantage], self.params.get(self.advantage),
                    self.advantage)
        if self.policy_loss in LOSS_PARAMS:
            resolve(LOSS_PARAMS[self.policy_loss], self.params.get(self.policy_loss),
                    self.policy_loss)

    @property
    def late_advantage(self) -> bool:
        """The advantage estimator reads entropy: it runs in `batch_stage`, not `prepare`."""
        return "entropy_BT" in needs([self.advantage])

    @property
    def needs_topk(self) -> bool:
        return "student_topk_logprobs_BTK" in needs([n for n, _ in self.regularizers])

    @property
    def prepare_advantage(self) -> str:
        """Estimator run in `prepare` (GRPO stands in for a late one until `batch_stage`)."""
        return "grpo" if self.late_advantage else self.advantage

    @property
    def needs_entropy_pass(self) -> bool:
        return "entropy_BT" in needs([self.advantage, *self.token_weights])


def advantage_inputs(samples_B: Sequence[Any], group_index_B: Tensor) -> AdvantageInputs:
    """AdvantageInputs with the per-token fields filled from the Samples (right-padded)."""
    batch = len(samples_B)
    seq = max((len(s.token_ids) for s in samples_B), default=1)
    token_ids_BT = torch.zeros(batch, seq, dtype=torch.int64)
    mask_BT = torch.zeros(batch, seq, dtype=torch.bool)
    rollout_BT = torch.zeros(batch, seq, dtype=torch.float32)
    teacher_BT = torch.zeros(batch, seq, dtype=torch.float32)
    teacher_mask_BT = torch.zeros(batch, seq, dtype=torch.bool)
    any_teacher = False
    for row, s in enumerate(samples_B):
        n = len(s.token_ids)
        token_ids_BT[row, :n] = torch.tensor(list(s.token_ids), dtype=torch.int64)
        mask_BT[row, :n] = torch.tensor(list(s.loss_mask), dtype=torch.bool)
        rollout_BT[row, :n] = torch.tensor(list(s.rollout_logprobs), dtype=torch.float32)
        if len(s.teacher_logprobs):
            any_teacher = True
            teacher_BT[row, :n] = torch.tensor(list(s.teacher_logprobs), dtype=torch.float32)
            tm = list(s.teacher_mask) or [1] * n
            teacher_mask_BT[row, :n] = torch.tensor(tm, dtype=torch.bool) & mask_BT[row, :n]
    return AdvantageInputs(
        rewards_B=torch.tensor([s.reward for s in samples_B], dtype=torch.float64),
        group_index_B=group_index_B,
        teacher_logprobs_BT=teacher_BT if any_teacher else None,
        rollout_logprobs_BT=rollout_BT,
        teacher_mask_BT=teacher_mask_BT if any_teacher else None,
        token_ids_BT=token_ids_BT,
        loss_mask_BT=mask_BT,
        turn_index_B=torch.tensor([s.turn_index for s in samples_B], dtype=torch.int64),
    )


def zero_variance_groups(rewards_B: Tensor, group_index_B: Tensor, floor: float) -> Tensor:
    """(B,) bool: samples whose group has reward std below `floor` (or a single member)."""
    out = torch.zeros(rewards_B.shape[0], dtype=torch.bool)
    for g in torch.unique(group_index_B).tolist():
        idx = (group_index_B == g).nonzero(as_tuple=True)[0]
        r = rewards_B[idx].double()
        out[idx] = idx.numel() < 2 or float(r.std()) < floor
    return out


def token_advantages(batch_mask_BT: Tensor, out: AdvantageOutputs) -> Tensor | None:
    """The estimator's (B, T) token advantages cut to the batch's width, 0 off the mask."""
    if out.advantages_BT is None:
        return None
    adv_BT = out.advantages_BT[:, : batch_mask_BT.shape[1]].float()
    return masked(adv_BT, batch_mask_BT)


def batch_stage(model: Any, optimizer: Any, batch: Any, cfg: Any) -> tuple[Any, dict[str, float]]:
    """Late advantages and token weights on the whole step batch (before any micro-batch).

    Args:
        model: the policy (scored without grad for `entropy_BT`, only when a part needs it).
        optimizer: its AdamW step count is the schedule step of the parts.
        batch: the step's `TrainBatch` (needs `group_index_B`).
        cfg: the `StepConfig` (`algo`, `advantage`, `std_floor`, `quantile_k`, micro-batching).

    Returns:
        (`batch` with new `advantages_BT`, or unchanged when no part is selected; metrics).
    """
    algo: AlgoConfig = cfg.algo
    if not algo.token_weights and not algo.late_advantage:
        return batch, {}
    metrics: dict[str, float] = {}
    entropy_BT = scoring_pass(model, batch, cfg.logprob_chunk_tokens, cfg.micro_batch_size) \
        if algo.needs_entropy_pass else None
    advantages_BT = batch.advantages_BT
    if algo.late_advantage:
        inputs = AdvantageInputs(
            rewards_B=batch.rewards_B.double(), group_index_B=batch.group_index_B,
            rollout_logprobs_BT=batch.old_logprobs_BT, token_ids_BT=batch.input_ids_BT,
            loss_mask_BT=batch.loss_mask_BT, entropy_BT=entropy_BT,
        )
        adv_cfg = AdvantageConfig(std_floor=cfg.std_floor, quantile_k=cfg.quantile_k,
                                  params=algo.params.get(algo.advantage, {}))
        out = ADVANTAGES[algo.advantage](inputs, adv_cfg)
        late_BT = token_advantages(batch.loss_mask_BT, out)
        if late_BT is None:
            late_BT = masked(out.advantages_B.float()[:, None].expand_as(advantages_BT),
                             batch.loss_mask_BT)
        grouped_B = torch.bincount(batch.group_index_B)[batch.group_index_B] > 1
        advantages_BT = torch.where(grouped_B[:, None], late_BT, advantages_BT)
        metrics |= out.metrics
    ctx = TokenContext(
        advantages_BT=advantages_BT, loss_mask_BT=batch.loss_mask_BT,
        old_logprobs_BT=batch.old_logprobs_BT, rewards_B=batch.rewards_B,
        group_index_B=batch.group_index_B, entropy_BT=entropy_BT,
        token_ids_BT=batch.input_ids_BT, step=optimizer_steps(optimizer),
    )
    for name in algo.token_weights:
        res = apply_weight(name, ctx, algo.params.get(name))
        ctx = ctx.with_advantages(res.advantages_BT)
        metrics |= res.metrics
    return dataclasses.replace(batch, advantages_BT=ctx.advantages_BT), metrics


@torch.no_grad()
def scoring_pass(model: Any, batch: Any, chunk_tokens: int, micro_batch_size: int) -> Tensor:
    """(B, T) detached entropy of every loss position under the current weights."""
    from flywheel.trainer.batch import micro_batches  # noqa: PLC0415
    from flywheel.trainer.logprobs import selected_token_logprobs  # noqa: PLC0415

    device = next(model.parameters()).device
    entropy_BT = torch.zeros(batch.loss_mask_BT.shape, dtype=torch.float32)
    start = 0
    for mb in micro_batches(batch, micro_batch_size):
        rows = mb.size
        if bool(mb.loss_mask_BT.any()):
            mbd = mb.to(device)
            lp = selected_token_logprobs(model, mbd.input_ids_BT, mbd.attention_mask_BT,
                                         mbd.temperature_B, mbd.loss_mask_BT,
                                         chunk_tokens=chunk_tokens)
            width = lp.entropy_BT.shape[1]
            entropy_BT[start:start + rows, :width] = lp.entropy_BT.detach().float().cpu()
        start += rows
    return masked(entropy_BT, batch.loss_mask_BT)


def optimizer_steps(optimizer: torch.optim.Optimizer) -> int:
    """Optimizer steps taken so far (AdamW's per-parameter `step`; 0 before the first)."""
    for state in optimizer.state.values():
        step = state.get("step")
        if step is not None:
            return int(step)
    return 0


TOPK = 8
"""Candidates per position in `student_topk` (SimKO reads its first `top_k`, Lp-Reg all)."""


def student_topk(model: Any, mb: Any, cfg: Any) -> Tensor | None:
    """(B, T, K) log-probabilities of the K most likely next tokens at every position, with
    grad, at each row's temperature (position t: the distribution token t was drawn from; 0 at
    t = 0 and off the loss mask). None unless a selected regularizer declares
    `student_topk_logprobs_BTK`.

    A plain full-vocabulary forward (logits (B, T, V) with grad): memory grows with V, so it is
    only run for the parts that need it (SimKO, Lp-Reg).
    """
    if not cfg.algo.needs_topk:
        return None
    logits_BTV = model(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT).logits
    logits_BTV = logits_BTV[:, :-1].float() / mb.temperature_B.float()[:, None, None]
    top_BTK = torch.log_softmax(logits_BTV, dim=-1).topk(TOPK, dim=-1).values
    top_BTK = torch.nn.functional.pad(top_BTK, (0, 0, 1, 0))
    return torch.where(mb.loss_mask_BT.bool()[..., None], top_BTK, torch.zeros_like(top_BTK))


def token_terms(algo: AlgoConfig, lp: Any, mb: Any, topk_BTK: Tensor | None = None,
                ) -> tuple[Tensor | None, dict[str, Tensor]]:
    """sum_k coef_k term_k (B, T) of the selected regularizers for one micro-batch, and the
    detached terms as token statistics (`reg/<name>`). None when none is selected.

    `lp` is the step's `TokenLogprobs` (logprobs with grad, detached entropy); `topk_BTK` the
    `student_topk` output when a selected term declared it.

    KL estimators take the rollout logprobs as the reference policy; distillation terms read
    the micro-batch's teacher logprobs and are 0 where it has none.
    """
    if not algo.regularizers:
        return None, {}
    from flywheel.trainer.algorithms.regularizers import apply_term  # noqa: PLC0415

    teacher_mask_BT = getattr(mb, "teacher_mask_BT", None)
    ctx = TokenContext(
        advantages_BT=mb.advantages_BT, loss_mask_BT=mb.loss_mask_BT,
        old_logprobs_BT=mb.old_logprobs_BT, rewards_B=mb.rewards_B,
        group_index_B=mb.group_index_B, logprobs_BT=lp.logprobs_BT,
        entropy_BT=lp.entropy_BT.detach(), token_ids_BT=mb.input_ids_BT,
        teacher_logprobs_BT=getattr(mb, "teacher_logprobs_BT", None), topk_logprobs_BTK=topk_BTK,
    )
    total_BT: Tensor | None = None
    stats: dict[str, Tensor] = {}
    for name, coef in algo.regularizers:
        term_BT = apply_term(name, ctx, algo.params.get(name))
        if name.startswith("distill_") and teacher_mask_BT is not None:
            term_BT = masked(term_BT, teacher_mask_BT)
        stats[f"reg/{name}"] = term_BT.detach()
        total_BT = coef * term_BT if total_BT is None else total_BT + coef * term_BT
    return total_BT, stats


def keep_groups_with_spread(
    groups: Sequence[Sequence[Any]], treatments: Sequence[Any] | None, std_floor: float,
) -> tuple[list[Sequence[Any]], list[Any] | None, int]:
    """DAPO dynamic sampling: drop groups whose rewards have no spread (std < floor).

    "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", Yu et al. 2025,
    arXiv:2503.14476, section 3.2: groups whose samples are all correct (or all wrong) carry no
    advantage and only dilute the token-mean normalizer. DAPO over-samples to refill the batch;
    here the step trains on the groups that remain (each dropped sample is counted in
    `samples/dropped_zero_variance` and logged). Live samples (no group_id) are kept. If every
    group would be dropped, all are kept, so the step (zero policy gradient) still commits and
    pushes a weight version. `treatments` (one per sample, flattened) are filtered alike.

    Returns:
        (kept groups, their treatments or None, number of dropped samples).
    """
    keep, kept_treat, dropped, offset = [], [], 0, 0
    for group in groups:
        n = len(group)
        rewards = torch.tensor([s.reward for s in group], dtype=torch.float64)
        live = n == 1 and not group[0].group_id
        spread = n > 1 and float(rewards.std()) >= std_floor
        if live or spread:
            keep.append(group)
            if treatments is not None:
                kept_treat.extend(treatments[offset:offset + n])
        else:
            dropped += n
        offset += n
    if not keep:
        return list(groups), (list(treatments) if treatments is not None else None), 0
    if dropped:
        log.info("dynamic sampling: dropped %d samples of groups without reward spread", dropped)
    return keep, (kept_treat if treatments is not None else None), dropped
