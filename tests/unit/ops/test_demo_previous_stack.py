"""`flywheel demo` on a stack of its own replaces the stack folder an earlier demo with the same
`--out` left (`<out>/stack`: Redis data, checkpoints, logs; gigabytes after a full run), and
first says so in one line naming the folder and its size. The stack and the run are fakes."""

from __future__ import annotations

from .demo_fakes import run_demo_cli


def test_the_previous_stack_folder_is_named_with_its_size_before_it_is_deleted(
    monkeypatch, tmp_path, capsys
):
    old = tmp_path / "demo" / "stack"
    (old / "checkpoints" / "step_30").mkdir(parents=True)
    (old / "checkpoints" / "step_30" / "model.safetensors").write_bytes(b"w" * 2_400_000)
    (old / "logs").mkdir()
    (old / "logs" / "engine.log").write_bytes(b"x" * 100_000)

    _settings, _runner, out = run_demo_cli(monkeypatch, tmp_path)

    lines = [ln for ln in capsys.readouterr().out.splitlines() if "previous run's" in ln]
    assert lines == [
        f"flywheel demo: deleting the previous run's stack folder {out / 'stack'} "
        "(2.5 MB: Redis data, checkpoints, logs)"
    ]
    assert not (out / "stack" / "checkpoints" / "step_30").exists()


def test_no_line_when_there_is_no_previous_stack_folder(monkeypatch, tmp_path, capsys):
    run_demo_cli(monkeypatch, tmp_path)
    assert "deleting" not in capsys.readouterr().out
