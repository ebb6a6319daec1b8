"""Policy weights: load or resume, atomic checkpoints, and the push to every engine.

Checkpoints are self-contained Hugging Face folders `checkpoint_dir/step_00000012/`: config,
`model.safetensors` (fp32; a tied lm_head is stored once, as the embedding), the tokenizer files
copied from the initial model folder, and `trainer_state.json` (step, weight_version, and the
stream entries the step trained on). Each is written to a hidden temporary sibling, verified
(every parameter present with its shape and dtype, BUG-17), then renamed into place, so an engine
or a resuming trainer never sees a partial folder. The newest `keep` folders are kept.

Weight version = the number of committed optimizer steps: the initial model is version 0, the
checkpoint of step k is pushed as weight_version "k".
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors import safe_open
from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)
from transformers import AutoModelForCausalLM, PreTrainedModel

from flywheel.core.errors import ContractError, UpstreamError

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_NOT_COPIED = re.compile(r"(\.safetensors|\.bin|\.pt|\.gguf|\.index\.json|\.lock)$")
"""Files of the initial folder not copied into checkpoints (weights, indexes, locks)."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]
    """Contents of trainer_state.json."""


def resolve_device(name: str) -> torch.device:
    """`auto` = cuda when available, else cpu; anything else is passed to torch."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(path: Path, device: str = "cpu") -> PreTrainedModel:
    """A causal LM in float32 on `device`, in train mode (Llama-family models have no active
    dropout)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.to(resolve_device(device))
    model.train()
    return model


class CheckpointStore:
    """Atomic step checkpoints in one folder.

    Args:
        root: the checkpoint folder (shared with the engines).
        keep: newest checkpoints kept on disk.
        source_dir: the initial model folder, whose tokenizer files each checkpoint copies.
    """

    def __init__(self, root: Path, keep: int, source_dir: Path):
        self.root = Path(root)
        self.keep = keep
        self.source_dir = Path(source_dir)

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint, or None."""
        steps = sorted(self._steps(), reverse=True)
        for step in steps:
            path = self.path_for(step)
            if (path / STATE_FILE).is_file() and (path / WEIGHTS_FILE).is_file():
                state = json.loads((path / STATE_FILE).read_text())
                return Checkpoint(path=path, step=step, state=state)
        return None

    def save(self, model: PreTrainedModel, step: int, state: dict[str, Any]) -> Path:
        """Write, verify and atomically publish the checkpoint of `step`; prune old ones."""
        final = self.path_for(step)
        tmp = self.root / f".{final.name}.tmp-{os.getpid()}"
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        self._copy_tokenizer(tmp)
        verify_checkpoint(tmp, model)
        full_state = {"step": step, "weight_version": str(step), "saved_at": time.time()} | state
        (tmp / STATE_FILE).write_text(json.dumps(full_state))
        if final.exists():  # a step re-run after a crash before its ack: replace it whole
            shutil.rmtree(final)
        tmp.rename(final)
        self.prune()
        return final

    def prune(self) -> None:
        """Delete all but the newest `keep` checkpoints, and leftover temporary folders."""
        for step in sorted(self._steps(), reverse=True)[self.keep :]:
            shutil.rmtree(self.path_for(step), ignore_errors=True)
        for leftover in self.root.glob(".step_*.tmp-*"):
            if not leftover.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(leftover, ignore_errors=True)

    def _steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return [int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name))]

    def _copy_tokenizer(self, dest: Path) -> None:
        if not self.source_dir.is_dir():
            return
        for src in self.source_dir.iterdir():
            target = dest / src.name
            if src.is_file() and not _NOT_COPIED.search(src.name) and not target.exists():
                shutil.copy2(src, target)


def verify_checkpoint(path: Path, model: PreTrainedModel) -> None:
    """Every parameter of `model` is in `path/model.safetensors` with its shape and dtype, or is
    a tied alias (same storage) of one that is.

    Raises:
        ContractError: a tensor is missing, or has another shape or dtype.
    """
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        saved = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
        shapes = {name: list(s.get_shape()) for name, s in saved.items()}
        dtypes = {name: s.get_dtype() for name, s in saved.items()}
    state = model.state_dict()
    saved_ptrs = {state[n].data_ptr() for n in shapes if n in state}
    for name, tensor in state.items():
        if name not in shapes:
            if tensor.data_ptr() in saved_ptrs:
                continue  # tied alias, e.g. lm_head.weight of a tied-embedding model
            raise ContractError(f"checkpoint {path} lacks tensor {name}")
        if shapes[name] != list(tensor.shape) or dtypes[name] != "F32":
            raise ContractError(
                f"checkpoint {path}: {name} is {dtypes[name]}{shapes[name]}, the model has "
                f"F32{list(tensor.shape)}"
            )


class WeightPusher:
    """Loads a checkpoint into every engine with SGLang's `/update_weights_from_disk`.

    `flush_cache` is on (no stale prefix cache, BUG-15) and in-flight requests are not aborted
    (BUG-16). Each engine gets `attempts` tries with exponential backoff and jitter; then
    `UpstreamError` is raised.

    Args:
        engine_urls: engine base URLs.
        timeout_s: seconds for one call (an engine finishes in-flight requests first).
        attempts: tries per engine.
        client: an httpx client (tests inject a mock transport).
        backoff_s: first retry delay in seconds (doubles, capped at 30 s).
    """

    def __init__(
        self,
        engine_urls: list[str],
        *,
        timeout_s: float,
        attempts: int,
        client: httpx.Client | None = None,
        backoff_s: float = 1.0,
    ):
        self.engine_urls = engine_urls
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.client = client or httpx.Client()
        self.backoff_s = backoff_s

    def push(self, model_path: Path, version: int) -> None:
        """Push to every engine in turn.

        Raises:
            UpstreamError: an engine failed `attempts` times.
        """
        backoff = wait_exponential(multiplier=self.backoff_s, max=30.0)
        jitter = wait_random(0, self.backoff_s)
        for url in self.engine_urls:
            retrying = Retrying(
                stop=stop_after_attempt(self.attempts),
                wait=backoff + jitter,
                retry=retry_if_exception_type((httpx.HTTPError, UpstreamError)),
                reraise=True,
            )
            for attempt in retrying:
                with attempt:
                    self._push_one(url, model_path, version)

    def _push_one(self, url: str, model_path: Path, version: int) -> None:
        body = {
            "model_path": str(Path(model_path).resolve()),
            "weight_version": str(version),
            "flush_cache": True,
            "abort_all_requests": False,
        }
        response = self.client.post(
            f"{url.rstrip('/')}/update_weights_from_disk", json=body, timeout=self.timeout_s
        )
        try:
            reply = response.json()
        except ValueError:
            reply = {"message": response.text[:200]}
        if response.status_code != 200 or not reply.get("success"):
            log.warning(
                "weight push of version %s to %s failed: HTTP %s %s",
                version, url, response.status_code, reply.get("message"),
            )
            raise UpstreamError(
                f"engine {url} refused weights {model_path} (version {version}): HTTP "
                f"{response.status_code} {reply.get('message')!r}. Check the engine log."
            )
        log.info("engine %s now serves weight_version %s", url, version)

    def close(self) -> None:
        self.client.close()
