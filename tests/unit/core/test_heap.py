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


# 32 threads each allocate and free 20 x 100 bodies of 60 kB (malloc'd, under glibc's 128 KiB
# default mmap threshold) while keeping one 600-byte object per round alive; report how far
# the RSS stays above where it was before (MiB).
ARENAS = """
import sys, threading, psutil
if sys.argv[1] == "shared":
    from flywheel.core.heap import share_malloc_arenas
    assert share_malloc_arenas()
rss = lambda: psutil.Process().memory_info().rss / 2**20
before = rss()
keep, barrier = [], threading.Barrier(32)
def work():
    barrier.wait()
    for _ in range(20):
        bodies = [bytes(60_000) for _ in range(100)]
        keep.append(bytes(600))
        del bodies
threads = [threading.Thread(target=work) for _ in range(32)]
[t.start() for t in threads]
[t.join() for t in threads]
print(round(rss() - before))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_threads_freed_bodies_leave_with_one_shared_arena():
    def left(mode: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", ARENAS, mode], capture_output=True, text=True, check=True
        )
        return int(out.stdout.strip())

    # each arena keeps up to 6 MB (100 x 60 kB) of freed bodies: 16 arenas on 2 cores
    # (8 per core) kept 95 MiB here, one shared arena 29 MiB
    assert left("default") > 2 * left("shared")
