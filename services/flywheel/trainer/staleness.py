"""What happens to a sample whose tokens lag behind the trainer's weights (torch-free).

The bound applies per token: a sample's tokens may come from several weight versions (a push
mid-generation, a partial rollout continued after an abort), and each sampled token's lag is
trainer version - the version that sampled it (a token without a version, < 0, counts as
version 0; staleness is measured from dispatch, BUG-19). `StalenessPolicy.tokens`:

1. The drop bound D is `max_staleness` under policy `drop`, else `hard_limit` (0 = none).
   Sampled tokens with lag > D are masked out of the loss (they stay in the context), counted
   in `flywheel_trainer_stale_tokens_total` and logged; a sample all of whose sampled tokens
   are beyond D is dropped as `stale` (acked, counted, logged).
2. The sample's lag is the lag of its oldest token left; `treat` gives its treatment.

Worked example: trainer version 10, max_staleness 2, policy drop; sampled tokens of versions
[7, 7, 8, 9, 9] have lags [3, 3, 2, 1, 1]: the two tokens of version 7 are masked (lag 3 > 2),
three train, the sample's lag is 2 (fresh). Versions [6, 7] (lags 4, 3): all beyond 2, dropped.

By `policy` (`[trainer.staleness]`), a sample whose lag exceeds `max_staleness`:

- `drop`: cannot happen after step 1 (its stale tokens were masked, or it was dropped).
- `downweight`: its token losses are multiplied by decay ** (lag - max_staleness).
- `is_correct`: its policy ratio is taken against the trainer's own current logprobs (the
  proximal policy, detached) and each token loss is multiplied by the truncated importance weight
  min(pi_train / pi_rollout, C), with C = `trainer.algorithm.correction_cap`: the decoupled PPO
  objective (Hilton et al. 2021, "Batch size-invariance for policy optimization",
  arXiv:2110.00641; as in AReaL, arXiv:2505.24298), so the clip region is anchored at the current
  policy and the off-policy gap is corrected by a bounded weight instead of being clipped away.

`hard_limit` > 0 masks any token with lag > hard_limit whatever the policy (step 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from prometheus_client import Counter

from flywheel._proto import sample_pb2
from flywheel.core.trainer_settings import StalenessSettings

STALE_TOKENS = Counter(
    "flywheel_trainer_stale_tokens_total",
    "Sampled tokens masked out of the loss because their weight version lags the trainer by "
    "more than the drop bound (max_staleness under policy drop, else hard_limit)",
)


@dataclass(frozen=True)
class TokenStaleness:
    """Per-token staleness of one sample (`StalenessPolicy.tokens`)."""

    floor: int
    """Oldest weight version still trained; sampled tokens of older versions are masked.
    -1 = none masked by the bound."""
    stale: int
    """Sampled tokens masked (older than `floor`)."""
    kept: int
    """Sampled tokens left."""
    lag: int
    """Lag of the oldest sampled token left (0 when none is left)."""
    oldest_lag: int
    """Lag of the oldest sampled token before masking (0 when none was sampled)."""


class Treatment(StrEnum):
    FRESH = "fresh"
    DROP = "drop"
    DOWNWEIGHT = "downweight"
    IS_CORRECT = "is_correct"


@dataclass(frozen=True)
class StalenessPolicy:
    """The treatment of lagging samples that `[trainer.staleness]` (validated there) selects."""

    settings: StalenessSettings = field(default_factory=StalenessSettings)

    @property
    def max_staleness(self) -> int:
        """Versions of lag still treated as fresh."""
        return self.settings.max_staleness

    @property
    def drop_bound(self) -> int | None:
        """Largest token lag still trained: `max_staleness` under policy drop, else
        `hard_limit` (None when 0: no token is too old)."""
        s = self.settings
        if s.policy == "drop":
            return s.max_staleness
        return s.hard_limit or None

    def tokens(
        self, versions: Sequence[int], loss_mask: Sequence[int], trainer_version: int
    ) -> TokenStaleness:
        """Which sampled tokens of a sample are too old to train (module docstring, step 1).

        Args:
            versions: the sample's `weight_versions` (one per token; < 0 counts as 0).
            loss_mask: its `loss_mask` (1 = sampled).
            trainer_version: the trainer's current weight version.

        Example: trainer 10, policy drop, max_staleness 2 -> floor 10 - 2 = 8; sampled versions
        [7, 7, 8, 9, 9] -> stale 2, kept 3, lag 10 - 8 = 2, oldest_lag 10 - 7 = 3.
        """
        sampled = [max(v, 0) for v, m in zip(versions, loss_mask, strict=True) if m]
        bound = self.drop_bound
        floor = -1 if bound is None else trainer_version - bound
        kept = [v for v in sampled if v >= floor]
        return TokenStaleness(
            floor=floor,
            stale=len(sampled) - len(kept),
            kept=len(kept),
            lag=trainer_version - min(kept) if kept else 0,
            oldest_lag=trainer_version - min(sampled) if sampled else 0,
        )

    def treat(self, lag: int) -> tuple[Treatment, float]:
        """(treatment, loss weight) of a sample `lag` versions behind.

        Example: max_staleness 2, decay 0.5: lag 2 -> (fresh, 1.0); lag 4 under downweight ->
        (downweight, 0.5 ** 2 = 0.25); lag 4 under is_correct -> (is_correct, 1.0).
        """
        s = self.settings
        if lag <= s.max_staleness:
            return Treatment.FRESH, 1.0
        if s.policy == "drop" or (s.hard_limit and lag > s.hard_limit):
            return Treatment.DROP, 0.0
        if s.policy == "downweight":
            return Treatment.DOWNWEIGHT, s.decay ** (lag - s.max_staleness)
        return Treatment.IS_CORRECT, 1.0


def mask_stale_tokens(sample: sample_pb2.Sample, floor: int) -> sample_pb2.Sample:
    """A copy of `sample` whose sampled tokens of weight versions below `floor` are out of the
    loss (loss_mask 0, rollout logprob 0, version -1, teacher mask and logprob 0: the Sample
    invariants for unsampled tokens); they stay in `token_ids` as context. `sample` itself when
    no token is below `floor` (a version < 0 counts as 0).

    Example: floor 8, loss_mask [0, 1, 1, 1], versions [-1, 7, 8, 9] -> loss_mask [0, 0, 1, 1],
    versions [-1, -1, 8, 9].
    """
    stale = [
        k
        for k, (v, m) in enumerate(zip(sample.weight_versions, sample.loss_mask, strict=True))
        if m and max(v, 0) < floor
    ]
    if not stale:
        return sample
    out = sample_pb2.Sample()
    out.CopyFrom(sample)
    teacher = len(out.teacher_mask) == len(out.token_ids)
    for k in stale:
        out.loss_mask[k] = 0
        out.rollout_logprobs[k] = 0.0
        out.weight_versions[k] = -1
        if teacher:
            out.teacher_mask[k] = 0
            if len(out.teacher_logprobs) == len(out.token_ids):
                out.teacher_logprobs[k] = 0.0
    return out
