"""Processes that only tokenize (the gateway, the teacher) load `transformers` without torch.

transformers 5 imports torch at `import transformers` whenever torch is installed, although
its tokenizers and chat templates never use it: in the gateway that import alone held about
240 MiB of RSS (torch's libraries and their heap), more than the rest of the process.
`without_torch()` marks torch as absent in this process (a `None` entry in `sys.modules`, the
documented way to make an import fail), so transformers takes its torch-free path: the same
`TokenizersBackend` tokenizer, the same chat-template renderer. `bench/demo_memory.py` measures
the gateway's RSS in the whole stack; `tests/unit/core/test_tokenizer_only.py` checks that the
ids and the rendered template are the ones a torch-importing process produces.
"""

from __future__ import annotations

import os
import sys

NO_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
"""transformers' switch for its advice lines ("PyTorch was not found ..."), set here because
the absence is chosen, not a broken install."""


def without_torch() -> bool:
    """Make `import torch` fail in this process, before `transformers` is imported.

    Returns:
        True when torch is now marked absent; False when it was already imported (nothing is
        changed: the process keeps the torch it has).
    """
    if sys.modules.get("torch") is not None:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]  # import torch -> ModuleNotFoundError
    os.environ.setdefault(NO_ADVICE, "1")
    return True
