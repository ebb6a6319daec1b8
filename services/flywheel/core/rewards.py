"""User-defined rewards: the `@reward` decorator, its registry and the plugin loader.

A plugin is a Python module of the user's, named in `reward.plugins`; the reward service imports
it at start, and each function it decorates becomes a verifier selectable by name (a task's
`verifier`, or `reward.default_verifier`), exactly like the built-in ones, and may also run on
every Sample as a component of its own name (`reward.components`, weighted by
`reward.weights[name]`):

    from flywheel.core.rewards import reward

    @reward("short_exact", inputs=("turn", "task"), range=(0.0, 1.0))
    def short_exact(turn: str, task: dict) -> float:
        return 1.0 if turn.strip() == str(task["answer"]) else 0.0

The function is called with one keyword argument per declared input, taken from the Sample:

- "turn": str, the text of the Sample's last assistant message ("" if none);
- "task": dict, the Sample's task metadata (`task_json`; {} when absent);
- "next_state": str | None, the text of the message that followed the turn (`next_state`, a
  live-mode Sample's user or tool reply); None for a Sample without one (an episode);
- "messages": list[dict], every message of the Sample as {"role": str, "content": text}.

It returns one number inside the declared `range` (both ends included). An exception, a value
that is not a number, NaN/inf or a value outside the range leaves the Sample *unscored*
(`has_reward = false` and an `error` naming the reward and the reason), counted by
`flywheel_reward_plugin_unscored_total{reward, reason}` and logged; it is never scored as 0.
The function runs in a worker thread, possibly on several Samples at once (up to
`reward.max_in_flight`), so it must be thread-safe; a call past `reward.sample_timeout_s` fails
the scoring attempt like any scorer (retried, then dead-lettered).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from flywheel.core.errors import ConfigurationError

INPUTS = ("turn", "task", "next_state", "messages")
"""Names a reward may declare in `inputs` (see the module docstring for each one's value)."""

BUILTIN_VERIFIERS = (
    "last_integer",
    "exact",
    "math",
    "numeric",
    "regex",
    "json_schema",
    "code_tests",
)
"""Names of the verifiers the reward service ships (flywheel.reward.verifiers); a plugin reward
may not take one of these names, nor "none" (= no verifier)."""

VERIFIER_NAMES = (*BUILTIN_VERIFIERS, "none")
"""What `reward.default_verifier` may name without a plugin."""

COMPONENTS = ("verifier", "outcome", "judge", "step", "rubric")
"""Names of the reward service's own components (keys of `Sample.rewards`)."""

RESERVED = (*VERIFIER_NAMES, *COMPONENTS)


@dataclass(frozen=True)
class RewardSpec:
    """One registered reward function.

    Attributes:
        name: the name a task's `verifier` or `reward.default_verifier` selects it by.
        fn: the function; called as `fn(**{input: value for input in inputs})` -> float.
        inputs: the Sample fields it reads, a non-empty subset of `INPUTS`, in declared order.
        low, high: the closed range its value must fall in (low < high, both finite).
        module: the module that defined it (for messages).
    """

    name: str
    fn: Callable[..., Any]
    inputs: tuple[str, ...]
    low: float
    high: float
    module: str


class RewardRegistry:
    """Name -> RewardSpec. One process-wide instance, `REGISTRY`, is what `@reward` fills by
    default and what the reward service reads; tests may make their own."""

    def __init__(self) -> None:
        self._specs: dict[str, RewardSpec] = {}

    def add(self, spec: RewardSpec) -> None:
        """Register `spec`.

        Raises:
            ConfigurationError: the name is already registered by another function, or is a
                built-in verifier's name (or "none").
        """
        if spec.name in RESERVED:
            raise ConfigurationError(
                f"reward {spec.name!r} ({spec.module}.{spec.fn.__name__}) takes the name of a "
                f"built-in verifier or component; choose another name (taken: "
                f"{', '.join(RESERVED)})"
            )
        old = self._specs.get(spec.name)
        if old is not None and (old.module, old.fn.__qualname__) != (
            spec.module,
            spec.fn.__qualname__,
        ):
            raise ConfigurationError(
                f"reward {spec.name!r} is registered twice: by {old.module}.{old.fn.__qualname__} "
                f"and by {spec.module}.{spec.fn.__qualname__}; rename one of them"
            )
        self._specs[spec.name] = spec  # the same function re-imported replaces itself

    def get(self, name: str) -> RewardSpec | None:
        """The spec registered as `name`, or None."""
        return self._specs.get(name)

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._specs)

    def __contains__(self, name: object) -> bool:
        return name in self._specs


REGISTRY = RewardRegistry()
"""The registry `@reward` fills unless given another one."""


def reward(
    name: str,
    *,
    inputs: Iterable[str] = ("turn", "task"),
    range: tuple[float, float] = (0.0, 1.0),  # noqa: A002  (the natural word for users)
    registry: RewardRegistry | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering a reward function under `name`; returns the function unchanged.

    Args:
        name: the selection name; non-empty, no "/" (kept for segment rewards), not a built-in
            verifier's name.
        inputs: the Sample fields the function reads, each one of `INPUTS`; the function must
            accept every one as a keyword argument.
        range: (low, high), finite numbers with low < high; values outside are unscored.
        registry: where to register (default: the process-wide `REGISTRY`).

    Raises:
        ConfigurationError: at decoration (so at plugin import): an empty or reserved name, an
            unknown or repeated input, no inputs, a bad range, a function whose signature cannot
            take the declared inputs, or a name registered twice.
    """
    if not isinstance(name, str) or not name.strip() or "/" in name:
        raise ConfigurationError(
            f"reward name must be a non-empty string without '/', got {name!r}"
        )
    declared = (inputs,) if isinstance(inputs, str) else tuple(inputs)
    unknown = [i for i in declared if i not in INPUTS]
    if unknown or not declared or len(set(declared)) != len(declared):
        raise ConfigurationError(
            f"reward {name!r}: inputs must be distinct names from {list(INPUTS)}, at least one; "
            f"got {list(declared)}" + (f" (unknown: {unknown})" if unknown else "")
        )
    try:
        low, high = (float(x) for x in range)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"reward {name!r}: range must be two numbers (low, high), got {range!r}"
        ) from exc
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ConfigurationError(
            f"reward {name!r}: range must be finite with low < high, got {range!r}"
        )

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise ConfigurationError(f"@reward({name!r}) must decorate a function, got {fn!r}")
        try:
            inspect.signature(fn).bind(**dict.fromkeys(declared))
        except TypeError as exc:
            raise ConfigurationError(
                f"reward {name!r}: {fn.__qualname__} must accept the declared inputs "
                f"{list(declared)} as keyword arguments ({exc})"
            ) from exc
        spec = RewardSpec(name, fn, declared, low, high, getattr(fn, "__module__", "?"))
        (REGISTRY if registry is None else registry).add(spec)
        return fn

    return register


def load_plugins(modules: Iterable[str]) -> list[str]:
    """Import each plugin module (their `@reward` decorators fill `REGISTRY`).

    Returns:
        The names registered, sorted.

    Raises:
        ConfigurationError: a module cannot be imported (not found, or its code raised), or a
            registration in it was refused; the message names the module and the cause.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ConfigurationError as exc:
            raise ConfigurationError(f"reward plugin {module!r}: {exc}") from exc
        except ModuleNotFoundError as exc:
            raise ConfigurationError(
                f"reward plugin {module!r} cannot be imported: {exc}. Install the package or "
                "put its directory on PYTHONPATH, or remove it from reward.plugins"
            ) from exc
        except Exception as exc:  # the plugin's own code failed at import
            raise ConfigurationError(
                f"reward plugin {module!r} failed on import: {type(exc).__name__}: {exc}"
            ) from exc
    return REGISTRY.names()
