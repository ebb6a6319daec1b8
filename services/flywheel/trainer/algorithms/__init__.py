"""The token-level RL library: pure advantage estimators, policy losses, aggregations,
train-inference corrections and regularizers.

Each part is chosen by name from a registry keyed by the matching `TrainerSettings` field:
`ADVANTAGES` (advantages.py), `POLICY_LOSSES` and `AGGREGATIONS` (losses.py), `CORRECTIONS`
(corrections.py), `KL_ESTIMATORS` and `REGULARIZERS` (regularizers.py). To add a method: add its
function (docstring with the formula, shapes, paper defaults and citation), one registry line,
one row in `flywheel/core/algorithm_catalog.py` (what `flywheel algorithms list` prints,
including the inputs it needs), and a worked-example test in `tests/unit/trainer/`.

Importing this package does not import torch; the registries load on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_REGISTRY_MODULES = {
    "ADVANTAGES": "advantages",
    "POLICY_LOSSES": "losses",
    "AGGREGATIONS": "losses",
    "CORRECTIONS": "corrections",
    "KL_ESTIMATORS": "regularizers",
    "REGULARIZERS": "regularizers",
    "TERMS": "regularizers",
    "WEIGHTS": "weights",
}

__all__ = sorted(_REGISTRY_MODULES)


def __getattr__(name: str) -> Any:
    if name not in _REGISTRY_MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_REGISTRY_MODULES[name]}")
    return getattr(module, name)
