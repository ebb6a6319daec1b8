"""The installed package (what every image installs, not editable) carries every data file the
services read."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_images_ship_every_data_file_the_services_read():
    """Images install the package (not editable): every non-Python file under services/flywheel
    (dashboard page and script, judge and hint prompts, ...) must match the package data."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["flywheel"]
    src = ROOT / "services" / "flywheel"
    files = [
        p.relative_to(src).as_posix()
        for p in src.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert "gateway/static/dashboard.js" in files
    for path in files:
        assert any(
            fnmatch.fnmatch(path, pat.removeprefix("**/")) or path == pat for pat in patterns
        ), f"{path} is not package data: the image lacks it"
