"""Abandoning the optimizer step in progress when the trainer is asked to stop.

The weights, AdamW and the scheduler change only in `optimizer.step()`, at the end of a step;
the forward and backward passes before it only add up gradients. So a stop (SIGTERM, SIGINT)
that comes while a step's passes run ends the step at the policy's next module call, or at the
next decoder layer its backward reaches: the gradients are discarded, nothing is committed, and
the step's stream entries stay pending (neither acked nor in the commit log), so they are read
and trained again after a restart (docs/streams.md). Once the passes are done the step runs to
its end: `optimizer.step()` and the commit record are never interrupted. The stop checkpoint
then covers the last committed step and is written at once, not after a step that can take a
minute on a busy CPU.

Under torchrun (several ranks) a step is not abandoned: the other ranks wait for this one in
their collectives.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class StepAbandoned(Exception):
    """Raised inside a pass of a step that the stop abandons."""


@dataclass
class Abandonment:
    abandoned: bool = False
    """True when the step was abandoned (its gradients are discarded)."""


@contextmanager
def abandon_on_stop(
    stop: threading.Event, model: nn.Module, optimizer: Any, enabled: bool = True
) -> Iterator[Abandonment]:
    """While inside, every module call of `model` raises `StepAbandoned` once `stop` is set,
    and so does the backward of every decoder layer (each module of an `nn.ModuleList`); the
    exception ends the block, `optimizer`'s gradients are discarded and the yielded
    `Abandonment` says so. `enabled` False: nothing is hooked."""
    outcome = Abandonment()
    if not enabled:
        yield outcome
        return

    def check(*_: Any) -> None:
        if stop.is_set():
            raise StepAbandoned

    def hook_backward(_module: nn.Module, _inputs: Any, output: Any) -> None:
        first = output[0] if isinstance(output, tuple) and output else output
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(check)

    layers = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    handles = [m.register_forward_pre_hook(check) for m in model.modules()]
    handles += [m.register_forward_hook(hook_backward) for m in layers]
    try:
        yield outcome
    except StepAbandoned:
        outcome.abandoned = True
        optimizer.zero_grad(set_to_none=True)
    finally:
        for handle in handles:
            handle.remove()
