"""The model and tokenizer behind the engine: loading, forward passes, in-place weight updates.

The decoder and the output projection are called separately, so logits are computed only for
the positions that need them (the last position of each row, plus the scored prompt positions of
requests that ask for input logprobs), never for a whole (B, T, V) block.

Weight updates (`read_checkpoint` + `prepare` + `apply_weights`) validate every key and shape of a
safetensors checkpoint against the live model before anything changes, so an incompatible
checkpoint leaves the served weights untouched; the new tensors are read and converted off the
decode loop (`prepare`), and the swap between two decode steps only replaces references.
Tied embeddings: a checkpoint may omit `lm_head.weight`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class CheckpointError(ValueError):
    """A checkpoint does not match the served model (the message says how)."""


class ModelRunner:
    """Owns one causal LM; used only from the engine's worker thread (except shape checks)."""

    def __init__(self, model_path: Path, dtype: str = "float32", device: str = "auto"):
        self.model_path = Path(model_path)
        self.device = pick_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=_DTYPES[dtype])
        self.model.to(self.device)  # type: ignore[arg-type]  # typed as Module.to via @wraps
        self.model.eval()
        self.config = self.model.config
        self.decoder = getattr(self.model, self.model.base_model_prefix)
        self.head = self.model.get_output_embeddings()
        if getattr(self.config, "final_logit_softcapping", None):
            raise ValueError("models with final logit soft-capping are not supported")
        self.vocab_size = int(self.config.vocab_size)
        self.eos_ids = frozenset(self._eos_ids())
        self.pad_id = next(iter(sorted(self.eos_ids)), 0)
        self._shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        self._tied = bool(getattr(self.config, "tie_word_embeddings", False))

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        try:
            gen = GenerationConfig.from_pretrained(self.model_path)
        except OSError:
            gen = None
        self.generation_defaults: dict[str, Any] = {
            key: getattr(gen, key)
            for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if gen is not None and key in gen.to_diff_dict()
        }
        """Sampling fields the model's generation_config.json sets (SGLang's chat defaults)."""
        eos = getattr(gen, "eos_token_id", None)
        if eos is not None:
            ids.update(int(e) for e in ([eos] if isinstance(eos, int) else eos))
        return ids

    @property
    def model_type(self) -> str:
        return str(getattr(self.config, "model_type", ""))

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.config, "architectures", None) or [type(self.model).__name__])

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def hidden(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, cache: DynamicCache
    ) -> Tensor:
        """Last hidden states (B, T, H) for new tokens (B, T); extends `cache` in place."""
        out = self.decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
        return out.last_hidden_state

    def logits(self, hidden: Tensor) -> Tensor:
        """Float32 logits (..., V) of hidden states (..., H)."""
        return self.head(hidden).float()

    # -- weights ---------------------------------------------------------------------------------

    def read_checkpoint(self, path: Path) -> dict[str, Tensor]:
        """Load a safetensors checkpoint (folder or file) and check it fits the served model.

        Raises:
            CheckpointError: missing folder/files, unknown or missing keys, or shape mismatches.
        """
        files = _safetensors_files(Path(path))
        state: dict[str, Tensor] = {}
        for f in files:
            try:
                state.update(_read_tensors(f))
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read {f}: {e}") from e
        self.validate(state, f"checkpoint {path}")
        return state

    def validate(self, state: dict[str, Tensor], source: str, *, complete: bool = True) -> None:
        """Check names and shapes of `state` against the served model.

        Args:
            state: parameter name -> tensor.
            source: what the tensors came from (for the message).
            complete: every parameter must be present (a disk checkpoint); False for partial
                (distributed) updates. A tied `lm_head.weight` is never required.

        Raises:
            CheckpointError: unknown or missing names, or shape mismatches.
        """
        path = source
        unknown = sorted(set(state) - set(self._shapes))
        missing = sorted(set(self._shapes) - set(state)) if complete else []
        if self._tied and "lm_head.weight" in missing:
            missing.remove("lm_head.weight")
        wrong = [
            f"{k}: {tuple(v.shape)} != {self._shapes[k]}"
            for k, v in state.items()
            if k in self._shapes and tuple(v.shape) != self._shapes[k]
        ]
        problems = []
        if unknown:
            problems.append(f"unknown keys {unknown[:5]}")
        if missing:
            problems.append(f"missing keys {missing[:5]}")
        if wrong:
            problems.append(f"shape mismatches {wrong[:5]}")
        if problems:
            raise CheckpointError(f"{path} does not fit the served model: " + "; ".join(problems))

    @torch.no_grad()
    def prepare(self, state: dict[str, Tensor], *, owned: bool = False) -> dict[str, Tensor]:
        """A validated (possibly partial) state dict in the live tensors' dtype, device and
        layout, ready for `apply_weights` (run it off the decode loop).

        Args:
            owned: the tensors are private buffers handed over to the engine (`read_checkpoint`'s
                reads): one already in the live dtype, device and layout is taken as it is, so
                a swap holds two copies of the weights (served and new), not three. False (a
                caller's buffers, which it could still write): fresh copies of every tensor.

        Raises:
            KeyError: a name the model does not have (call `validate` first).
        """
        live = self._live()
        out = {}
        for name, t in state.items():
            old = live[name]
            if owned and t.dtype == old.dtype and t.device == old.device and t.is_contiguous():
                out[name] = t
            else:
                fresh = torch.empty_like(old, memory_format=torch.contiguous_format)
                out[name] = fresh.copy_(t)
        return out

    @torch.no_grad()
    def apply_weights(self, state: dict[str, Tensor]) -> None:
        """Make the tensors of a validated (possibly partial) state dict the live weights.

        Tensors already in the live dtype/device/layout (`prepare`'s output) are swapped in
        by reference (`param.data = tensor`, no copy: the decode loop only waits for the
        swap); others are converted first. The parameter objects stay, so tied embeddings
        share one tensor and updating either name updates both roles (with both names given,
        the model's later name wins, as in `load_state_dict`).

        Raises:
            KeyError: a name the model does not have (call `validate` first).
        """
        live = self._live()
        owners = self._owners()
        for name in [n for n in owners if n in state]:
            module, attr = owners[name]
            old, new = live[name], state[name]
            if new.dtype != old.dtype or new.device != old.device or not new.is_contiguous():
                new = new.to(device=old.device, dtype=old.dtype).contiguous()
            if attr in module._parameters:
                param = module._parameters[attr]
                assert param is not None
                param.data = new
            else:
                module._buffers[attr] = new

    def _live(self) -> dict[str, Tensor]:
        """State-dict name -> live tensor (tied aliases included)."""
        return dict(self.model.state_dict(keep_vars=True))

    def _owners(self) -> dict[str, tuple[torch.nn.Module, str]]:
        """State-dict name -> (module, attribute), in the model's order (tied aliases too)."""
        owners: dict[str, tuple[torch.nn.Module, str]] = {}
        for prefix, module in self.model.named_modules(remove_duplicate=False):
            for attr in [*module._parameters, *module._buffers]:
                owners[f"{prefix}.{attr}" if prefix else attr] = (module, attr)
        return owners

    def parameter(self, name: str) -> Tensor:
        """A parameter or buffer by its state-dict name (tied aliases included).

        Raises:
            KeyError: no such name.
        """
        params = dict(self.model.named_parameters(remove_duplicate=False))
        if name in params:
            return params[name]
        return dict(self.model.named_buffers())[name]

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self._shapes.get(name)


def pick_device(device: str = "auto") -> torch.device:
    """ "auto" = CUDA when a GPU is visible, else CPU; "cpu"/"cuda" force one.

    Raises:
        ValueError: "cuda" asked for on a machine without a CUDA device.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("engine.device is cuda but no CUDA device is visible; use auto or cpu")
    return torch.device(device)


def _read_tensors(file: Path) -> dict[str, Tensor]:
    """Every tensor of one safetensors file, read into private buffers (safetensors' `pread`
    backend) rather than mapped from the file, so they can become live weights (`prepare`
    with `owned`) and the file's pages are not held as well. A safetensors without the
    backend (before 0.8) maps the file; `prepare` then copies what it maps.

    Raises:
        SafetensorError, OSError: unreadable file.
    """
    try:
        return load_file(file, backend="pread")
    except TypeError:  # safetensors < 0.8: no `backend`
        return {name: t.clone() for name, t in load_file(file).items()}


def _safetensors_files(path: Path) -> list[Path]:
    if path.is_file() and path.suffix == ".safetensors":
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path} is neither a folder nor a .safetensors file")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():  # other *.safetensors (optimizer) are not weights
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {path}")
    return files
