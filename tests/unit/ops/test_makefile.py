"""The Makefile's main commands: `make demo` sets up only what the demo needs (no apt installs
of the tests' Debian tools), `make test` installs those too, CI runs the README's `make test`,
and every long install step of the set-up says first what it installs and that it takes a while
(pip itself is quiet). Read with `make -n` (nothing is run) and the set-up forced out of date."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _planned(target: str) -> list[str]:
    """The commands `make <target>` would run from a fresh checkout (set-up stamp out of
    date), without running them."""
    if shutil.which("make") is None:
        if os.environ.get("CI"):
            pytest.fail("make is missing")
        pytest.skip("make is not installed here")
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", "-W", "pyproject.toml", target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_make_demo_sets_up_the_venv_without_the_tests_apt_installs():
    demo = "\n".join(_planned("demo"))
    assert "pip install" in demo and "flywheel demo" in demo
    for tool in ("apt-get", "chromium", "docker-compose", "podman"):
        assert tool not in demo, f"make demo would install {tool}"


def test_make_test_installs_the_tests_system_tools_and_ci_runs_it():
    test = "\n".join(_planned("test"))
    assert "apt-get install" in test and "chromium" in test and "pytest -q" in test
    assert "\nmake test\n" in (ROOT / ".ci" / "run").read_text()


def test_every_pip_install_of_the_setup_is_announced_first():
    lines = _planned("setup")
    installs = [i for i, line in enumerate(lines) if "pip install" in line]
    assert len(installs) >= 3
    for i in installs:
        said = lines[i - 1]
        assert said.startswith("echo ") and "install" in said, (lines[i], said)
        assert "few minutes" in said or "a minute" in said, said
        assert " -q " in lines[i]  # pip's own output stays quiet
