"""`plot_timeline`: one row per (process, stage), from hand-written events; malformed entries
are counted and logged, never dropped silently."""

from __future__ import annotations

import json
import logging

from flywheel.ops.demo.plot import (
    parse_event,
    parse_events,
    plot_timeline,
    read_timeline_lines,
    timeline_rows,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_800_000_000.0


def _event(process, stage, step, start, end):  # noqa: ANN001, ANN202
    return {"process": process, "stage": stage, "step": step, "start": T0 + start, "end": T0 + end}


EVENTS = [
    _event("demo", "eval", 0, 0.0, 4.0),
    _event("demo", "rollout", 1, 4.0, 9.0),
    _event("demo", "rollout", 2, 9.0, 14.0),  # async: on the initial weights
    _event("trainer", "train", 1, 9.5, 20.0),
    _event("trainer", "checkpoint", 1, 20.0, 26.0),  # background: overlaps train of step 2
    _event("trainer", "push", 1, 20.0, 22.0),
    _event("demo", "rollout", 3, 22.5, 27.0),
    _event("trainer", "train", 2, 20.5, 31.0),
    _event("trainer", "push", 2, 31.0, 33.0),
    _event("demo", "eval", 3, 40.0, 44.0),
]


def test_plot_timeline_writes_a_png_with_one_row_per_process_stage(tmp_path):
    out = tmp_path / "timeline.png"
    assert plot_timeline(EVENTS, out, origin=T0) == 0
    data = out.read_bytes()
    assert len(data) > 0 and data.startswith(PNG_MAGIC)
    events, malformed = parse_events(EVENTS)
    assert malformed == 0
    assert timeline_rows(events) == [
        ("demo", "rollout"),
        ("demo", "eval"),
        ("trainer", "train"),
        ("trainer", "checkpoint"),
        ("trainer", "push"),
    ]


def test_malformed_lines_are_counted_and_logged(tmp_path, caplog):
    lines = [json.dumps(e) for e in EVENTS[:3]] + [
        "not json at all",
        json.dumps({"process": "trainer", "stage": "train", "step": 1, "start": T0}),  # no end
        json.dumps(_event("trainer", "push", 1, 5.0, 2.0)),  # ends before it starts
        json.dumps([1, 2, 3]),
        "",  # a blank line is not an entry
    ]
    out = tmp_path / "timeline.png"
    with caplog.at_level(logging.WARNING, logger="flywheel.ops.demo.plot"):
        skipped = plot_timeline(lines, out)
    assert skipped == 4
    assert out.read_bytes().startswith(PNG_MAGIC)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "skipped 4 malformed timeline entries" in warnings[0].getMessage()
    assert "not json at all" in warnings[0].getMessage()


def test_parse_event_rejects_mistyped_fields():
    good = _event("trainer", "train", 3, 1.0, 2.0)
    assert parse_event(good) is not None
    assert parse_event(json.dumps(good)) == parse_event(good)
    for field, value in [
        ("step", "3"),
        ("step", True),
        ("start", None),
        ("end", float("nan")),
        ("process", ""),
        ("stage", 7),
    ]:
        assert parse_event(good | {field: value}) is None, field


def test_events_that_ended_before_the_origin_are_left_out_not_counted(tmp_path):
    earlier_run = _event("trainer", "train", 9, -500.0, -400.0)
    out = tmp_path / "timeline.png"
    assert plot_timeline([earlier_run, *EVENTS], out, origin=T0) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_an_absent_or_empty_timeline_still_draws(tmp_path):
    assert read_timeline_lines(tmp_path / "absent.jsonl") == []
    (tmp_path / "empty.jsonl").write_text("")
    assert read_timeline_lines(tmp_path / "empty.jsonl") == []
    out = tmp_path / "timeline.png"
    assert plot_timeline([], out) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)
