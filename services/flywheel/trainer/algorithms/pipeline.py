"""Composition of the selected parts around the trainer step, and the input contract.

    prepare      samples -> advantage estimator (unless it reads entropy) -> [dynamic
                 sampling: zero-variance groups dropped] -> padded batch
    batch_stage  once per step, whole batch: [no-grad scoring pass, only when a selected part
                 declares `entropy_BT`, cut into the training pass's micro-batches] ->
                 [opd_plus_rl with `student_topk`: the sampled tokens ranked by a no-grad
                 pass, the distillation term dropped outside the student's top-k] -> late
                 advantage estimators (those reading entropy: the step's only advantage
                 computation for grouped rows) -> token weights in configured order (folded
                 into advantages_BT)
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

from flywheel.core import algorithm_catalog as catalog
from flywheel.core.trainer_settings import AlgorithmSettings
from flywheel.trainer.algorithms.advantages import (
    ADVANTAGES,
    AdvantageConfig,
    AdvantageInputs,
)
from flywheel.trainer.algorithms.context import TokenContext, masked
from flywheel.trainer.algorithms.opd_topk import (
    opd_topk_rows,
    restrict_to_student_topk,
    student_ranks,
)
from flywheel.trainer.algorithms.weights import apply_weight

log = logging.getLogger(__name__)

STEP_INPUTS = frozenset(
    {
        "rewards_B",
        "group_index_B",
        "token_ids_BT",
        "loss_mask_BT",
        "rollout_logprobs_BT",
        "old_logprobs_BT",
        "train_logprobs_BT",
        "logprobs_BT",
        "advantages_BT",
        "token_loss_BT",
        "ref_logprobs_BT",
        "teacher_logprobs_BT",
        "teacher_mask_BT",
        "entropy_BT",
        "turn_index_B",
        "step",
        "student_topk_logprobs_BTK",
        "wrong_hint_logprobs_BT",
        "step_rewards_BT",
        "teacher_topk_logprobs_BTK",
        "student_logprobs_at_teacher_topk_BTK",
    }
)
"""Inputs the step provides; every input a catalog row declares is one of them.

From the Samples (batch.py `collate`, no model cost; each masked where the Sample lacks it):
rewards, groups, token ids, loss mask, rollout logprobs, `turn_index_B` (Sample.turn_index),
`teacher_logprobs_BT` / `teacher_mask_BT` (the teacher service), `wrong_hint_logprobs_BT`
(its second pass under the task's `wrong_hint`; NaN for the estimator where absent),
`step_rewards_BT` (the reward service's "step/<k>" turn scores on each turn's last sampled
token, NaN elsewhere) and `teacher_topk_logprobs_BTK` (Sample.teacher_topk_logprobs, K =
`[teacher] top_k`). From the model: `logprobs_BT` / `train_logprobs_BT` (the step's forward),
`entropy_BT` (one no-grad scoring pass of the batch, only when a selected part declares it), and
`student_topk_logprobs_BTK` / `student_logprobs_at_teacher_topk_BTK` (one full-vocabulary
forward with grad per micro-batch, `student_topk`, only when a selected regularizer declares
either; the second is a gather at the teacher's top-k ids from the same logits). The samples
carry teacher and top-k fields only with the teacher stage on (`[teacher] enabled`, `top_k` > 0
for top-k); wrong-hint logprobs only for tasks that give a hint and a `wrong_hint`; step scores
only with the reward service's step judge. Where a Sample lacks one, a part sees it masked off:
`contrastive_sd` gives those tokens the GRPO advantage, `distill_topk` adds 0 there, `segment`
gives a sample without step scores no advantage.
"""


def needs(names: Sequence[str]) -> set[str]:
    """Union of the declared inputs of the parts `names` (catalog rows)."""
    rows = {row.name: row for row in catalog.CATALOG}
    out: set[str] = set()
    for name in names:
        out |= {i.strip().split(" ")[0] for i in rows[name].inputs.split(",") if i.strip() != "-"}
    return out


def param_classes() -> dict[str, type]:
    """The parameter dataclass of every registered part, by name (`NoParams`: takes none)."""
    from flywheel.trainer.algorithms.advantages import ADVANTAGE_PARAMS  # noqa: PLC0415
    from flywheel.trainer.algorithms.corrections import CORRECTIONS  # noqa: PLC0415
    from flywheel.trainer.algorithms.losses import (  # noqa: PLC0415
        AGGREGATION_PARAMS,
        LOSS_PARAMS,
    )
    from flywheel.trainer.algorithms.params import NoParams  # noqa: PLC0415
    from flywheel.trainer.algorithms.regularizers import REGULARIZERS, TERM_PARAMS  # noqa: PLC0415
    from flywheel.trainer.algorithms.weights import WEIGHT_PARAMS  # noqa: PLC0415

    return {
        **ADVANTAGE_PARAMS,
        **LOSS_PARAMS,
        **AGGREGATION_PARAMS,
        **dict.fromkeys(CORRECTIONS, NoParams),
        **WEIGHT_PARAMS,
        **TERM_PARAMS,
        **dict.fromkeys(REGULARIZERS, NoParams),
    }


@dataclass(frozen=True)
class AlgoConfig:
    """The parts `[trainer.algorithm]` selects, and what they need from the step."""

    settings: AlgorithmSettings = field(default_factory=AlgorithmSettings)

    @property
    def advantage(self) -> str:
        return self.settings.advantage

    @property
    def params(self) -> Mapping[str, Mapping[str, Any]]:
        """Per-part hyperparameter overrides (`[trainer.algorithm.params.<part>]`)."""
        return self.settings.params

    @property
    def token_weights(self) -> list[str]:
        return self.settings.token_weights

    @property
    def regularizers(self) -> list[tuple[str, float]]:
        """(name, coefficient) of each regularizer term added to the token loss, by name."""
        return sorted(self.settings.regularizers.items())

    @property
    def other_parts(self) -> list[str]:
        """Parts selected by other settings (`loss_aggregation`, `rollout_correction`, the KL
        estimator with kl_coef > 0, `entropy_bonus` with entropy_coef > 0, `opd` or
        `opd_plus_rl` as the live estimator): their parameters are checked like the others'."""
        s = self.settings
        others = [s.loss_aggregation, s.rollout_correction]
        if s.kl_coef > 0:
            others.append(s.kl_estimator)
        if s.entropy_coef > 0:
            others.append("entropy_bonus")
        if s.live_advantage in ("opd", "opd_plus_rl"):
            others.append(s.live_advantage)
        return others

    def selected(self) -> list[str]:
        """Every selected part, once, in order (with `opd_plus_rl`, its `rl_advantage`)."""
        names = [
            self.advantage,
            self.settings.policy_loss,
            *self.token_weights,
            *(n for n, _ in self.regularizers),
            *self.other_parts,
        ]
        if self.advantage == "opd_plus_rl":
            names.append(str(self.params.get("opd_plus_rl", {}).get("rl_advantage", "grpo")))
        return list(dict.fromkeys(names))

    def check(self) -> None:
        """Raise ValueError for a part whose inputs the step cannot provide, parameters for a
        part that is not selected, or parameters a selected part does not take."""
        from flywheel.trainer.algorithms.params import resolve  # noqa: PLC0415

        selected = self.selected()
        for name in selected:
            missing = needs([name]) - STEP_INPUTS
            if missing:
                raise ValueError(
                    f"algorithm part {name!r} needs {sorted(missing)}, which the "
                    "trainer step does not compute yet; choose another part"
                )
        unselected = sorted(set(self.params) - set(selected))
        if unselected:
            raise ValueError(
                f"[trainer.algorithm.params] names {unselected}, which are not selected; "
                f"the selected parts are {selected}"
            )
        classes = param_classes()
        for name in selected:
            resolve(classes[name], self.params.get(name), name)

    def part_params(self, name: str) -> Any:
        """The parameter dataclass of part `name` with its overrides."""
        from flywheel.trainer.algorithms.params import resolve  # noqa: PLC0415

        return resolve(param_classes()[name], self.params.get(name), name)

    @property
    def late_advantage(self) -> bool:
        """The advantage estimator reads entropy: it runs in `batch_stage` (where the entropy
        is scored), and `prepare` leaves the grouped rows' advantages to it."""
        return "entropy_BT" in needs([self.advantage])

    @property
    def needs_topk(self) -> bool:
        """The step runs the full-vocabulary student pass (`student_topk`): a selected
        regularizer reads the student's own top-k or its logprobs at the teacher's top-k ids."""
        return self.needs_own_topk or self.needs_teacher_topk

    @property
    def needs_own_topk(self) -> bool:
        """A selected regularizer reads the student's own top-k (SimKO, Lp-Reg)."""
        return "student_topk_logprobs_BTK" in needs([n for n, _ in self.regularizers])

    @property
    def needs_teacher_topk(self) -> bool:
        """A selected regularizer reads the student at the teacher's top-k ids (distill_topk)."""
        return "student_logprobs_at_teacher_topk_BTK" in needs([n for n, _ in self.regularizers])

    @property
    def needs_entropy(self) -> bool:
        """A selected advantage or token weight reads `entropy_BT` (the scoring pass)."""
        return "entropy_BT" in needs([self.advantage, *self.token_weights])

    @property
    def ranks_student(self) -> bool:
        """`opd_plus_rl` (the advantage or the live one) restricts its distillation term to
        the student's top-k (`student_topk` > 0): batch_stage ranks the sampled tokens."""
        s = self.settings
        if "opd_plus_rl" not in (s.advantage, s.live_advantage):
            return False
        return int(self.params.get("opd_plus_rl", {}).get("student_topk", 0)) > 0

    @property
    def needs_entropy_pass(self) -> bool:
        """batch_stage runs a no-grad pass of the batch through the model: for `entropy_BT`,
        or to rank the sampled tokens for `opd_plus_rl`'s `student_topk`."""
        return self.needs_entropy or self.ranks_student


def advantage_inputs(
    batch: Any, rows_N: Tensor | None = None, group_index_N: Tensor | None = None
) -> AdvantageInputs:
    """AdvantageInputs of rows `rows_N` (None = all) of a `TrainBatch`, every field filled.

    `group_index_N` renumbers the rows' groups (None = the batch's). Inputs a Sample may lack
    are NaN off their mask, which the estimators read as absent: `wrong_hint_logprobs_BT` (off
    `wrong_hint_mask_BT`) and `step_rewards_BT` (off `step_mask_BT`).
    """
    rows = slice(None) if rows_N is None else rows_N
    nan = torch.tensor(float("nan"))
    return AdvantageInputs(
        rewards_B=batch.rewards_B[rows].double(),
        group_index_B=batch.group_index_B[rows] if group_index_N is None else group_index_N,
        teacher_logprobs_BT=batch.teacher_logprobs_BT[rows],
        rollout_logprobs_BT=batch.old_logprobs_BT[rows],
        teacher_mask_BT=batch.teacher_mask_BT[rows],
        token_ids_BT=batch.input_ids_BT[rows],
        loss_mask_BT=batch.loss_mask_BT[rows],
        turn_index_B=batch.turn_index_B[rows],
        step_rewards_BT=torch.where(batch.step_mask_BT[rows], batch.step_rewards_BT[rows], nan),
        wrong_hint_logprobs_BT=torch.where(
            batch.wrong_hint_mask_BT[rows], batch.wrong_hint_logprobs_BT[rows], nan
        ),
    )


def estimate(
    name: str,
    batch: Any,
    rows_N: Tensor,
    cfg: Any,
    rewards_B: Tensor | None = None,
    entropy_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """(N, T) advantages of rows `rows_N` of `batch` by estimator `name` (its groups renumbered
    within the rows), 0 off the loss mask, with the estimator's metrics.

    `cfg` is the `StepConfig` (`algorithm.std_floor`, `algo.params`); `rewards_B` (B,) replaces the
    batch's float32 rewards (prepare passes the Samples' float64 ones); `entropy_BT` (B, T) is
    given to estimators that read it.
    """
    _, groups_N = torch.unique(batch.group_index_B[rows_N], return_inverse=True)
    inputs = advantage_inputs(batch, rows_N, groups_N)
    if rewards_B is not None:
        inputs = dataclasses.replace(inputs, rewards_B=rewards_B[rows_N])
    if entropy_BT is not None:
        inputs = dataclasses.replace(inputs, entropy_BT=entropy_BT[rows_N])
    adv_cfg = AdvantageConfig(
        std_floor=cfg.algorithm.std_floor,
        params=cfg.algo.params.get(name, {}),
        part_params=cfg.algo.params,
    )
    out = ADVANTAGES[name](inputs, adv_cfg)
    mask_NT = batch.loss_mask_BT[rows_N]
    if out.advantages_BT is not None:
        adv_NT = out.advantages_BT[:, : mask_NT.shape[1]].float()
    else:
        adv_NT = out.advantages_B.float()[:, None].expand(mask_NT.shape)
    return masked(adv_NT, mask_NT), out.metrics


def advantage_token_stats(advantages_BT: Tensor, loss_mask_BT: Tensor) -> dict[str, float]:
    """`adv/token_mean` and `adv/token_std` over the loss tokens."""
    selected = advantages_BT[loss_mask_BT].double()
    return {
        "adv/token_mean": float(selected.mean()) if selected.numel() else 0.0,
        "adv/token_std": float(selected.std()) if selected.numel() > 1 else 0.0,
    }


def batch_stage(model: Any, optimizer: Any, batch: Any, cfg: Any) -> tuple[Any, dict[str, float]]:
    """Late advantages and token weights on the whole step batch (before any micro-batch).

    A late estimator (one that reads `entropy_BT`) computes the grouped rows' advantages here,
    once, from the scoring pass; `prepare` left them to it. Live rows keep the live estimator's.

    Args:
        model: the policy (scored without grad for `entropy_BT`, only when a part needs it).
        optimizer: its AdamW step count is the schedule step of the parts.
        batch: the step's `TrainBatch` (needs `group_index_B`, `live_B`).
        cfg: the `StepConfig` (`algo`, `std_floor`, micro-batching and layout).

    Returns:
        (`batch` with new `advantages_BT`, or unchanged when no part is selected; metrics).
    """
    algo: AlgoConfig = cfg.algo
    if not algo.token_weights and not algo.late_advantage and not algo.ranks_student:
        return batch, {}
    metrics: dict[str, float] = {}
    entropy_BT = scoring_pass(model, batch, cfg) if algo.needs_entropy else None
    advantages_BT = batch.advantages_BT
    rows_N, opd_params = opd_topk_rows(cfg, batch)
    if opd_params is not None and rows_N.numel():
        ranks_BT = student_ranks(model, batch, cfg)
        adv_NT, out = restrict_to_student_topk(
            advantages_BT[rows_N],
            batch.teacher_logprobs_BT[rows_N],
            batch.old_logprobs_BT[rows_N],
            batch.teacher_mask_BT[rows_N],
            batch.loss_mask_BT[rows_N],
            ranks_BT[rows_N],
            opd_params,
        )
        advantages_BT = advantages_BT.clone()
        advantages_BT[rows_N] = adv_NT
        metrics |= out
    if algo.late_advantage:
        grouped_N = (~batch.live_B).nonzero(as_tuple=True)[0]
        if grouped_N.numel():
            adv_NT, out = estimate(algo.advantage, batch, grouped_N, cfg, entropy_BT=entropy_BT)
            advantages_BT = advantages_BT.clone()
            advantages_BT[grouped_N] = adv_NT
            metrics |= out
        metrics |= advantage_token_stats(advantages_BT, batch.loss_mask_BT)
    ctx = TokenContext(
        advantages_BT=advantages_BT,
        loss_mask_BT=batch.loss_mask_BT,
        old_logprobs_BT=batch.old_logprobs_BT,
        rewards_B=batch.rewards_B,
        group_index_B=batch.group_index_B,
        entropy_BT=entropy_BT,
        token_ids_BT=batch.input_ids_BT,
        step=optimizer_steps(optimizer),
    )
    for name in algo.token_weights:
        res = apply_weight(name, ctx, algo.params.get(name))
        ctx = ctx.with_advantages(res.advantages_BT)
        metrics |= res.metrics
    return dataclasses.replace(batch, advantages_BT=ctx.advantages_BT), metrics


@torch.no_grad()
def scoring_pass(model: Any, batch: Any, cfg: Any) -> Tensor:
    """(B, T) detached entropy of every loss position under the current weights.

    Cut into the training pass's micro-batches (`batch.micro_batch_rows` with the `StepConfig`'s
    `micro_batch_size`, `micro_batch_tokens` and layout), so it stays within the same memory
    budget; each micro-batch's rows are written back to their places in the batch.
    """
    from flywheel.trainer.batch import micro_batch_rows  # noqa: PLC0415
    from flywheel.trainer.logprobs import selected_token_logprobs  # noqa: PLC0415

    device = next(model.parameters()).device
    entropy_BT = torch.zeros(batch.loss_mask_BT.shape, dtype=torch.float32)
    for rows_N in micro_batch_rows(
        batch, cfg.batch.micro_batch_size, cfg.batch.micro_batch_tokens, cfg.packed
    ):
        mb = batch.select(rows_N)
        if bool(mb.loss_mask_BT.any()):
            mbd = mb.to(device)
            lp = selected_token_logprobs(
                model,
                mbd.input_ids_BT,
                mbd.attention_mask_BT,
                mbd.temperature_B,
                mbd.loss_mask_BT,
                chunk_tokens=cfg.batch.logprob_chunk_tokens,
                packed=cfg.packed,
                shared_prefix=cfg.shared_prefix,
            )
            width = lp.entropy_BT.shape[1]
            entropy_BT[rows_N, :width] = lp.entropy_BT.detach().float().cpu()
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


@dataclass(frozen=True)
class StudentTopK:
    """What the full-vocabulary pass (`student_topk`) gives the regularizer terms.

    Shapes: (B, T, K); position t is the distribution token t was drawn from, at the row's
    temperature; every position off the loss mask holds 0 (own top-k) or TOPK_ABSENT.
    """

    topk_BTK: Tensor | None = None
    """(B, T, TOPK) the student's own most likely logprobs, descending, with grad; None unless
    a selected term declares `student_topk_logprobs_BTK`."""
    at_teacher_BTK: Tensor | None = None
    """(B, T, K) the student's logprobs at the teacher's top-k ids (`teacher_topk_ids_BTK`),
    with grad; TOPK_ABSENT on slots without a teacher entry or with an id outside the student's
    vocabulary. None unless a selected term declares `student_logprobs_at_teacher_topk_BTK`."""
    teacher_BTK: Tensor | None = None
    """(B, T, K) the batch's teacher top-k logprobs with the same slots set to TOPK_ABSENT, so
    both sides bin the same tokens."""


def student_topk(model: Any, mb: Any, cfg: Any) -> StudentTopK | None:
    """The student's top-k and its logprobs at the teacher's top-k ids, from one forward with
    grad at each row's temperature. None unless a selected regularizer declares
    `student_topk_logprobs_BTK` or `student_logprobs_at_teacher_topk_BTK`.

    Position t reads the logits at t - 1 (the distribution token t was drawn from), so the
    gather at t uses `mb.teacher_topk_ids_BTK[:, t]`, the ids the teacher scored for token t.

    A plain full-vocabulary forward (logits (B, T, V) with grad): memory grows with V, so it is
    only run for the parts that need it (SimKO, Lp-Reg, distill_topk).
    """
    from flywheel.trainer.batch import TOPK_ABSENT  # noqa: PLC0415

    algo: AlgoConfig = cfg.algo
    if not algo.needs_topk:
        return None
    logits_BTV = model(input_ids=mb.input_ids_BT, attention_mask=mb.attention_mask_BT).logits
    logits_BTV = logits_BTV[:, :-1].float() / mb.temperature_B.float()[:, None, None]
    logp_BTV = torch.log_softmax(logits_BTV, dim=-1)
    mask_BT1 = mb.loss_mask_BT.bool()[..., None]
    out = StudentTopK()
    if algo.needs_own_topk:
        top_BTK = torch.nn.functional.pad(logp_BTV.topk(TOPK, dim=-1).values, (0, 0, 1, 0))
        out = dataclasses.replace(
            out, topk_BTK=torch.where(mask_BT1, top_BTK, torch.zeros_like(top_BTK))
        )
    if algo.needs_teacher_topk:
        ids_BTK, teacher_BTK = mb.teacher_topk_ids_BTK, mb.teacher_topk_logprobs_BTK
        valid_BTK = (
            (teacher_BTK > TOPK_ABSENT / 2)
            & (ids_BTK < logp_BTV.shape[-1])
            & mask_BT1
            & mb.teacher_topk_mask_BT.bool()[..., None]
        )
        safe_BTK = torch.where(valid_BTK, ids_BTK, torch.zeros_like(ids_BTK))
        at_BTK = torch.nn.functional.pad(logp_BTV.gather(2, safe_BTK[:, 1:]), (0, 0, 1, 0))
        absent = torch.full_like(at_BTK, TOPK_ABSENT)
        out = dataclasses.replace(
            out,
            at_teacher_BTK=torch.where(valid_BTK, at_BTK, absent),
            teacher_BTK=torch.where(valid_BTK, teacher_BTK.float(), absent),
        )
    return out


def token_terms(
    algo: AlgoConfig,
    lp: Any,
    mb: Any,
    student: StudentTopK | None = None,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """sum_k coef_k term_k (B, T) of the selected regularizers for one micro-batch, and the
    detached terms as token statistics (`reg/<name>`). None when none is selected.

    `lp` is the step's `TokenLogprobs` (logprobs with grad, detached entropy); `student` the
    `student_topk` output when a selected term declared one of its inputs.

    KL estimators take the rollout logprobs as the reference policy; distillation terms read
    the micro-batch's teacher logprobs (top-k: its teacher top-k) and are 0 where it has none.
    """
    if not algo.regularizers:
        return None, {}
    from flywheel.trainer.algorithms.regularizers import apply_term  # noqa: PLC0415

    student = student or StudentTopK()
    ctx = TokenContext(
        advantages_BT=mb.advantages_BT,
        loss_mask_BT=mb.loss_mask_BT,
        old_logprobs_BT=mb.old_logprobs_BT,
        rewards_B=mb.rewards_B,
        group_index_B=mb.group_index_B,
        logprobs_BT=lp.logprobs_BT,
        entropy_BT=lp.entropy_BT.detach(),
        token_ids_BT=mb.input_ids_BT,
        teacher_logprobs_BT=mb.teacher_logprobs_BT,
        topk_logprobs_BTK=student.topk_BTK,
        teacher_topk_logprobs_BTK=student.teacher_BTK,
        student_at_teacher_topk_BTK=student.at_teacher_BTK,
    )
    total_BT: Tensor | None = None
    stats: dict[str, Tensor] = {}
    for name, coef in algo.regularizers:
        term_BT = apply_term(name, ctx, algo.params.get(name))
        if name == "distill_topk":
            term_BT = masked(term_BT, mb.teacher_topk_mask_BT)
        elif name.startswith("distill_"):
            term_BT = masked(term_BT, mb.teacher_mask_BT)
        stats[f"reg/{name}"] = term_BT.detach()
        total_BT = coef * term_BT if total_BT is None else total_BT + coef * term_BT
    return total_BT, stats


def keep_groups_with_spread(
    groups: Sequence[Sequence[Any]],
    treatments: Sequence[Any] | None,
    std_floor: float,
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
    keep: list[Sequence[Any]] = []
    kept_treat: list[Any] = []
    dropped, offset = 0, 0
    for group in groups:
        n = len(group)
        rewards = torch.tensor([s.reward for s in group], dtype=torch.float64)
        live = n == 1 and not group[0].group_id
        spread = n > 1 and float(rewards.std()) >= std_floor
        if live or spread:
            keep.append(group)
            if treatments is not None:
                kept_treat.extend(treatments[offset : offset + n])
        else:
            dropped += n
        offset += n
    if not keep:
        return list(groups), (list(treatments) if treatments is not None else None), 0
    if dropped:
        log.info("dynamic sampling: dropped %d samples of groups without reward spread", dropped)
    return keep, (kept_treat if treatments is not None else None), dropped
