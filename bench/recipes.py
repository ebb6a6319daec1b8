"""Compare training recipes on the demo task: same seed, same budget, one stack per recipe.

    .venv/bin/python bench/recipes.py recipes/grpo.toml recipes/dapo.toml recipes/gspo.toml \
        --steps 8 --out runs/recipes

For each recipe (a TOML config file, `flywheel demo --config` format) a fresh local stack
starts (on its own port range, `--port-base`, so other stacks on the machine cannot collide),
the demo runs `--steps` trainer steps of `--problems-per-step` x `--group-size` rollouts with
`--seed`, and held-out greedy accuracy is measured after training. Held-out accuracy before
training is the same for every recipe (same initial weights, greedy decoding), so it is
measured once, on the first recipe's stack, and reused (`--eval-before-each` measures it for
every recipe). Writes
`OUT/<recipe>/` (the demo's files), `OUT/reward_curves.png` (every recipe's per-step mean
reward on one plot) and `OUT/summary.json`, and prints a table of final held-out accuracy and
wall-clock per recipe. Recipes run one after another on the same machine; wall-clock includes
stack start-up and both evaluations.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from flywheel.core.settings import load_settings
from flywheel.ops.demo.runner import DemoConfig, DemoRunner
from flywheel.ops.demo.tasks import split
from flywheel.ops.stack import Stack


class _Runner(DemoRunner):
    """The demo runner, with the before-training evaluation taken from `eval_before` when
    given (its first `evaluate` call), and evaluation on the first `eval_problems` held-out
    problems (0 = all 30)."""

    def __init__(
        self, *args, eval_before: float | None = None, eval_problems: int = 0, **kwargs
    ) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self._eval_before = eval_before
        self._eval_problems = eval_problems

    def evaluate(self) -> float:
        if self._eval_before is not None:
            value, self._eval_before = self._eval_before, None
            return value
        _, held_out = split()
        held_out = held_out[: self._eval_problems or len(held_out)]
        rewards = list(
            self.pool.map(lambda p: self.episode(p, "", evaluation=True, temperature=0.0), held_out)
        )
        return sum(rewards) / len(rewards)


def _ports(settings, base: int) -> None:  # noqa: ANN001
    settings.redis.port = base
    settings.engine.port = base + 1
    settings.gateway.port = base + 2
    settings.reward.port = base + 3
    settings.reward.metrics_port = 0
    settings.teacher.port = base + 4
    settings.teacher.metrics_port = 0
    settings.teacher.engine_port = base + 5
    settings.trainer.port = base + 6


def _patient(settings) -> None:  # noqa: ANN001
    """Long limits for a shared, loaded CPU, where one batched decode can take minutes: engine
    calls, and the trainer's wait for a complete group (its default of 120 s would train on
    partial groups when rollouts trickle in, which changes what is compared)."""
    settings.gateway.request_timeout_s = 1800.0
    settings.trainer.batch.group_wait_s = 3600.0


def run_recipe(
    recipe: Path,
    out: Path,
    cfg: DemoConfig,
    port_base: int,
    eval_before: float | None = None,
    eval_problems: int = 0,
) -> dict[str, float]:
    """One recipe on a fresh stack; returns the demo summary plus `wall_s`."""
    started = time.monotonic()
    settings = load_settings(recipe)
    _ports(settings, port_base)
    _patient(settings)
    stack_dir = out / "stack"
    shutil.rmtree(stack_dir, ignore_errors=True)
    settings.state_dir = str(stack_dir)
    settings.trainer.checkpoint.dir = str(stack_dir / "checkpoints")
    settings.trainer.logging.metrics_path = str(out / "trainer_metrics.jsonl")
    settings.trainer.batch.groups_per_step = cfg.problems_per_step
    settings.trainer.batch.group_size = cfg.group_size
    settings.trainer.seed = cfg.seed
    with Stack(settings, config_file=str(recipe)) as stack:
        urls = {s.name: s.url for s in stack.services}
        runner = _Runner(
            urls["gateway"],
            urls["engine"],
            cfg,
            out,
            eval_before=eval_before,
            eval_problems=eval_problems,
        )
        summary = runner.run(started_at=started)
    shutil.rmtree(stack_dir / "checkpoints", ignore_errors=True)
    return summary | {"wall_s": time.monotonic() - started}


def read_curve(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["reward_mean"] for row in rows]


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rewards in curves.items():
        ax.plot(range(1, len(rewards) + 1), rewards, marker="o", label=name)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean training reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(results: dict[str, dict[str, float]]) -> str:
    lines = [
        f"{'recipe':<22} {'eval_before':>11} {'eval_after':>10} {'reward_first':>12} "
        f"{'reward_last':>11} {'wall_min':>8}"
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<22} {r['eval_before']:>11.3f} {r['eval_after']:>10.3f} "
            f"{r['reward_first']:>12.3f} {r['reward_last']:>11.3f} "
            f"{r['wall_s'] / 60:>8.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("recipes", nargs="+", type=Path, help="recipe TOML files (3 or more)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--problems-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/recipes"))
    parser.add_argument(
        "--port-base",
        type=int,
        default=41000,
        help="first port of the stacks (each recipe uses 7 from base + 100 i)",
    )
    parser.add_argument(
        "--eval-problems",
        type=int,
        default=0,
        help="evaluate on the first N of the 30 held-out problems (0 = all)",
    )
    parser.add_argument(
        "--eval-before",
        type=float,
        default=None,
        help="reuse this held-out accuracy before training (measured earlier on "
        "the same problems and initial weights) instead of measuring it",
    )
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="run the recipes at the same time, one process each (same load "
        "for all; wall-clock is then comparable only among them)",
    )
    parser.add_argument(
        "--eval-before-each",
        action="store_true",
        help="measure held-out accuracy before training for every recipe",
    )
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so each recipe's `with Stack(...)` stops its services
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    for recipe in args.recipes:
        load_settings(recipe)  # fail before any stack starts
    cfg = DemoConfig(
        steps=args.steps,
        problems_per_step=args.problems_per_step,
        group_size=args.group_size,
        seed=args.seed,
        step_timeout_s=1800.0,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, float]] = {}
    curves: dict[str, list[float]] = {}
    eval_before: float | None = args.eval_before
    summaries: dict[str, dict[str, float]] = {}
    if args.parallel:
        with ProcessPoolExecutor(max_workers=len(args.recipes)) as pool:
            futures = {
                recipe.stem: pool.submit(
                    run_recipe,
                    recipe,
                    args.out / recipe.stem,
                    cfg,
                    args.port_base + 100 * i,
                    eval_before,
                    args.eval_problems,
                )
                for i, recipe in enumerate(args.recipes)
            }
            print(
                f"== {len(futures)} recipes in parallel: {args.steps} steps x "
                f"{args.problems_per_step} problems x {args.group_size} samples, seed "
                f"{args.seed}",
                flush=True,
            )
            summaries = {name: future.result() for name, future in futures.items()}
    for i, recipe in enumerate(args.recipes):
        name = recipe.stem
        if name not in summaries:
            print(
                f"== {name} ({recipe}): {args.steps} steps x {args.problems_per_step} "
                f"problems x {args.group_size} samples, seed {args.seed}",
                flush=True,
            )
            summaries[name] = run_recipe(
                recipe,
                args.out / name,
                cfg,
                args.port_base + 100 * i,
                None if args.eval_before_each else eval_before,
                args.eval_problems,
            )
            if eval_before is None and not args.eval_before_each:
                eval_before = summaries[name]["eval_before"]
        summary = summaries[name]
        curves[name] = read_curve(args.out / name)
        half = max(len(curves[name]) // 2, 1)
        results[name] = summary | {
            "reward_first": sum(curves[name][:half]) / half,
            "reward_last": sum(curves[name][-half:]) / half,
        }
        (args.out / "summary.json").write_text(
            json.dumps(
                {
                    "budget": vars(args)
                    | {"recipes": [str(r) for r in args.recipes], "out": str(args.out)},
                    "results": results,
                },
                indent=2,
                default=str,
            )
        )
        plot(curves, args.out / "reward_curves.png")
    print(
        f"budget: {args.steps} steps x {args.problems_per_step} problems x {args.group_size} "
        f"samples per recipe, seed {args.seed}; reward_first / reward_last = mean training "
        f"reward over the first / last {max(args.steps // 2, 1)} steps; eval = greedy "
        f"accuracy on {args.eval_problems or 30} of the 30 held-out problems"
        + ("" if args.eval_before_each else " (eval_before measured once, shared)")
        + (" in parallel" if args.parallel else "")
    )
    print(table(results))
    print(f"wrote {args.out / 'reward_curves.png'} and {args.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
