"""core/heap.py: with the mmap threshold fixed, freed tensors leave the process's RSS; with
glibc's default (dynamic) threshold the same frees stay in the heap. Each case runs in a fresh
interpreter, as a service does."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocate and free one 24 MiB tensor (glibc raises its dynamic threshold to 24 MiB, at most
# 32 MiB), then 400 MiB of tensors of `numel` fp32 values (100 x 4 MiB by default) interleaved
# with small live ones, free the large ones and report how far the RSS stays above where it
# was before them (MiB).
PROBE = """
import sys, psutil, torch
from flywheel.core.heap import TRAINER_MMAP_THRESHOLD_BYTES, return_freed_tensors
mode, numel = sys.argv[1], int(sys.argv[2])
if mode == "fixed":
    assert return_freed_tensors()
if mode == "trainer":
    assert return_freed_tensors(TRAINER_MMAP_THRESHOLD_BYTES)
rss = lambda: psutil.Process().memory_info().rss / 2**20
del_me = torch.ones(6 * 2**20)
del del_me
before = rss()
big, small = [], []
for _ in range(400 * 2**20 // (4 * numel)):
    big.append(torch.ones(numel))
    small.append(torch.ones(64))
del big
print(round(rss() - before))
"""


def _left_after_free(mode: str, numel: int = 2**20) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode, str(numel)], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_go_back_to_the_system_with_the_threshold_fixed():
    # 100 x 4 MiB = 400 MiB were allocated and freed: the default heap keeps most of them
    assert _left_after_free("default") > 200
    assert _left_after_free("fixed") < 50


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_the_trainer_returns_activation_sized_tensors_too():
    # 400 MiB as 1600 tensors of 256 KiB (an activation of 112 tokens x 576 fp32 values): under
    # the 1 MiB threshold they come from the heap and stay; under the trainer's 128 KiB they leave
    assert _left_after_free("fixed", 2**16) > 200
    assert _left_after_free("trainer", 2**16) < 50
