"""core/heap.py: with the mmap threshold fixed, freed tensors leave the process's RSS; with
glibc's default (dynamic) threshold the same frees stay in the heap. Each case runs in a fresh
interpreter, as a service does."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocate and free one 24 MiB tensor (glibc raises its dynamic threshold to 24 MiB, at most
# 32 MiB), then 100 tensors of 4 MiB each interleaved with small live ones, free the 4 MiB
# tensors and report how far the RSS stays above where it was before them (MiB).
PROBE = """
import sys, psutil, torch
if sys.argv[1] == "fixed":
    from flywheel.core.heap import return_freed_tensors
    assert return_freed_tensors()
rss = lambda: psutil.Process().memory_info().rss / 2**20
del_me = torch.ones(6 * 2**20)
del del_me
before = rss()
big, small = [], []
for _ in range(100):
    big.append(torch.ones(2**20))
    small.append(torch.ones(64))
del big
print(round(rss() - before))
"""


def _left_after_free(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_go_back_to_the_system_with_the_threshold_fixed():
    # 100 x 4 MiB = 400 MiB were allocated and freed: the default heap keeps most of them
    assert _left_after_free("default") > 200
    assert _left_after_free("fixed") < 50
