"""Synchronous vs asynchronous training loop, side by side in one run, on the real demo.

    .venv/bin/python bench/async_loop.py --steps 8

Runs `flywheel demo --new-stack` twice, one after the other, with the same task, model, seed
and rollouts per step:

- sync: `--mode sync` (the demo waits for each weight version), `trainer.background_io =
  false` and `trainer.checkpoint_every = 1` (a full checkpoint, then the push, on every step's
  critical path: the loop as it was);
- async: the defaults (rollouts up to `--max-staleness` versions ahead, a small commit record
  per step, full checkpoints every `checkpoint_every` steps and weight pushes in background
  threads).

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
        {"FLYWHEEL_TRAINER__BACKGROUND_IO": "false", "FLYWHEEL_TRAINER__CHECKPOINT_EVERY": "1"},
    ),
    "async": ([], {}),
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
    args = parser.parse_args()
    rows = {}
    for mode, (flags, env) in MODES.items():
        out = ROOT / args.out / mode
        if not args.skip_runs:
            cmd = [sys.executable, "-m", "flywheel.ops.cli", "demo", "--new-stack"]
            cmd += ["--steps", str(args.steps), "--out", str(out), *flags]
            subprocess.run(cmd, check=True, cwd=ROOT, env=os.environ | env)
        rows[mode] = summarize(out)
    keys = list(rows["sync"])
    print(f"{'':18} {'sync':>10} {'async':>10} {'async/sync':>11}")
    for key in keys:
        a, s = rows["async"][key], rows["sync"][key]
        ratio = f"x{a / s:.2f}" if s else "-"
        print(f"{key:18} {s:>10.3f} {a:>10.3f} {ratio:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
