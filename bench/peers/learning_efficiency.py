"""Learning efficiency side by side: `flywheel demo` vs TRL's GRPOTrainer (bench/peers/trl_grpo.py)
on the same CPU, model, task, group size, lr and number of rollouts, one after the other, for
each of `--seeds` seeds.

    bench/peers/setup_trl.sh
    .venv/bin/python bench/peers/learning_efficiency.py --steps 30 --seeds 3

Per seed s: `flywheel demo --new-stack --steps N --seed s` (the settings a user gets by default),
then the TRL script with the same settings and seed; both use 4 problems x 8 samples per step =
32 rollouts per optimizer step, N steps. While each side runs, the RSS of its whole process tree
(the demo's stack: Redis, engine, gateway, reward, trainer) is sampled every 0.5 s.

Printed per seed and as the median over seeds, for each side:
- time to TRL's reward: wall-clock seconds from the side's launch until the first step whose
  5-step moving average of the mean reward reaches TRL's final 5-step mean (the moving average of
  step k is the mean of steps max(1, k-4)..k; a step's reward counts when its rollouts were
  scored: the demo's rollout end, the TRL reward function's call). "-" when never reached.
- peak RSS (MiB) of all processes of the side;
- wall-clock minutes, reward first5/last5 and held-out accuracy before/after;
and the ratios Flywheel / TRL. `<out>/reward_curves.png` has both sides' per-step reward curves
(by step and by wall-clock minute, every seed); `<out>/results.json` keeps every number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("FLYWHEEL_PEERS_DIR", Path.home() / ".cache/flywheel/peers"))
WINDOW = 5
"""Steps of the moving average that decides when a reward is reached."""


def run_sampled(cmd: list[str], interval_s: float = 0.5) -> tuple[float, float]:
    """Run `cmd` to the end while sampling the summed RSS of its process tree.

    Returns:
        (launch time in unix seconds, peak RSS in MiB of the process and all its descendants).

    Raises:
        subprocess.CalledProcessError: the command failed.
    """
    launched = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        root = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for p in tree:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    total += p.memory_info().rss
            peak = max(peak, total)
            done.wait(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = proc.wait()
    done.set()
    sampler.join()
    if code != 0:
        raise subprocess.CalledProcessError(code, cmd)
    return launched, peak / 2**20


def moving_average(rewards: list[float], window: int = WINDOW) -> list[float]:
    """Mean of steps max(1, k - window + 1)..k for every step k (shorter at the start).

    Example: [0, 1, 1] with window 2 -> [0, 0.5, 1]."""
    return [
        sum(rewards[max(0, k - window + 1) : k + 1]) / (k + 1 - max(0, k - window + 1))
        for k in range(len(rewards))
    ]


def time_to_reach(
    rewards: list[float], times: list[float], launched: float, target: float
) -> float | None:
    """Seconds from `launched` to the first step whose moving average reaches `target`; None
    when no step does.

    Example: rewards [0.2, 0.6, 0.9], times [10, 20, 30] (unix s), launched 0, target 0.5:
    moving averages 0.2, 0.4, 0.567 -> step 3 -> 30.0 s."""
    for average, at in zip(moving_average(rewards), times, strict=False):
        if average >= target - 1e-12:
            return at - launched
    return None


def reward_at(rewards: list[float], seconds: list[float], at_s: float) -> float | None:
    """The moving-average reward of the last step scored by `at_s` seconds after launch; None
    when no step was scored by then.

    Example: rewards [0.2, 0.6, 0.9] scored at 10, 20, 30 s; at 25 s the last scored step is 2,
    whose average is (0.2 + 0.6) / 2 = 0.4; at 5 s: None."""
    scored = [i for i, t in enumerate(seconds) if t <= at_s]
    return moving_average(rewards)[scored[-1]] if scored else None


def flywheel_curve(folder: Path) -> tuple[list[float], list[float]]:
    """(mean reward of each step, unix time its rollouts ended) of a demo run, from
    metrics.jsonl and demo_timeline.jsonl."""
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    ends = {}
    for line in (folder / "demo_timeline.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("stage") == "rollout":
            ends[int(event["step"])] = float(event["end"])
    return [float(r["reward_mean"]) for r in rows], [ends[int(r["step"])] for r in rows]


def run_seed(seed: int, steps: int, out: Path, trl_python: Path) -> dict[str, Any]:
    """Both sides with `seed`; their curves, times to TRL's final reward and peak RSS."""
    fw_dir, trl_dir = out / f"seed{seed}" / "flywheel", out / f"seed{seed}" / "trl"
    common = ["--steps", str(steps), "--seed", str(seed)]
    fw_launch, fw_rss = run_sampled(
        [sys.executable, "-m", "flywheel.ops.cli", "demo", "--new-stack", *common]
        + ["--out", str(fw_dir)]
    )
    trl_launch, trl_rss = run_sampled(
        [str(trl_python), str(ROOT / "bench/peers/trl_grpo.py"), *common, "--out", str(trl_dir)]
    )
    fw_rewards, fw_times = flywheel_curve(fw_dir)
    trl = json.loads((trl_dir / "summary.json").read_text())
    trl_rewards, trl_times = trl["rewards"], trl["reward_times"][: len(trl["rewards"])]
    target = moving_average(trl_rewards)[-1]
    sides = {}
    for name, launched, rewards, times, rss, folder in (
        ("flywheel", fw_launch, fw_rewards, fw_times, fw_rss, fw_dir),
        ("trl", trl_launch, trl_rewards, trl_times, trl_rss, trl_dir),
    ):
        summary = json.loads((folder / "summary.json").read_text())
        sides[name] = {
            "rewards": rewards,
            "seconds": [t - launched for t in times],
            "time_to_target_s": time_to_reach(rewards, times, launched, target),
            "peak_rss_mib": rss,
            **{k: summary[k] for k in ("minutes", "first5", "last5", "eval_before", "eval_after")},
        }
    return {"seed": seed, "target": target, **sides}


def ratio(a: float | None, b: float | None) -> str:
    return f"x{a / b:.2f}" if a is not None and b else "-"


def seconds(value: float | None) -> str:
    return f"{value:.0f}" if value is not None else "-"


def median(values: list[float | None]) -> float | None:
    """Median of the seeds' values; None (not reached counts as infinitely late) when more
    than half are None."""
    ranked = sorted(v if v is not None else float("inf") for v in values)
    middle = statistics.median(ranked)
    return None if middle == float("inf") else middle


def report(results: list[dict[str, Any]]) -> None:
    head = (
        f"{'seed':>4} {'side':9} {'to TRL reward s':>15} {'peak RSS MiB':>12} {'minutes':>8} "
        f"{'first5':>6} {'last5':>6} {'eval_bef':>8} {'eval_aft':>8}"
    )
    print(head)
    for r in results:
        for side in ("flywheel", "trl"):
            s = r[side]
            print(
                f"{r['seed']:>4} {side:9} {seconds(s['time_to_target_s']):>15} "
                f"{s['peak_rss_mib']:>12.0f} {s['minutes']:>8.1f} {s['first5']:>6.3f} "
                f"{s['last5']:>6.3f} {s['eval_before']:>8.3f} {s['eval_after']:>8.3f}"
            )
        fw, trl = r["flywheel"], r["trl"]
        print(
            f"{r['seed']:>4} target (TRL's final {WINDOW}-step reward) {r['target']:.3f}; "
            f"flywheel/trl time {ratio(fw['time_to_target_s'], trl['time_to_target_s'])}, "
            f"peak RSS {ratio(fw['peak_rss_mib'], trl['peak_rss_mib'])}"
        )
    print(
        f"equal wall-clock: each side's {WINDOW}-step reward when the side that finished first "
        "finished"
    )
    for r in results:
        fw, trl = r["flywheel"], r["trl"]
        at = min(fw["seconds"][-1], trl["seconds"][-1])
        cells = [
            reward_at(r[side]["rewards"], r[side]["seconds"], at) for side in ("flywheel", "trl")
        ]
        text = [f"{c:.3f}" if c is not None else "-" for c in cells]
        print(f"{r['seed']:>4} at {at:.0f} s: flywheel {text[0]}, trl {text[1]}")
    med = {
        side: {
            key: median([r[side][key] for r in results])
            for key in ("time_to_target_s", "peak_rss_mib", "minutes")
        }
        for side in ("flywheel", "trl")
    }
    for side in ("flywheel", "trl"):
        m = med[side]
        print(
            f"median {side:9} to TRL reward {seconds(m['time_to_target_s'])} s, peak RSS "
            f"{m['peak_rss_mib']:.0f} MiB, {m['minutes']:.1f} min"
        )
    print(
        f"median flywheel/trl: time to TRL's reward "
        f"{ratio(med['flywheel']['time_to_target_s'], med['trl']['time_to_target_s'])}, peak RSS "
        f"{ratio(med['flywheel']['peak_rss_mib'], med['trl']['peak_rss_mib'])}, wall-clock "
        f"{ratio(med['flywheel']['minutes'], med['trl']['minutes'])} ({len(results)} seeds)"
    )


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Per-step mean reward of both sides, every seed: by step and by wall-clock minute."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"flywheel": "tab:blue", "trl": "tab:orange"}
    for r in results:
        for side, color in colors.items():
            s = r[side]
            steps = list(range(1, len(s["rewards"]) + 1))
            label = f"{side} seed {r['seed']}"
            by_step.plot(steps, s["rewards"], color=color, alpha=0.35, marker=".", label=label)
            by_step.plot(steps, moving_average(s["rewards"]), color=color, linewidth=2)
            minutes = [t / 60 for t in s["seconds"]]
            by_time.plot(minutes, s["rewards"], color=color, alpha=0.35, marker=".")
            by_time.plot(minutes, moving_average(s["rewards"]), color=color, linewidth=2)
        by_time.axhline(r["target"], color="gray", linestyle=":", linewidth=1)
    by_step.set(xlabel="step", ylabel="mean reward (thick: 5-step moving average)")
    by_time.set(xlabel="wall-clock minutes since launch", ylabel="mean reward")
    by_step.legend(fontsize=7)
    fig.suptitle("Flywheel demo vs TRL GRPOTrainer: same model, task and rollouts per step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    parser.add_argument("--out", default="runs/peers")
    parser.add_argument(
        "--report", metavar="RESULTS_JSON", help="print the report of an earlier run and stop"
    )
    args = parser.parse_args()
    if args.report:
        report(json.loads(Path(args.report).read_text()))
        return 0
    if args.steps < 1 or args.seeds < 1:
        raise SystemExit("learning_efficiency: --steps and --seeds must be at least 1")
    out = ROOT / args.out
    trl_python = PEERS / "trl" / "bin" / "python"
    if not trl_python.exists():
        raise SystemExit("TRL is not installed: run bench/peers/setup_trl.sh first")
    results = [run_seed(seed, args.steps, out, trl_python) for seed in range(args.seeds)]
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "reward_curves.png")
    report(results)
    print(f"curves: {out / 'reward_curves.png'}; numbers: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
