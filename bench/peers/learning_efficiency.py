"""Learning efficiency side by side: `flywheel demo` vs TRL's GRPOTrainer (bench/peers/trl_grpo.py)
on the same CPU, model, task, group size, lr and number of rollouts, one after the other.

    bench/peers/setup_trl.sh
    .venv/bin/python bench/peers/learning_efficiency.py --steps 30

Runs `flywheel demo --new-stack --steps N --out runs/peers/flywheel`, then the TRL script with
the same settings, reads both summaries and prints wall-clock minutes, reward first5/last5 and
held-out accuracy before/after, with ratios (TRL / Flywheel). Both runs use 4 problems x 8
samples per step = 32 rollouts per optimizer step, N steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("FLYWHEEL_PEERS_DIR", Path.home() / ".cache/flywheel/peers"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="runs/peers")
    args = parser.parse_args()
    out = ROOT / args.out
    trl_python = PEERS / "trl" / "bin" / "python"
    if not trl_python.exists():
        raise SystemExit("TRL is not installed: run bench/peers/setup_trl.sh first")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "flywheel.ops.cli",
            "demo",
            "--new-stack",
            "--steps",
            str(args.steps),
            "--out",
            str(out / "flywheel"),
        ],
        check=True,
        cwd=ROOT,
    )
    subprocess.run(
        [
            str(trl_python),
            str(ROOT / "bench/peers/trl_grpo.py"),
            "--steps",
            str(args.steps),
            "--out",
            str(out / "trl"),
        ],
        check=True,
        cwd=ROOT,
    )
    fw = json.loads((out / "flywheel" / "summary.json").read_text())
    trl = json.loads((out / "trl" / "summary.json").read_text())
    print(
        f"{'':10} {'minutes':>8} {'first5':>7} {'last5':>7} {'eval_before':>11} {'eval_after':>10}"
    )
    for name, s in (("flywheel", fw), ("trl", trl)):
        print(
            f"{name:10} {s['minutes']:>8.1f} {s['first5']:>7.3f} {s['last5']:>7.3f} "
            f"{s['eval_before']:>11.3f} {s['eval_after']:>10.3f}"
        )
    print(
        f"wall-clock trl/flywheel x{trl['minutes'] / fw['minutes']:.2f}; "
        f"held-out gain flywheel {fw['eval_after'] - fw['eval_before']:+.3f}, "
        f"trl {trl['eval_after'] - trl['eval_before']:+.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
