"""The C heap of the services: freed tensors (engine, trainer) and the freed bodies of many I/O
threads (the demo driver) go back to the system.

glibc serves an allocation of at least M_MMAP_THRESHOLD bytes with its own `mmap` and unmaps it
when freed; smaller ones come from the heap, which keeps what is freed for later allocations.
The threshold starts at 128 KiB but glibc raises it (up to 32 MiB) each time such a mapping is
freed, so after the first weight swap or optimizer step most tensors of a model land in the heap,
and a freed copy of the weights (a swapped-out version, a written checkpoint snapshot, last
step's gradients) stays in the process's RSS (`tests/unit/core/test_heap.py` shows both;
`bench/demo_memory.py` measures the whole stack). Threads also get malloc arenas of their own,
each keeping its thread's freed memory; `share_malloc_arenas` caps them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number (malloc.h)."""
M_ARENA_MAX = -8
"""glibc's mallopt parameter number for the most malloc arenas (malloc.h)."""
MMAP_THRESHOLD_BYTES = 1 << 20
"""Allocations of at least this many bytes get their own mapping, returned when freed."""


def return_freed_tensors(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold_bytes` (which also stops glibc from raising it),
    so every allocation that large (a tensor of 256 Ki fp32 elements or more) is returned to
    the system when freed. Call it once, at start, before the model loads.

    Returns:
        True when set; False (logged at debug) where the C library is not glibc (musl,
        macOS) or refused the value: the process then runs with its library's defaults.
    """
    return _mallopt(M_MMAP_THRESHOLD, threshold_bytes, "M_MMAP_THRESHOLD")


def share_malloc_arenas(count: int = 1) -> bool:
    """Cap glibc's malloc arenas at `count` for this process. glibc gives threads their own
    arenas (up to 8 per core) and each keeps what its thread freed: the demo driver's 32 episode
    threads held about 180 MiB that way. Python objects over 512 bytes (request and reply
    bodies) come from malloc, so I/O threads gain nothing from separate arenas. Call it before
    the threads start.

    Returns:
        True when set; False (logged at debug) where the C library is not glibc or refused it.
    """
    return _mallopt(M_ARENA_MAX, count, "M_ARENA_MAX")


def _mallopt(param: int, value: int, what: str) -> bool:
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        log.debug("no mallopt in the C library (%s): heap defaults kept", name)
        return False
    if not mallopt(param, int(value)):
        log.debug("mallopt(%s, %d) refused: heap defaults kept", what, value)
        return False
    return True
