"""Memory of the whole `flywheel demo` stack, per process role, optionally against an older commit.

    .venv/bin/python bench/demo_memory.py --steps 6
    .venv/bin/python bench/demo_memory.py --steps 6 --compare-rev HEAD~3

Runs `flywheel demo --new-stack` (the math GRPO task with the settings a user gets by default,
launched exactly as `bench/peers/learning_efficiency.py` launches it) while sampling the RSS of
every process of its tree every 0.5 s (psutil). Prints per role (demo driver, redis, engine,
gateway, reward, trainer, ...) the highest summed RSS of the role's processes and what the role
held when the whole tree peaked, then the peak of the sum. With `--compare-rev REV` the same
demo also runs from a git worktree of REV (its `services/` first on PYTHONPATH, same venv),
after this checkout's run, and both columns are printed side by side with the ratios this / REV.
`--checkpoint-every N` sets `trainer.checkpoint.every` for both runs, so a short run includes
the periodic checkpoint a default 30-step run writes at steps 10, 20 and 30.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "learning_efficiency", ROOT / "bench/peers/learning_efficiency.py"
)
assert _spec and _spec.loader
peers = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = peers  # dataclasses look their module up
_spec.loader.exec_module(peers)

role_of = peers.role_of


def measure(steps: int, seed: int, out: Path, services: Path | None) -> tuple[float, Any]:
    """Run the demo (from `services`, a checkout's `services/` folder; None = this one) and
    return (peak MiB of the whole tree, the per-role `RolePeaks`)."""
    env = dict(os.environ)
    if services is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(services), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    roles = peers.RolePeaks()
    _, peak = peers.run_sampled(
        peers.flywheel_demo_cmd(steps, seed, out), env=env, role_of=role_of, role_peaks=roles
    )
    return peak, roles


def table(columns: dict[str, tuple[float, Any]]) -> None:
    """Print one row per role: each column's peak and at-the-tree's-peak MiB, then the total;
    with two columns the ratios second / first."""
    names = list(columns)
    roles = sorted(
        {r for _, rp in columns.values() for r in rp.peak},
        key=lambda r: -max(rp.peak.get(r, 0.0) for _, rp in columns.values()),
    )
    head = f"{'role':24}" + "".join(f" {n + ' peak':>14} {n + ' @sum':>14}" for n in names)
    if len(names) == 2:
        head += f" {'peak ratio':>10}"
    print(head)

    def row(label: str, cells: list[tuple[float, float | None]]) -> None:
        text = f"{label:24}" + "".join(
            f" {p:>14.0f} {'-' if at is None else f'{at:.0f}':>14}" for p, at in cells
        )
        if len(cells) == 2:
            text += f" {peers.ratio(cells[1][0], cells[0][0]):>10}"
        print(text)

    for role in roles:
        row(
            role,
            [(rp.peak.get(role, 0.0), rp.at_peak.get(role, 0.0)) for _, rp in columns.values()],
        )
    row("sum of all processes", [(total, None) for total, _ in columns.values()])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6, help="demo steps (default 6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/demo-memory")
    parser.add_argument("--compare-rev", metavar="REV", help="also run REV (after) and compare")
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        help="trainer.checkpoint.every for both runs (default: the user's default, 10; a "
        "smaller value brings the periodic checkpoint into a short run)",
    )
    args = parser.parse_args()
    if args.steps < 1:
        raise SystemExit("demo_memory: --steps must be at least 1")
    out = ROOT / args.out
    if args.checkpoint_every:
        os.environ["FLYWHEEL_TRAINER__CHECKPOINT__EVERY"] = str(args.checkpoint_every)
    columns: dict[str, tuple[float, Any]] = {}
    columns["this"] = measure(args.steps, args.seed, out / "new", None)
    if args.compare_rev:
        with tempfile.TemporaryDirectory(prefix="flywheel-rev-") as tmp:
            tree = Path(tmp) / "tree"
            git = ["git", "-C", str(ROOT), "worktree"]
            subprocess.run([*git, "add", "--detach", str(tree), args.compare_rev], check=True)
            try:
                old = measure(args.steps, args.seed, out / "old", tree / "services")
            finally:
                subprocess.run([*git, "remove", "--force", str(tree)], check=True)
        columns = {args.compare_rev: old, "this": columns["this"]}
    print(f"peak RSS MiB of `flywheel demo --new-stack --steps {args.steps}` per process role")
    table(columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
