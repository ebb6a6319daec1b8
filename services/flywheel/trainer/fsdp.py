"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the trainer: parameters, gradients and AdamW
state sharded over the ranks (`trainer.distributed.strategy = "fsdp2"`).

Layout: every decoder layer is its own FSDP unit; the root unit is `ShardedPolicy`, a module
that holds the Hugging Face model and runs the whole selected-token logprob computation
(decoder + the fused chunked head of logprobs.py) inside its forward. The head reads the lm-head
weight directly (never the (B, T, V) logits), so it must run while the root's parameters
(embeddings, final norm, lm head, tied or not) are unsharded: inside the root's forward. Its
outputs carry FSDP's pre-backward hooks, so the same parameters are gathered again for the
head's backward.

Gradients are summed over ranks, not averaged (divide factor 1, SUM-only collectives): each rank's
loss already uses the whole batch's normalizer (BUG-14), exactly as with the all-reduce path.
FSDP2 issues collectives in every forward and backward, so all ranks must run the same number
of passes: a rank with fewer micro-batches (or an empty one) runs `null_pass`es (a two-token
forward with a zero loss) until the counts match, and only the last pass reduce-scatters.

Loading: fsdp_load.py builds the model on the meta device, shards it with `shard_policy` and
has each rank read only its shards from the safetensors; the KL reference is a second,
frozen root sharded the same way (no rank holds a whole copy of either).

Works on CPU with gloo (tested at world size 2 against one process) and on CUDA with NCCL.
Not combined with LoRA, the distributed weight push, or algorithm parts that run their own
forward through the model (token-weight scoring passes, top-k regularizers); the settings
refuse those combinations.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeGuard, cast

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from flywheel.trainer.logprobs import TokenLogprobs, selected_token_logprobs


class ShardedPolicy(torch.nn.Module):
    """The FSDP2 root: `policy` (a causal LM) and its selected-token logprobs in one forward."""

    def __init__(self, policy: PreTrainedModel):
        super().__init__()
        self.policy = policy

    def forward(
        self,
        input_ids_BT: Tensor,
        attention_mask_BT: Tensor,
        temperature_B: Tensor,
        score_mask_BT: Tensor,
        chunk_tokens: int = 1024,
        packed: bool = False,
        shared_prefix: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """(logprobs_BT, entropy_BT) as `selected_token_logprobs` (a tuple, so FSDP can hook
        the outputs)."""
        out = selected_token_logprobs(
            self.policy,
            input_ids_BT,
            attention_mask_BT,
            temperature_B,
            score_mask_BT,
            chunk_tokens=chunk_tokens,
            packed=packed,
            shared_prefix=shared_prefix,
        )
        return out.logprobs_BT, out.entropy_BT


def shard_policy(model: PreTrainedModel, reshard_root_after_forward: bool = False) -> ShardedPolicy:
    """Shard `model` in place over the default process group and return the FSDP2 root.

    Call on every rank after the process group is up, with the same weights loaded or with
    parameters on the meta device (fsdp_load.py then gives each rank storage for its shards);
    build the optimizer afterwards (its parameters are the sharded DTensors).
    `reshard_root_after_forward`: free the root's gathered parameters (embeddings, norm, head)
    after each forward, for a frozen model no backward follows (the KL reference); a trained
    root keeps them for its backward.

    Raises:
        ValueError: the model has no `base_model.layers` (decoder layers) to shard.
    """
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no base_model.layers to shard")
    for layer in layers:
        fully_shard(layer)
    root = ShardedPolicy(model)
    fully_shard(root, reshard_after_forward=True if reshard_root_after_forward else None)
    for unit in root.modules():  # per unit: these setters do not recurse
        if isinstance(unit, FSDPModule):
            # sum over ranks (the loss holds the global normalizer); plain SUM collectives,
            # since gloo has no PREMUL_SUM
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    return root


def sharded_logprobs(root: ShardedPolicy, *args, **kwargs) -> TokenLogprobs:
    """`ShardedPolicy` forward as `TokenLogprobs`."""
    logprobs_BT, entropy_BT = root(*args, **kwargs)
    return TokenLogprobs(logprobs_BT=logprobs_BT, entropy_BT=entropy_BT)


def null_pass(root: ShardedPolicy, reference: torch.nn.Module | None = None) -> None:
    """A forward + backward that adds exactly zero to every gradient: keeps this rank's FSDP
    collectives matched with ranks that still have micro-batches. A sharded `reference` (the
    KL reference, whose forwards are collectives too) runs its no-grad forward first, as in a
    real micro-batch (step.py)."""
    device = next(root.parameters()).device
    ids_BT = torch.zeros(1, 2, dtype=torch.int64, device=device)
    args = (ids_BT, torch.ones_like(ids_BT), torch.ones(1, device=device))
    score_BT = torch.tensor([[False, True]], device=device)
    if is_sharded(reference):
        with torch.no_grad():
            reference(*args, score_BT)
    logprobs_BT, entropy_BT = root(*args, score_BT)
    (0.0 * (logprobs_BT.sum() + entropy_BT.sum())).backward()


def set_gradient_sync(root: torch.nn.Module, sync: bool) -> None:
    """Reduce-scatter gradients at the next backward (`sync`) or keep accumulating locally."""
    if isinstance(root, FSDPModule):
        root.set_requires_gradient_sync(sync)


def full_value(x: Tensor | float) -> float:
    """A scalar that may be a DTensor (e.g. clip_grad_norm_ of sharded grads) as a float."""
    if isinstance(x, DTensor):
        x = x.full_tensor()
    return float(x)


def full_state_dict(model: PreTrainedModel) -> dict[str, Tensor]:
    """Every rank: the full, unsharded CPU state dict of `model` under its own names (tied
    names share one tensor, as in the unsharded model). Collective: all ranks call it, in the
    same order of parameters."""
    out: dict[str, Tensor] = {}
    gathered: dict[int, Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        key = id(value)
        if key not in gathered:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            gathered[key] = full.detach().cpu()
        out[name] = gathered[key]
    return out


def is_sharded(model: torch.nn.Module | None) -> TypeGuard[ShardedPolicy]:
    return isinstance(model, ShardedPolicy)


class ShardedCheckpointer:
    """Full checkpoints of the FSDP2 model and AdamW state, sharded: every rank writes its own
    shards with `torch.distributed.checkpoint` (no gather of AdamW to rank 0) under
    `<root>/sharded/step_<8 digits>/` (`__<rank>_0.distcp` files and a `.metadata` index the
    coordinator writes last, so a folder with `.metadata` is complete).

    `save` is `dcp.async_save`: the shards are copied to CPU memory before it returns (training
    may change the parameters at once) and written in a background thread over a gloo group of
    their own, so the writes never interleave with FSDP's collectives. A later `save`, `wait` or
    `load` waits for the write in flight. Collective: every rank builds it in the same order and
    calls `save` / `load` for the same steps.
    """

    def __init__(self, root: Path, trained: torch.nn.Module, optimizer: torch.optim.Optimizer):
        import torch.distributed as dist  # noqa: PLC0415

        self.root = root / "sharded"
        self.trained = trained
        self.optimizer = optimizer
        self.group = dist.new_group(backend="gloo")
        self.pending: Future[Any] | None = None

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def complete(self, step: int) -> bool:
        """The shards of `step` are all written (their `.metadata` exists)."""
        return (self.path_for(step) / ".metadata").is_file()

    def save(self, step: int, with_optimizer: bool = True) -> Future[Any]:
        """Stage this rank's shards of the model (and AdamW when `with_optimizer`) and write them
        in the background; the future is done when every rank's shards are on disk."""
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        self.wait()
        model_state, optim_state = get_state_dict(self.trained, self.optimizer)
        state: dict[str, Any] = {"model": model_state}
        if with_optimizer:
            state["optim"] = optim_state
        self.pending = cast(
            "Future[Any]",
            dcp.async_save(state, checkpoint_id=self.path_for(step), process_group=self.group),
        )
        return self.pending

    def wait(self) -> None:
        """Block until the write in flight (if any) is done; raises its error."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def load(self, step: int) -> bool:
        """Load this rank's shards of `step` into the model and (when saved) AdamW; False when
        the step has no complete sharded checkpoint (nothing changed)."""
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        self.wait()
        path = self.path_for(step)
        if not self.complete(step):
            return False
        model_state, optim_state = get_state_dict(self.trained, self.optimizer)
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata.keys()
        with_optimizer = any(k.startswith("optim.") for k in keys)
        state: dict[str, Any] = {"model": model_state}
        if with_optimizer:
            state["optim"] = optim_state
        dcp.load(state, checkpoint_id=path, process_group=self.group)
        set_state_dict(
            self.trained,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
        )
        return with_optimizer

    def prune(self, keep: set[int]) -> None:
        """Delete the sharded checkpoints of steps not in `keep` (rank 0, after a save)."""
        import shutil  # noqa: PLC0415

        if not self.root.is_dir():
            return
        for folder in self.root.glob("step_*"):
            if int(folder.name.removeprefix("step_")) not in keep:
                shutil.rmtree(folder, ignore_errors=True)


def load_full_optimizer_state(
    trained: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Shard a full AdamW state dict (`training/optimizer.pt` of a checkpoint written before
    checkpoints were sharded) onto this rank's optimizer. Collective: every rank calls it; rank
    0's `state` is broadcast (the other ranks' may be empty)."""
    set_optimizer_state_dict(
        trained,
        optimizer,
        state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
