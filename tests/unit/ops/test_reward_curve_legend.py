"""reward_curve.png: the legend hides no plotted point, in short runs (the first steps' rewards
low, the last high, an evaluation at each end) as in long ones, and lies inside the saved image.
The figure `plot_rewards` saves is checked in display coordinates: each point of every line and
scatter against the legend's box."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

from flywheel.ops.demo.plot import plot_rewards

matplotlib.use("Agg")

RUNS = {
    "3 steps, low": ([1, 2, 3], [0.0, 0.05, 0.1], {0: 0.0, 3: 0.1}),
    "3 steps, high": ([1, 2, 3], [0.9, 0.95, 1.0], {0: 1.0, 3: 0.95}),
    "4 steps, rising": ([1, 2, 3, 4], [0.0, 0.3, 0.7, 1.0], {0: 0.0, 4: 1.0}),
    "12 steps, rising": (
        list(range(1, 13)),
        [min(1.0, 0.1 * s) for s in range(1, 13)],
        {0: 0.05, 12: 0.95},
    ),
}


def _layout(fig: Figure) -> tuple[Bbox, np.ndarray, Bbox]:
    """The legend's box, every plotted point and the figure's box, in display coordinates, as
    the figure was just saved."""
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]  (Agg's canvas)
    (ax,) = fig.axes
    legends = [*fig.legends, *([ax.get_legend()] if ax.get_legend() else [])]
    assert len(legends) == 1, legends
    points = [line.get_xydata() for line in ax.get_lines()]
    points += [collection.get_offsets() for collection in ax.collections]
    display = ax.transData.transform(np.concatenate(points))
    return legends[0].get_window_extent(renderer), display, fig.bbox


@pytest.mark.parametrize("run", RUNS.values(), ids=list(RUNS))
def test_the_legend_hides_no_point_and_is_inside_the_image(monkeypatch, tmp_path, run):
    layouts: list[tuple[Bbox, np.ndarray, Bbox]] = []
    save = Figure.savefig

    def keep(fig: Figure, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        save(fig, *args, **kwargs)
        layouts.append(_layout(fig))

    monkeypatch.setattr(Figure, "savefig", keep)
    steps, rewards, evals = run
    plot_rewards(steps, rewards, evals, tmp_path / "reward_curve.png")
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    ((box, points, figure),) = layouts
    assert len(points) >= len(steps) + len(evals)
    hidden = [(x, y) for x, y in points if box.x0 <= x <= box.x1 and box.y0 <= y <= box.y1]
    assert not hidden, (box, hidden)
    assert figure.x0 <= box.x0 and box.x1 <= figure.x1, (figure, box)
    assert figure.y0 <= box.y0 and box.y1 <= figure.y1, (figure, box)
