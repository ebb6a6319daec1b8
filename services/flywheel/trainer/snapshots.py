"""Snapshots of the live weights and AdamW state for background writes, copied only when needed.

A checkpoint or a weight push is written in a background thread while the next step trains
(background.py), so it must not see the tensors change half-way. The optimizer step is the only
thing that changes them in place: the forward and backward passes of the next step only read
them. So a `DeferredSnapshot` keeps references to the live CPU tensors, and `SnapshotGuard`,
registered as a step pre-hook on the optimizer, copies every still-open snapshot ("freezes" it)
right before a step would change them. A write that ends before the next optimizer step (on a
CPU, where a step's forward and backward take far longer than writing 1.6 GB, always) thus costs
no copy at all: for SmolLM2-135M fp32 that is 538 MB per push and 1.6 GB per checkpoint (weights
and AdamW moments) the trainer no longer holds. A write overtaken by a step gets the copy made
right before that step, the same copy the trainer used to make at once, and is written again from
it before anything is published (`write_snapshot`): a torn file is never renamed into place.

Tensors that are not on the CPU, or are cast to another dtype (a bf16 push), are copied at
once, as before: only CPU tensors in their own dtype are deferred.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class SnapshotChanged(RuntimeError):
    """The live tensors changed while a deferred snapshot of them was written; the write was
    not published (`write_snapshot` writes it again from the copy made before the change)."""


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with every tensor inside dicts, lists and tuples replaced by `fn(tensor)`; the
    containers are new (so later changes to the originals' keys do not reach them)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _copier(dtype: torch.dtype | None, defer: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function copying tensors to the CPU (floating ones cast to `dtype` when given), each
    storage once so tied aliases stay shared; with `defer`, a CPU tensor already in the target
    dtype is returned as it is (a live reference)."""
    copies: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        if defer and tensor.device.type == "cpu" and tensor.dtype == cast:
            return tensor.detach()
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", dtype=cast, copy=True)
        return copies[key]

    return copy


def cpu_snapshot(
    state: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Copies of `state`'s tensors on the CPU (optionally cast to `dtype`) that later updates
    of the live tensors do not change. Tensors sharing storage (tied weights) stay shared.

    Args:
        state: name -> tensor (any device), e.g. `model.state_dict()`.
        dtype: cast floating-point tensors to this dtype; None keeps each tensor's dtype.
    """
    return dict(_map_tensors(state, _copier(dtype, defer=False)))


class DeferredSnapshot:
    """A snapshot of a tree of tensors (dicts, lists, tuples; e.g. a state dict and the AdamW
    state) that holds live references until `freeze` copies them. Made by `SnapshotGuard.take`.

    Thread-safe: the training thread freezes, a background thread reads and writes.
    """

    def __init__(self, tree: Any, dtype: torch.dtype | None = None):
        self._lock = threading.Lock()
        self._dtype = dtype
        self._tree: Any = _map_tensors(tree, _copier(dtype, defer=True))
        self.frozen = False
        """True once the tree holds copies only (after `freeze`)."""

    def freeze(self) -> None:
        """Copy the tensors still referenced live (before they change); no-op when frozen or
        released."""
        with self._lock:
            if not self.frozen and self._tree is not None:
                self._tree = _map_tensors(self._tree, _copier(self._dtype, defer=False))
                self.frozen = True

    def read(self) -> tuple[Any, Callable[[], bool]]:
        """(the tree as it is now, `intact`): `intact()`, called after the tree was written,
        is True when the tensors cannot have changed since this read (the tree was frozen
        already, or no freeze has happened since: no optimizer step began).

        Raises:
            RuntimeError: the snapshot was released.
        """
        with self._lock:
            if self._tree is None:
                raise RuntimeError("the snapshot was released")
            tree, frozen = self._tree, self.frozen

        def intact() -> bool:
            with self._lock:
                return frozen or not self.frozen

        return tree, intact

    def release(self) -> None:
        """Drop the tensors (copies are freed; a later freeze has nothing to copy)."""
        with self._lock:
            self._tree = None


class SnapshotGuard:
    """Freezes every open `DeferredSnapshot` it made right before `optimizer` steps (a step
    pre-hook), so a snapshot never sees a tensor changed by a step."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._open: weakref.WeakSet[DeferredSnapshot] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._hook = optimizer.register_step_pre_hook(self._before_step)

    def take(self, tree: Any, dtype: torch.dtype | None = None) -> DeferredSnapshot:
        """A deferred snapshot of `tree` (CPU tensors in `dtype` or their own by reference,
        others copied now, cast to `dtype` when given)."""
        snapshot = DeferredSnapshot(tree, dtype)
        with self._lock:
            self._open.add(snapshot)
        return snapshot

    def _before_step(self, *_: Any) -> None:
        with self._lock:
            open_now = list(self._open)
        for snapshot in open_now:
            snapshot.freeze()

    def close(self) -> None:
        """Remove the optimizer hook."""
        self._hook.remove()


def write_snapshot(snapshot: DeferredSnapshot, write: Callable[[Any, Callable[[], bool]], T]) -> T:
    """`write(tree, intact)` of the snapshot's tree, where `write` checks `intact()` after
    writing and before publishing and raises `SnapshotChanged` when it is False; then once
    more from the frozen copy. Releases the snapshot afterwards, written or not.

    Raises:
        whatever `write` raises (OSError: the disk refused), SnapshotChanged never.
    """
    try:
        tree, intact = snapshot.read()
        try:
            return write(tree, intact)
        except SnapshotChanged:
            snapshot.freeze()  # frozen before the step that changed the tensors began
            tree, intact = snapshot.read()
            return write(tree, intact)
    finally:
        snapshot.release()


def deferred_write(write: Callable[..., T]) -> Callable[[int, Any], T]:
    """The background pusher's `write(version, snapshot)` over `WeightsStore.write`: a
    `DeferredSnapshot` goes through `write_snapshot` (released once written), a dict of
    copies (`cpu_snapshot`) straight to `write`."""

    def write_version(version: int, snapshot: Any) -> T:
        if isinstance(snapshot, DeferredSnapshot):
            return write_snapshot(snapshot, lambda tree, intact: write(version, tree, intact))
        return write(version, snapshot)

    return write_version
