"""Which deployment `flywheel status`, `flywheel engines` and `flywheel keys` act on.

A `flywheel up` running from the state dir (`<state_dir>/stack.json`, its process alive and its
gateway answering) is the deployment: its actual ports and Redis. Otherwise the commands reach
the configured addresses, which may be another stack's (one started from another folder on the
default ports, a compose stack, a port-forwarded cluster). Then:

- read-only commands (`status`, `engines list`, `keys list`) say so on stderr, naming the
  addresses and where a `flywheel demo` stack runs from (`<out>/stack`), and `status --json`
  carries `"source": "configured addresses"`;
- commands that change the deployment (`engines add|remove`, `keys create|mark|revoke|reopen`)
  refuse, unless the deployment was named explicitly: `--config FILE` (or `FLYWHEEL_CONFIG`),
  or a Redis address (`redis.url`, e.g. `FLYWHEEL_REDIS__URL`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from flywheel.core.settings import FlywheelSettings, mask_secrets

RUNNING_STACK = "flywheel up"
"""`Target.source` of the `flywheel up` running from the state dir."""
CONFIGURED = "configured addresses"
"""`Target.source` when no `flywheel up` runs from the state dir."""
DEMO_HINT = (
    "A stack that `flywheel demo` started runs from its `--out` folder's `stack/`: for "
    "`make demo`, prefix the command with FLYWHEEL_STATE_DIR=runs/demo/stack."
)
"""Where to look instead: the demo's own stack is not in the default state dir."""


@dataclass
class Target:
    """The deployment a command acts on.

    Attributes:
        state: the running stack's addresses (`stack.json`), or None.
        redis_url: the Redis the command reads and writes.
        source: `RUNNING_STACK` or `CONFIGURED`.
        explicit: the deployment was named (`--config`, `FLYWHEEL_CONFIG`, `redis.url`).
        state_dir: the state dir looked in.
    """

    state: dict[str, str] | None
    redis_url: str
    source: str
    explicit: bool
    state_dir: str

    def note(self) -> str:
        """The stderr line for a read of the configured addresses ("" for a running stack)."""
        if self.state is not None:
            return ""
        named = "as configured" if self.explicit else "at the default addresses"
        return (
            f"flywheel: no `flywheel up` is running from {self.state_dir}; reading the deployment "
            f"{named} (Redis {mask_secrets(self.redis_url)}), which may be another stack's. "
            + DEMO_HINT
        )

    def refuse_change(self, what: str) -> None:
        """Exit with a message when `what` (e.g. "create a key") would change a deployment this
        folder did not start and that was not named explicitly.

        Raises:
            SystemExit: no running stack here and no `--config`/`redis.url` given (exit 1).
        """
        if self.state is not None or self.explicit:
            return
        sys.exit(
            f"flywheel: no `flywheel up` is running from {self.state_dir}, so this would "
            f"{what} in the deployment at the default addresses (Redis "
            f"{mask_secrets(self.redis_url)}), which may be another stack's. Start this folder's "
            "stack with `flywheel up`, or name the deployment: pass --config FILE, or set "
            f"FLYWHEEL_REDIS__URL={mask_secrets(self.redis_url)} to act on that one. " + DEMO_HINT
        )


def resolve(settings: FlywheelSettings, config_file: str | None) -> Target:
    """The deployment the command's settings name (see the module docstring)."""
    from flywheel.ops.stack import running_stack  # noqa: PLC0415

    state = running_stack(settings.state_dir)
    explicit = bool(config_file or os.environ.get("FLYWHEEL_CONFIG") or settings.redis.url)
    redis_url = settings.redis.url or (state or {}).get("redis_url") or settings.redis_url()
    return Target(
        state=state,
        redis_url=redis_url,
        source=RUNNING_STACK if state is not None else CONFIGURED,
        explicit=explicit,
        state_dir=settings.state_dir,
    )
