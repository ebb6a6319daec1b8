"""Pictures of a demo run: the reward curve, and the timeline of who worked when.

Timeline events are JSON objects, one per line in `demo_timeline.jsonl` (the demo's) and
`timeline.jsonl` (the trainer's, next to its metrics file):
`{"process": "trainer", "stage": "train" | "checkpoint" | "push", "step": <int>,
"start": <unix seconds>, "end": <unix seconds>}`; the demo writes process "demo" with the
stages "rollout" and "eval".
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ROW_ORDER = (
    ("demo", "rollout"),
    ("demo", "eval"),
    ("trainer", "train"),
    ("trainer", "checkpoint"),
    ("trainer", "push"),
)
"""Timeline rows from top to bottom; any other (process, stage) pair follows, sorted."""

ROW_COLORS = {
    ("demo", "rollout"): "tab:blue",
    ("demo", "eval"): "tab:purple",
    ("trainer", "train"): "tab:orange",
    ("trainer", "checkpoint"): "tab:green",
    ("trainer", "push"): "tab:red",
}


def plot_rewards(
    steps: list[int],
    rewards: list[float],
    eval_points: dict[int, float],
    out: Path,
    title: str = "Flywheel demo: single-digit addition, SmolLM2-135M-Instruct",
) -> None:
    """Write a PNG with the per-step mean training reward and held-out accuracy points. The
    legend lies below the axes, so it hides no point whatever the curve's shape (inside them,
    a short run's low first rewards fell under it)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
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
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=2, frameon=False)
    fig.savefig(out, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class TimelineEvent:
    """One stage of one process for one step, in unix seconds."""

    process: str
    stage: str
    step: int
    start: float
    end: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def parse_event(raw: object) -> TimelineEvent | None:
    """A TimelineEvent from a JSON line or an already-decoded dict; None when malformed
    (not JSON, not an object, a missing or mistyped field, a non-finite time, end < start)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    if not isinstance(raw, dict):
        return None
    process, stage, step = raw.get("process"), raw.get("stage"), raw.get("step")
    start, end = raw.get("start"), raw.get("end")
    if not (isinstance(process, str) and process and isinstance(stage, str) and stage):
        return None
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    times = (start, end)
    if not all(isinstance(t, int | float) and not isinstance(t, bool) for t in times):
        return None
    if not all(math.isfinite(t) for t in times) or end < start:  # type: ignore[operator,arg-type]
        return None
    return TimelineEvent(process, stage, step, float(start), float(end))  # type: ignore[arg-type]


def parse_events(
    raw_events: Iterable[object], source: str = "timeline"
) -> tuple[list[TimelineEvent], int]:
    """(valid events, number of malformed entries); blank lines are not entries. Malformed
    entries are counted and logged with a warning (the first one shown), never dropped
    silently."""
    events: list[TimelineEvent] = []
    malformed: list[object] = []
    for raw in raw_events:
        if isinstance(raw, str) and not raw.strip():
            continue
        event = parse_event(raw)
        if event is None:
            malformed.append(raw)
        else:
            events.append(event)
    if malformed:
        log.warning(
            "%s: skipped %d malformed timeline entr%s (first: %.200r)",
            source,
            len(malformed),
            "y" if len(malformed) == 1 else "ies",
            malformed[0],
        )
    return events, len(malformed)


def read_timeline_lines(path: Path) -> list[str]:
    """The lines of a timeline file; [] when it is absent or unreadable (the trainer may not
    write one)."""
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def timeline_rows(events: list[TimelineEvent]) -> list[tuple[str, str]]:
    """The (process, stage) rows present in `events`, top to bottom: ROW_ORDER first."""
    present = {(e.process, e.stage) for e in events}
    known = [row for row in ROW_ORDER if row in present]
    return known + sorted(present - set(ROW_ORDER))


def plot_timeline(
    events: Iterable[object], path: Path, *, origin: float | None = None, title: str = ""
) -> int:
    """Write a PNG: one row of horizontal bars per (process, stage) over wall-clock seconds.

    Args:
        events: TimelineEvent objects, dicts or JSON lines (the contract in this module's
            docstring); malformed ones are skipped with a logged warning.
        path: the PNG to write.
        origin: unix seconds drawn as 0 (the demo's start); events that ended before it (an
            earlier run's, in a reused folder) are left out. None = the earliest event's start.
        title: the picture's title ("" = a default one).

    Returns:
        The number of malformed entries skipped.
    """
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    items = list(events)
    parsed, malformed = parse_events(
        [e for e in items if not isinstance(e, TimelineEvent)], source=str(path)
    )
    valid = [e for e in items if isinstance(e, TimelineEvent)] + parsed
    if origin is not None:
        valid = [e for e in valid if e.end >= origin]
    t0 = origin if origin is not None else min((e.start for e in valid), default=0.0)
    rows = timeline_rows(valid)
    span = max((e.end - t0 for e in valid), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * max(len(rows), 1)))
    handles = []
    for index, row in enumerate(rows):
        y = len(rows) - 1 - index  # the first row on top
        color = ROW_COLORS.get(row, f"C{index % 10}")
        bars = [
            (max(e.start, t0) - t0, e.end - max(e.start, t0))
            for e in valid
            if (e.process, e.stage) == row
        ]
        ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=color, edgecolor="black", linewidth=0.4)
        for e in valid:  # the step number inside bars wide enough to hold it
            left = max(e.start, t0) - t0
            if (e.process, e.stage) == row and e.end - t0 - left >= 0.025 * span:
                mid = (left + e.end - t0) / 2
                ax.text(mid, y, str(e.step), ha="center", va="center", fontsize=7, color="white")
        handles.append(Patch(facecolor=color, edgecolor="black", label=f"{row[0]}: {row[1]}"))
    ax.set_yticks(range(len(rows)), [f"{p}: {s}" for p, s in reversed(rows)])
    ax.set_ylim(-0.6, max(len(rows), 1) - 0.4)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since the demo started (numbers in the bars: step)")
    ax.set_title(title or "Flywheel demo timeline: rollouts, training, checkpoints, weight pushes")
    ax.grid(axis="x", alpha=0.3)
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    else:
        ax.text(0.5, 0.5, "no timeline events", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return malformed
