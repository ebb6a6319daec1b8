"""Per-part hyperparameters: each part owns a frozen dataclass of paper defaults, and the trainer
config overrides fields by name (`[trainer.algorithm.params.<part>]` in the TOML file).

    resolve(HighEntropyParams, {"top_frac": 0.1}, "high_entropy_only")

Every registered part has such a dataclass (`NoParams` for a part without any; pipeline.py
`param_classes`). Torch-free. Unknown names or values of the wrong type raise ValueError naming
the part and the fields it knows (or saying it takes none), so a misspelled setting fails at
start-up, not mid-run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

P = TypeVar("P")


@dataclass(frozen=True)
class NoParams:
    """The parameters of a part that takes none: any `[trainer.algorithm.params.<part>]` entry
    for it is refused at start."""


def resolve(cls: type[P], overrides: Mapping[str, Any] | None, part: str) -> P:
    """`cls()` with the fields in `overrides` replaced (ints accepted for float fields).

    Raises:
        ValueError: an override names no field of `cls`, or its type does not match.
    """
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if overrides and not known:
        raise ValueError(
            f"algorithm part {part!r} takes no parameters; remove "
            f"[trainer.algorithm.params.{part}] (got {sorted(overrides)})"
        )
    values: dict[str, Any] = {}
    for name, value in (overrides or {}).items():
        if name not in known:
            raise ValueError(
                f"unknown parameter {name!r} of algorithm part {part!r}; known: {sorted(known)}"
            )
        default = getattr(cls(), name)
        if (
            isinstance(default, bool) != isinstance(value, bool)
            or (isinstance(default, (int, float)) and not isinstance(value, (int, float)))
            or (isinstance(default, str) and not isinstance(value, str))
        ):
            raise ValueError(
                f"parameter {name!r} of {part!r} must be like {default!r}, got {value!r}"
            )
        values[name] = float(value) if isinstance(default, float) else value
    return cls(**values)
