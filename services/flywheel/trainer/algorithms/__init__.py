"""The token-level RL library: pure advantage estimators, policy losses and aggregations.

Each part is chosen by name from a registry (`ADVANTAGES`, `POLICY_LOSSES`, `AGGREGATIONS`) keyed
by the matching `TrainerSettings` field. To add a method: add its function (docstring with the
formula, shapes and paper) and one registry line, plus a worked-example test in
`tests/unit/trainer/`. The design notes' algorithm catalog lists what this grows towards.
"""

from flywheel.trainer.algorithms.advantages import ADVANTAGES
from flywheel.trainer.algorithms.losses import AGGREGATIONS, POLICY_LOSSES

__all__ = ["ADVANTAGES", "AGGREGATIONS", "POLICY_LOSSES"]
