"""Data-parallel training under `torchrun`: one stream consumer (rank 0) feeding every rank.

    torchrun --nproc_per_node N -m flywheel.trainer --config flywheel.toml

Layout: rank 0 runs the whole service (source, groups, staleness, checkpoints, weight push,
acks, HTTP, metrics); before each step it broadcasts the step's serialized Samples and their
staleness treatments to the other ranks (`broadcast_object_list`), and at the end a stop. Every
rank builds the same batch (preparation is deterministic), takes rows rank, rank + N, ... of it,
and accumulates gradients over its micro-batches with the step-wide normalizer of the whole
batch (token and sequence counts are global, BUG-14). The gradients are then summed across ranks
(below), so every rank holds exactly the full-batch gradient (or its shard of it) and takes
the same AdamW step: the weights stay identical without broadcasting them. A non-finite loss on
any rank skips the step on all ranks (the flag is all-reduced first, so collectives stay
matched).

Two strategies (`trainer.distributed.strategy`):
- `all_reduce` (default): every rank holds the whole model; after the micro-batches the
  gradients are summed with one all-reduce per parameter (the DDP update). Ranks may run
  different numbers of micro-batches (token budgets, empty shards), which DDP's per-backward
  hooks could not match.
- `fsdp2`: `torch.distributed.fsdp.fully_shard` per decoder layer plus a root that runs the
  chunked logprob head (fsdp.py), built on the meta device with each rank loading only its
  shards, the KL reference sharded too (fsdp_load.py); parameters, gradients and AdamW state
  are sharded, gradients reduce-scattered (summed) in the last backward, ranks with fewer
  micro-batches run zero-loss passes so FSDP's collectives match; every rank gathers the full
  weights (and AdamW state) after a committed step for rank 0's checkpoint. FSDP2 runs on CPU
  with gloo in torch 2.13 (only SUM reductions: gloo has no PREMUL_SUM), so both strategies
  are tested at world size 2 on CPU against one process.

Every metric is global: loss terms, micro-batch counts and token statistics (sums, maxima,
minima, token counts) are reduced over ranks; batch-level counts come from the whole batch,
which every rank builds. Backend: nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from flywheel.trainer.batch import TrainBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    rank: int
    size: int

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, batch: TrainBatch) -> TrainBatch:
        """Rows rank, rank + size, ... of `batch` (may be empty)."""
        return batch.select(torch.arange(self.rank, batch.size, self.size))

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any rank."""
        value = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def sum_values(self, values: dict[str, float]) -> dict[str, float]:
        """Sum of each value over ranks; a key missing on a rank counts as 0 there."""
        return self.reduce_values(values, "sum")

    def reduce_values(self, values: dict[str, float], op: str) -> dict[str, float]:
        """`op` (sum, max, min) of each value over ranks, for the union of the ranks' keys; a
        key missing on a rank counts as the op's identity there (0, -inf, +inf)."""
        gathered: list[list[str]] = [[] for _ in range(self.size)]
        dist.all_gather_object(gathered, sorted(values))
        keys = sorted({k for rank_keys in gathered for k in rank_keys})
        identity = {"sum": 0.0, "max": -math.inf, "min": math.inf}[op]
        tensor = torch.tensor([values.get(k, identity) for k in keys], dtype=torch.float64)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[
            op
        ]
        dist.all_reduce(tensor, op=reduce_op)
        return dict(zip(keys, tensor.tolist(), strict=True))

    def max_int(self, value: int) -> int:
        """The largest `value` over ranks."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """grad = sum over ranks of grad (a missing grad counts as zeros)."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)

    def broadcast(self, payload: Any) -> Any:
        """Rank 0's `payload`, on every rank."""
        box = [payload]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_world() -> World | None:
    """Join the process group when started by torchrun with WORLD_SIZE > 1; else None."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return None
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend)
    world = World(dist.get_rank(), dist.get_world_size())
    log.info("rank %d of %d (%s)", world.rank, world.size, backend)
    return world


def close_world(world: World | None) -> None:
    if world is not None and dist.is_initialized():
        dist.destroy_process_group()


def exit_distributed(code: int) -> NoReturn:
    """End a torchrun rank without interpreter finalization (after `close_world`).

    The process group can outlive `destroy_process_group` (FSDP2's device mesh keeps a
    reference), and gloo's worker threads torn down during finalization abort the process
    (SIGABRT, "terminate called without an active exception") now and then, which torchrun
    reports as a failed run. Logs and standard streams are flushed first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
