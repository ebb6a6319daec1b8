"""Loading a policy straight into FSDP2 shards, so that no rank holds the whole fp32 model.

The model is built from its `config.json` with its parameters on the meta device (no storage;
buffers such as the rotary frequencies are computed for real), tied as the config says, and
sharded with `fully_shard` (fsdp.py's layout). Only then does each parameter get storage, and
only for this rank's shard (`to_empty`), which is filled from the model folder's safetensors:

- `per_rank` (a folder whose tensor names are the model's parameter names, as `save_pretrained`
  writes them: Hugging Face checkpoints and the trainer's own): `torch.distributed.checkpoint`
  with its `HuggingFaceStorageReader`; every rank reads only the rows of its own shards (slices
  of the files, never a whole tensor). Peak memory per rank: about 1/N of the model.
- `rank0` (a folder with other names, e.g. a format transformers converts on load): rank 0
  loads the whole model with `from_pretrained` and `set_model_state_dict(full_state_dict=True,
  broadcast_from_rank0=True)` broadcasts it tensor by tensor, every rank keeping its shard. Rank 0
  holds the full model once; the others one tensor at a time.

Values are converted to float32 on load (a bf16 file gives the same fp32 weights as
`from_pretrained(dtype=float32)`). Tied embeddings (`tie_word_embeddings`): `lm_head.weight` is
the embedding parameter, sharded once and read under the name the file has (the embedding's).

The frozen KL reference is loaded the same way (`frozen=True`): a root of its own whose
parameters stay sharded between forwards (its root reshards after its forward too, since no
backward follows); its forwards are collectives, so ranks must run as many of them (step.py).

Measured in bench/fsdp_memory.py (the old way: the whole model on every rank, then sharded).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from flywheel.trainer.fsdp import ShardedPolicy, shard_policy
from flywheel.trainer.weights import recompute_activations

log = logging.getLogger(__name__)

LoadWay = Literal["auto", "per_rank", "rank0"]


def empty_model(path: Path) -> PreTrainedModel:
    """The causal LM of `path`'s config.json in float32 with every parameter on the meta device
    (no storage) and real buffers (computed at construction, e.g. rotary `inv_freq`), its
    embeddings tied as the config says, its generation_config.json (when there is one) read as
    `from_pretrained` does, in train mode.

    Raises:
        OSError: `path` has no readable config.json.
    """
    from accelerate import init_empty_weights  # noqa: PLC0415

    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # the meta parameters are new objects: tie them again
    with contextlib.suppress(OSError):  # as from_pretrained: checkpoints write it back
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.train()
    return model


def materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter (after `fully_shard`: this rank's shard only) uninitialized
    storage on `device`; buffers keep their values (moved to `device`)."""
    buffers = {name: value.detach().clone() for name, value in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)


def file_tensor_names(path: Path) -> set[str]:
    """The tensor names of every `*.safetensors` file in `path` (headers only)."""
    from safetensors import safe_open  # noqa: PLC0415

    names: set[str] = set()
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def loadable_state(model: PreTrainedModel, names: set[str]) -> tuple[dict[str, Tensor], list[str]]:
    """(the tensors to fill, keyed by their names in the file; the model's tensors the file
    lacks). A tied parameter appears once, under whichever of its names the file has."""
    by_tensor: dict[int, list[str]] = {}
    values: dict[int, Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(value), []).append(name)
        values[id(value)] = value
    state: dict[str, Tensor] = {}
    missing: list[str] = []
    for key, aliases in by_tensor.items():
        present = [a for a in aliases if a in names]
        if present:
            state[present[0]] = values[key].detach()
        else:
            missing.append(aliases[0])
    return state, missing


def load_weights(model: PreTrainedModel, path: Path, way: LoadWay = "auto") -> str:
    """Fill the materialized shards of `model` (sharded with `fully_shard`, see `materialize`)
    with the weights of the model folder `path`; returns the way used (`per_rank`, `rank0`).

    `auto` = `per_rank` when the folder's safetensors hold every parameter under its own name
    (decided on rank 0, broadcast), else `rank0`. Collective: every rank calls it.

    Raises:
        ValueError: `way = "per_rank"` and the files lack some of the model's parameters.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader  # noqa: PLC0415
    from torch.distributed.checkpoint import load as dcp_load  # noqa: PLC0415

    state, missing = loadable_state(model, file_tensor_names(path))
    if way == "per_rank" and missing:
        raise ValueError(f"{path} has no tensors named {missing[:5]}: load it with way='rank0'")
    if way == "auto":
        box: list[object] = ["rank0" if missing else "per_rank"]
        dist.broadcast_object_list(box, src=0)
        way = "rank0" if box[0] == "rank0" else "per_rank"
        if way == "rank0":
            log.info("%s names tensors differently (%s ...): loading on rank 0", path, missing[:3])
    if way == "per_rank":
        dcp_load(state, storage_reader=HuggingFaceStorageReader(str(path)))
        return way
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        StateDictOptions,
        set_model_state_dict,
    )

    from flywheel.trainer.weights import load_model  # noqa: PLC0415

    full = load_model(path).state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    return way


def load_sharded_policy(
    path: Path,
    device: torch.device,
    *,
    frozen: bool = False,
    gradient_checkpointing: bool = False,
    way: LoadWay = "auto",
) -> tuple[PreTrainedModel, ShardedPolicy]:
    """The causal LM of the model folder `path`, FSDP2-sharded over the default process group
    without ever being whole on a rank: (the Hugging Face model, its `ShardedPolicy` root).

    Args:
        path: a model folder (config.json and *.safetensors).
        device: where this rank's shards live.
        frozen: a frozen reference (no grad, eval mode, its root resharded after forward).
        gradient_checkpointing: enable it before sharding (as the trained policy does).
        way: see `load_weights`.

    Collective: every rank calls it, in the same order as its other FSDP2 loads.

    Raises:
        ValueError: the model has no decoder layers to shard; see `load_weights`.
    """
    model = empty_model(path)
    if gradient_checkpointing:
        recompute_activations(model)
    if frozen:
        model.requires_grad_(False).eval()
    root = shard_policy(model, reshard_root_after_forward=frozen)
    materialize(root, device)
    how = load_weights(model, path, way)
    log.info(
        "%s loaded into FSDP2 shards (%s) from %s", "reference" if frozen else "policy", how, path
    )
    return model, root
