"""Learning efficiency side by side: `flywheel demo` vs TRL's GRPOTrainer (bench/peers/trl_grpo.py)
on the same CPU, model, task, group size, lr and number of rollouts, one after the other, for
each of `--seeds` seeds.

    bench/peers/setup_trl.sh
    .venv/bin/python bench/peers/learning_efficiency.py --steps 30 --seeds 3
    .venv/bin/python bench/peers/learning_efficiency.py --steps 30 --flywheel-steps 45 \
        --trl-from bench/results/learning_efficiency_30x3.json    # Flywheel only, TRL as before

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

`--flywheel-steps M` runs Flywheel for M steps (same rollouts per step): its time to TRL's final
reward is read off its own curve, so a faster loop may use the time TRL takes for its N steps.
`--trl-from` takes TRL's side from an earlier run's results on the same machine (TRL's side is
unchanged by Flywheel's code) instead of running it again; the report marks it `trl*`.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("FLYWHEEL_PEERS_DIR", Path.home() / ".cache/flywheel/peers"))
WINDOW = 5
"""Steps of the moving average that decides when a reward is reached."""


MODULE_ROLES = {
    "flywheel.engine.convert": "model conversion",
    "flywheel.engine": "engine",
    "flywheel.gateway": "gateway",
    "flywheel.reward": "reward",
    "flywheel.teacher": "teacher",
    "flywheel.trainer": "trainer",
    "flywheel.ops.cli": "demo driver",
}


def role_of(process: psutil.Process) -> str:
    """The role of one process of the demo's tree, from its command line: `-m flywheel.<x>`
    names a service ("trainer --check-settings" is the stack's settings check), redis-server is
    "redis"; any other process (a worker a service spawned) takes its nearest named ancestor's
    role with " (child)"."""
    own = _named_role(process)
    if own is not None:
        return own
    for parent in process.parents():
        role = _named_role(parent)
        if role is not None:
            return f"{role} (child)"
    return process.name()


def _named_role(process: psutil.Process) -> str | None:
    try:
        cmdline = process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if cmdline and "redis-server" in Path(cmdline[0]).name:
        return "redis"
    if "-m" in cmdline[:-1]:
        module = cmdline[cmdline.index("-m") + 1]
        role = MODULE_ROLES.get(module)
        if role == "trainer" and "--check-settings" in cmdline:
            return "trainer settings check"
        return role
    return None


@dataclass
class RolePeaks:
    """Per role of a process tree (`run_sampled`'s `role_of`), in MiB: `peak` = the highest
    summed RSS of the role's processes in any sample; `at_peak` = their summed RSS in the sample
    where the whole tree's sum peaked."""

    peak: dict[str, float] = field(default_factory=dict)
    at_peak: dict[str, float] = field(default_factory=dict)


def run_sampled(
    cmd: list[str],
    interval_s: float = 0.5,
    *,
    env: dict[str, str] | None = None,
    role_of: Callable[[psutil.Process], str] | None = None,
    role_peaks: RolePeaks | None = None,
) -> tuple[float, float]:
    """Run `cmd` to the end while sampling the summed RSS of its process tree.

    Args:
        env: the command's environment (None = this process's).
        role_of: names the role of a process of the tree (e.g. "engine"); with `role_peaks`,
            filled with each role's peak and what it held when the whole tree peaked.

    Returns:
        (launch time in unix seconds, peak RSS in MiB of the process and all its descendants).

    Raises:
        subprocess.CalledProcessError: the command failed.
    """
    launched = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
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
            total, roles = 0, dict[str, int]()
            for p in tree:
                with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                    rss = p.memory_info().rss
                    total += rss
                    if role_of is not None:
                        role = role_of(p)
                        roles[role] = roles.get(role, 0) + rss
            if role_peaks is not None:
                for role, rss in roles.items():
                    role_peaks.peak[role] = max(role_peaks.peak.get(role, 0.0), rss / 2**20)
                if total > peak:
                    role_peaks.at_peak = {r: rss / 2**20 for r, rss in roles.items()}
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


def flywheel_demo_cmd(steps: int, seed: int, out: Path) -> list[str]:
    """The Flywheel side's command: `flywheel demo` on a stack of its own, default settings."""
    return [sys.executable, "-m", "flywheel.ops.cli", "demo", "--new-stack"] + [
        *("--steps", str(steps), "--seed", str(seed), "--out", str(out))
    ]


def run_seed(
    seed: int,
    steps: int,
    out: Path,
    trl_python: Path,
    flywheel_steps: int | None = None,
    trl_earlier: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Both sides with `seed`; their curves, times to TRL's final reward and peak RSS.

    `flywheel_steps`: Flywheel's steps (default `steps`; the same rollouts per step, so more
    steps only give it longer to reach TRL's reward). `trl_earlier`: this seed's entry of an
    earlier run's results, whose TRL side is taken instead of running TRL again."""
    fw_dir, trl_dir = out / f"seed{seed}" / "flywheel", out / f"seed{seed}" / "trl"
    common = ["--steps", str(steps), "--seed", str(seed)]
    fw_roles = RolePeaks()
    fw_launch, fw_rss = run_sampled(
        flywheel_demo_cmd(flywheel_steps or steps, seed, fw_dir),
        role_of=role_of,
        role_peaks=fw_roles,
    )
    fw_rewards, fw_times = flywheel_curve(fw_dir)
    sides = {}
    if trl_earlier is None:
        trl_launch, trl_rss = run_sampled(
            [str(trl_python), str(ROOT / "bench/peers/trl_grpo.py"), *common, "--out", str(trl_dir)]
        )
        trl = json.loads((trl_dir / "summary.json").read_text())
        trl_rewards, trl_times = trl["rewards"], trl["reward_times"][: len(trl["rewards"])]
        runs = [
            ("flywheel", fw_launch, fw_rewards, fw_times, fw_rss, fw_dir),
            ("trl", trl_launch, trl_rewards, trl_times, trl_rss, trl_dir),
        ]
    else:
        sides["trl"] = dict(trl_earlier["trl"], earlier=True)
        trl_rewards = sides["trl"]["rewards"]
        runs = [("flywheel", fw_launch, fw_rewards, fw_times, fw_rss, fw_dir)]
    target = moving_average(trl_rewards)[-1]
    for name, launched, rewards, times, rss, folder in runs:
        summary = json.loads((folder / "summary.json").read_text())
        sides[name] = {
            "rewards": rewards,
            "seconds": [t - launched for t in times],
            "time_to_target_s": time_to_reach(rewards, times, launched, target),
            "peak_rss_mib": rss,
            **{k: summary[k] for k in ("minutes", "first5", "last5", "eval_before", "eval_after")},
        }
    sides["flywheel"]["rss_at_peak_by_role_mib"] = {
        role: round(mib) for role, mib in sorted(fw_roles.at_peak.items(), key=lambda x: -x[1])
    }
    return {"seed": seed, "target": target, **sides}


def ratio(a: float | None, b: float | None) -> str:
    return f"x{a / b:.2f}" if a is not None and b else "-"


def score(value: float | None) -> str:
    """A reward window with 3 decimals; "-" for none (the demo's first5/last5 under 10 steps)."""
    return f"{value:.3f}" if value is not None else "-"


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
            name = "trl*" if s.get("earlier") else side
            print(
                f"{r['seed']:>4} {name:9} {seconds(s['time_to_target_s']):>15} "
                f"{s['peak_rss_mib']:>12.0f} {s['minutes']:>8.1f} {score(s['first5']):>6} "
                f"{score(s['last5']):>6} {s['eval_before']:>8.3f} {s['eval_after']:>8.3f}"
            )
        fw, trl = r["flywheel"], r["trl"]
        print(
            f"{r['seed']:>4} target (TRL's final {WINDOW}-step reward) {r['target']:.3f}; "
            f"flywheel/trl time {ratio(fw['time_to_target_s'], trl['time_to_target_s'])}, "
            f"peak RSS {ratio(fw['peak_rss_mib'], trl['peak_rss_mib'])}"
        )
        if fw.get("rss_at_peak_by_role_mib"):
            roles = ", ".join(f"{k} {v}" for k, v in fw["rss_at_peak_by_role_mib"].items())
            print(f"{r['seed']:>4} flywheel RSS MiB at its peak by process role: {roles}")
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
    if any(r["trl"].get("earlier") for r in results):
        print("trl*: TRL's side taken from an earlier run (--trl-from), not run again")


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
    parser.add_argument(
        "--flywheel-steps",
        type=int,
        default=0,
        help="Flywheel's steps (default: --steps); its time to TRL's final reward is read off "
        "its own curve, so more steps give it longer to get there",
    )
    parser.add_argument(
        "--trl-from",
        metavar="RESULTS_JSON",
        help="take each seed's TRL side from an earlier run's results (same machine) instead "
        "of running TRL again; the report marks it",
    )
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
    earlier: dict[int, dict[str, Any]] = {}
    if args.trl_from:
        earlier = {r["seed"]: r for r in json.loads(Path(args.trl_from).read_text())}
        missing = [s for s in range(args.seeds) if s not in earlier]
        if missing:
            raise SystemExit(f"learning_efficiency: {args.trl_from} has no seed {missing}")
    elif not trl_python.exists():
        raise SystemExit("TRL is not installed: run bench/peers/setup_trl.sh first")
    results = [
        run_seed(seed, args.steps, out, trl_python, args.flywheel_steps or None, earlier.get(seed))
        for seed in range(args.seeds)
    ]
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "reward_curves.png")
    report(results)
    print(f"curves: {out / 'reward_curves.png'}; numbers: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
