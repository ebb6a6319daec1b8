"""What happens to a sample whose tokens lag behind the trainer's weights (torch-free).

lag = trainer version - the oldest weight version among the sample's sampled tokens (see
`samples.sample_lag`; staleness is measured from dispatch, BUG-19). Within `max_staleness` a
sample is fresh. Beyond it, by `mode`:

- `drop`: the sample is dropped as `stale` (acked, counted, logged).
- `downweight`: its token losses are multiplied by decay ** (lag - max_staleness).
- `is_correct`: its policy ratio is taken against the trainer's own current logprobs (the
  proximal policy, detached) and each token loss is multiplied by the truncated importance weight
  min(pi_train / pi_rollout, C), with C = `correction_cap`: the decoupled PPO objective
  (Hilton et al. 2021, "Batch size-invariance for policy optimization", arXiv:2110.00641; as in
  AReaL, arXiv:2505.24298), so the clip region is anchored at the current policy and the
  off-policy gap is corrected by a bounded weight instead of being clipped away.

`hard_limit` > 0 drops any sample with lag > hard_limit whatever the mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Treatment(StrEnum):
    FRESH = "fresh"
    DROP = "drop"
    DOWNWEIGHT = "downweight"
    IS_CORRECT = "is_correct"


@dataclass(frozen=True)
class StalenessPolicy:
    max_staleness: int = 4
    """Versions of lag still treated as fresh."""
    mode: str = "drop"
    """drop | downweight | is_correct, for lag > max_staleness."""
    decay: float = 0.5
    """downweight: weight = decay ** (lag - max_staleness), in (0, 1]."""
    hard_limit: int = 0
    """Lag above which a sample is always dropped; 0 = no limit."""

    def __post_init__(self) -> None:
        if self.mode not in ("drop", "downweight", "is_correct"):
            raise ValueError(f"unknown staleness mode {self.mode!r}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")

    def treat(self, lag: int) -> tuple[Treatment, float]:
        """(treatment, loss weight) of a sample `lag` versions behind.

        Example: max_staleness 2, decay 0.5: lag 2 -> (fresh, 1.0); lag 4 under downweight ->
        (downweight, 0.5 ** 2 = 0.25); lag 4 under is_correct -> (is_correct, 1.0).
        """
        if lag <= self.max_staleness:
            return Treatment.FRESH, 1.0
        if self.mode == "drop" or (self.hard_limit and lag > self.hard_limit):
            return Treatment.DROP, 0.0
        if self.mode == "downweight":
            return Treatment.DOWNWEIGHT, self.decay ** (lag - self.max_staleness)
        return Treatment.IS_CORRECT, 1.0
