"""Which deployment `status`, `engines` and `keys` act on: with no `flywheel up` in the state
dir, the messages also say how to reach the stack a `flywheel demo` started (it runs from
`<out>/stack`, not from the default state dir), so `make demo` then `flywheel status` in the
same folder does not leave the reader with a table of DOWN services and no way forward."""

from __future__ import annotations

import pytest

from flywheel.ops.target import CONFIGURED, Target


def _configured() -> Target:
    return Target(
        state=None,
        redis_url="redis://127.0.0.1:6379/0",
        source=CONFIGURED,
        explicit=False,
        state_dir=".flywheel",
    )


def test_the_read_note_names_the_state_dir_of_a_demo_stack():
    note = _configured().note()
    assert note.startswith("flywheel: no `flywheel up` is running from .flywheel;")
    assert "FLYWHEEL_STATE_DIR=runs/demo/stack" in note  # `make demo`'s OUT is runs/demo


def test_a_refused_change_names_the_state_dir_of_a_demo_stack():
    with pytest.raises(SystemExit) as info:
        _configured().refuse_change("create an API key")
    assert "FLYWHEEL_STATE_DIR=runs/demo/stack" in str(info.value.code)


def test_a_running_stack_gets_no_note():
    target = Target(
        state={"gateway": "http://127.0.0.1:8000"},
        redis_url="redis://127.0.0.1:6379/0",
        source="flywheel up",
        explicit=False,
        state_dir=".flywheel",
    )
    assert target.note() == ""
    target.refuse_change("create an API key")  # returns: nothing refused
