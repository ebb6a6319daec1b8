"""The C heap of the services that hold tensors (engine, trainer): freed tensors go back to the
system.

glibc serves an allocation of at least M_MMAP_THRESHOLD bytes with its own `mmap` and unmaps it
when freed; smaller ones come from the heap, which keeps what is freed for later allocations.
The threshold starts at 128 KiB but glibc raises it (up to 32 MiB) each time such a mapping is
freed, so after the first weight swap or optimizer step most tensors of a model land in the heap,
and a freed copy of the weights (a swapped-out version, a written checkpoint snapshot, last
step's gradients) stays in the process's RSS (`tests/unit/core/test_heap.py` shows both;
`bench/demo_memory.py` measures the whole stack).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter number (malloc.h)."""
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
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.debug("no mallopt in the C library (%s): heap defaults kept", name)
        return False
    if not mallopt(M_MMAP_THRESHOLD, int(threshold_bytes)):
        log.debug("mallopt(M_MMAP_THRESHOLD, %d) refused: heap defaults kept", threshold_bytes)
        return False
    return True
