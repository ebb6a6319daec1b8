"""Processes that run torch on the CPU (the engine, the trainer) load it without Triton.

Triton compiles GPU kernels and nothing else, but when it is installed (torch's wheels pull it
in) `torch._dynamo`, which transformers imports while it loads a model, imports it to ask
whether it exists (`torch.utils._triton.has_triton_package`): about 75 MiB of `libtriton.so`
resident in each such process (the engine's `/proc/PID/smaps` after it loaded SmolLM2-135M),
plus Triton's Python modules. `without_triton()` marks Triton as absent (a `None` entry in
`sys.modules`, the documented way to make an import fail) where no CUDA device is visible, so
the answer is "no" and nothing is loaded; on a GPU machine it changes nothing. No CPU
computation reads Triton (inductor's CPU backend generates C++), so logits and gradients stay
the same (`tests/unit/core/test_cpu_libs.py`).
"""

from __future__ import annotations

import sys


def without_triton() -> bool:
    """Make `import triton` fail in this process when no CUDA device is visible. Call it once,
    at start, before the model loads (it imports torch to ask about CUDA).

    Returns:
        True when Triton is now marked absent; False when a CUDA device is visible or Triton
        was already imported (nothing is changed).
    """
    if sys.modules.get("triton") is not None:
        return False
    import torch  # noqa: PLC0415 (the caller's start-up decides when torch loads)

    if torch.cuda.is_available():
        return False
    sys.modules["triton"] = None  # type: ignore[assignment]  # import triton -> ModuleNotFoundError
    return True
