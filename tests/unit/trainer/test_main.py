"""The entry point parses settings before torch is imported; bad settings fail fast."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flywheel.trainer.main import main


def test_entry_point_and_group_assembly_import_without_torch():
    code = (
        "import sys, flywheel.trainer.main, flywheel.trainer.groups, flywheel.trainer.http; "
        "assert 'torch' not in sys.modules, 'torch imported before settings parse'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_invalid_settings_fail_before_anything_starts(tmp_path, monkeypatch):
    config = tmp_path / "bad.toml"
    config.write_text("[trainer.algorithm]\ndual_clip_c = 0.5\n")
    monkeypatch.delenv("FLYWHEEL_CONFIG", raising=False)
    with pytest.raises(SystemExit, match="dual_clip_c"):  # one message naming the field
        main(["--config", str(config)])
