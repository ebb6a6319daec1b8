"""What happens to a sample whose tokens lag behind the trainer's weights (torch-free).

lag = trainer version - the oldest weight version among the sample's sampled tokens (see
`samples.sample_lag`; staleness is measured from dispatch, BUG-19). Within `max_staleness` a
sample is fresh. Beyond it, by `policy` (`[trainer.staleness]`):

- `drop`: the sample is dropped as `stale` (acked, counted, logged).
- `downweight`: its token losses are multiplied by decay ** (lag - max_staleness).
- `is_correct`: its policy ratio is taken against the trainer's own current logprobs (the
  proximal policy, detached) and each token loss is multiplied by the truncated importance weight
  min(pi_train / pi_rollout, C), with C = `trainer.algorithm.correction_cap`: the decoupled PPO
  objective (Hilton et al. 2021, "Batch size-invariance for policy optimization",
  arXiv:2110.00641; as in AReaL, arXiv:2505.24298), so the clip region is anchored at the current
  policy and the off-policy gap is corrected by a bounded weight instead of being clipped away.

`hard_limit` > 0 drops any sample with lag > hard_limit whatever the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from flywheel.core.trainer_settings import StalenessSettings


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
