"""Synchronous vs asynchronous training loop, side by side in one run, on the real demo.

    .venv/bin/python bench/async_loop.py --steps 8

Runs `flywheel demo --new-stack` twice, one after the other, with the same task, model, seed
and rollouts per step:

- sync: `--mode sync` (the demo waits for each weight version), `trainer.background_io =
  false` and `trainer.checkpoint.every = 1` (a full checkpoint, then the push, on every step's
  critical path: the loop as it was);
- sync_bgio: `--mode sync` with the trainer's defaults (a small commit record per step, full
  checkpoints every `checkpoint_every` steps and weight pushes in background threads);
- async: rollouts up to `--max-staleness` versions ahead of the served weights, trainer
  defaults;
- async_split: async with the cores split between engine and trainer (one torch thread each).

`--modes` picks a subset (default: all, in this order).

From each run's `timeline.jsonl` (trainer stages) and `demo_timeline.jsonl` (rollouts) it prints
the training span (first rollout start to the last step's end), steps per hour, each stage's
busy seconds as a share of the span (shares can add up to more than 100% when stages overlap),
the trainer's median step time and the held-out accuracy, with async/sync ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "sync": (
        ["--mode", "sync"],
        {"FLYWHEEL_TRAINER__BACKGROUND_IO": "false", "FLYWHEEL_TRAINER__CHECKPOINT__EVERY": "1"},
    ),
    "sync_bgio": (["--mode", "sync"], {}),
    "async": (["--mode", "async"], {}),
    "async_split": (
        ["--mode", "async"],
        {"FLYWHEEL_ENGINE__THREADS": "1", "FLYWHEEL_TRAINER__THREADS": "1"},
    ),
}
STAGES = (("demo", "rollout"), ("trainer", "train"), ("trainer", "checkpoint"), ("trainer", "push"))


def read_events(*paths: Path) -> list[dict]:
    events = []
    for path in paths:
        if path.is_file():
            events += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return events


def summarize(out: Path) -> dict[str, float]:
    """Span, steps per hour and stage shares of one demo run folder."""
    events = read_events(out / "timeline.jsonl", out / "demo_timeline.jsonl")
    rollouts = [e for e in events if (e["process"], e["stage"]) == ("demo", "rollout")]
    trains = [e for e in events if (e["process"], e["stage"]) == ("trainer", "train")]
    if not rollouts or not trains:
        raise SystemExit(f"{out}: no timeline events; did the demo run?")
    start = min(e["start"] for e in rollouts)
    end = max(e["end"] for e in trains)
    span = end - start
    steps = len({e["step"] for e in trains})
    row = {"span_s": span, "steps": steps, "steps_per_hour": steps / span * 3600}
    for process, stage in STAGES:
        busy = sum(
            e["end"] - e["start"]
            for e in events
            if (e["process"], e["stage"]) == (process, stage) and e["end"] >= start
        )
        row[f"share/{stage}"] = busy / span
    metrics = [json.loads(x) for x in (out / "trainer_metrics.jsonl").read_text().splitlines()]
    row["step_s_median"] = statistics.median(
        m["time/step_s"] for m in metrics if "time/step_s" in m
    )
    summary = json.loads((out / "summary.json").read_text())
    row["eval_after"] = summary["eval_after"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="runs/async_loop")
    parser.add_argument("--skip-runs", action="store_true", help="only read existing folders")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    args = parser.parse_args()
    rows = {}
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    for mode in modes:
        flags, env = MODES[mode]
        out = ROOT / args.out / mode
        if not args.skip_runs:
            cmd = [sys.executable, "-m", "flywheel.ops.cli", "demo", "--new-stack"]
            cmd += ["--steps", str(args.steps), "--out", str(out), *flags]
            subprocess.run(cmd, check=True, cwd=ROOT, env=os.environ | env)
        rows[mode] = summarize(out)
    base = modes[0]
    print(f"{'':18}" + "".join(f"{m:>12}" for m in modes) + f"   (ratios: x / {base})")
    for key in rows[base]:
        cells = "".join(f"{rows[m][key]:>12.3f}" for m in modes)
        ratios = " ".join(
            f"x{rows[m][key] / rows[base][key]:.2f}" if rows[base][key] else "-" for m in modes[1:]
        )
        print(f"{key:18}{cells}   {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
