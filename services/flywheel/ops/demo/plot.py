"""Reward curve PNG of a demo run."""

from __future__ import annotations

from pathlib import Path


def plot_rewards(
    steps: list[int], rewards: list[float], eval_points: dict[int, float], out: Path
) -> None:
    """Write a PNG with the per-step mean training reward and held-out accuracy points."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, marker=".", label="mean training reward (T=1)")
    if len(rewards) >= 5:
        smooth = [
            sum(rewards[max(0, i - 4) : i + 1]) / len(rewards[max(0, i - 4) : i + 1])
            for i in range(len(rewards))
        ]
        ax.plot(steps, smooth, label="5-step moving average")
    if eval_points:
        ax.scatter(
            list(eval_points),
            list(eval_points.values()),
            color="red",
            zorder=3,
            label="held-out greedy accuracy",
        )
    ax.set_xlabel("trainer step (weight version)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("Flywheel demo: single-digit addition, SmolLM2-135M-Instruct")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
