"""Policy weights: load or resume, atomic checkpoints, pushed weights, and the push to every
engine.

Checkpoints are self-contained Hugging Face folders `checkpoint_dir/step_00000012/`: config,
`model.safetensors` (fp32; a tied lm_head is stored once, as the embedding; LoRA adapters merged
in), the tokenizer files copied from the initial model folder, `trainer_state.json` (step,
weight_version, the stream entries and sample_ids the step trained on, the source position) and
`training/` (AdamW state, LR scheduler state and RNG states, `torch.save` files; only the newest
checkpoint keeps `optimizer.pt`, the largest). Engines read the top-level safetensors only;
`export.export_hf` copies a plain folder without the trainer's files. Each checkpoint is written
to a hidden temporary sibling, verified (every parameter present with its shape and dtype,
BUG-17), then renamed into place, so an engine or a resuming trainer never sees a partial
folder. The newest `keep` folders are kept, and always the one just saved.

Pushed weights are separate from checkpoints (`WeightsStore`): `checkpoint_dir/weights/
v_00000012/` holds `model.safetensors` in the engine's dtype (no AdamW state), `config.json` and
the tokenizer files, written from a CPU snapshot of step 12's weights, atomically (temporary
sibling, then rename); the newest `keep` versions are kept, and always the one just written.
Folders numbered above the step a trainer resumes from are deleted when it starts (folders.py).

Weight version = the number of committed optimizer steps: the initial model is version 0, the
weights of step k are pushed as weight_version "k". Versions never go backwards on an engine:
an engine that already serves version >= k (asked with `/model_info`) is not given k, which is
what a trainer resumed from an older checkpoint meets while it trains the recorded steps after
that checkpoint again (commits.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random,
)
from transformers import AutoModelForCausalLM, PreTrainedModel

from flywheel.core.errors import ContractError, UpstreamError
from flywheel.core.versions import parse_weight_version
from flywheel.trainer.fleet_push import FleetWatcher, push_each
from flywheel.trainer.folders import drop_above
from flywheel.trainer.snapshots import SnapshotChanged

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
TRAINING_DIR = "training"
"""Subfolder with optimizer.pt, scheduler.pt and rng.pt (resume state, not served)."""
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_VERSION_DIR = re.compile(r"^v_(\d{8,})$")
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
    # transformers annotates `to` through a decorator that mypy reads as taking a model
    model.to(resolve_device(device))  # type: ignore[arg-type]
    model.train()
    return model


def recompute_activations(model: PreTrainedModel) -> None:
    """Turn on per-layer activation checkpointing (transformers' `activation_checkpointing_enable`,
    `gradient_checkpointing_enable` before 5.x): decoder activations are recomputed in backward
    instead of kept. It also turns the KV cache off in training (see
    `TrainerSettings._layout_with_checkpointing`)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()


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

    def save(
        self,
        model: PreTrainedModel,
        step: int,
        state: dict[str, Any],
        training: dict[str, Any] | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        intact: Callable[[], bool] = lambda: True,
    ) -> Path:
        """Write, verify and atomically publish the checkpoint of `step`; prune old ones.

        Args:
            model: the policy (a peft model is saved with its adapters merged).
            step: the committed optimizer step (= weight version).
            state: JSON-serializable trainer state (entry ids, sample ids, source position).
            training: objects saved with torch.save under `training/<name>.pt` (optimizer,
                scheduler, rng); None = none.
            state_dict: the full weights to save instead of the model's own (FSDP2 gathers
                them from the shards); None = the model's.
            intact: asked once the files are written, before they are published: False (the
                tensors may have changed meanwhile, snapshots.py) publishes nothing.

        Raises:
            SnapshotChanged: `intact()` was False.
        """
        final = self.path_for(step)
        tmp = self.root / f".{final.name}.tmp-{os.getpid()}"
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        base, own_state = servable_state(model)
        state_dict = state_dict if state_dict is not None else own_state
        base.save_pretrained(tmp, state_dict=state_dict)
        self._copy_tokenizer(tmp)
        verify_checkpoint(tmp, base, state_dict)
        for name, value in (training or {}).items():
            (tmp / TRAINING_DIR).mkdir(exist_ok=True)
            torch.save(value, tmp / TRAINING_DIR / f"{name}.pt")
        full_state = {"step": step, "weight_version": str(step), "saved_at": time.time()} | state
        (tmp / STATE_FILE).write_text(json.dumps(full_state))
        _publishable(tmp, intact)
        if final.exists():  # a step re-run after a crash before its ack: replace it whole
            shutil.rmtree(final)
        tmp.rename(final)
        self.prune(saved=step)
        return final

    def prune(self, saved: int | None = None) -> None:
        """Delete all but the newest `keep` checkpoints, and leftover temporary folders; only
        the newest keeps its optimizer state. `saved`, the step just saved, ranks first: it is
        never deleted, nor stripped of its optimizer state, by a higher step's folder."""
        steps = sorted(self._steps(), key=lambda s: (s == saved, s), reverse=True)
        for step in steps[self.keep :]:
            shutil.rmtree(self.path_for(step), ignore_errors=True)
        for step in steps[1 : self.keep]:
            (self.path_for(step) / TRAINING_DIR / "optimizer.pt").unlink(missing_ok=True)
        for leftover in self.root.glob(".step_*.tmp-*"):
            if not leftover.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(leftover, ignore_errors=True)

    def steps(self) -> list[int]:
        """Steps with a published checkpoint (after pruning: the newest `keep`)."""
        return self._steps()

    def drop_after(self, step: int) -> int:
        """Delete the folders of steps above `step`, the one resumed from (incomplete: `latest`
        skipped them) so they never outrank the steps trained again; returns how many."""
        return drop_above(self.root, {s: self.path_for(s) for s in self._steps()}, step)

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


def _publishable(tmp: Path, intact: Callable[[], bool]) -> None:
    """Delete the written folder `tmp` and raise SnapshotChanged unless `intact()`."""
    if not intact():
        shutil.rmtree(tmp, ignore_errors=True)
        raise SnapshotChanged(f"the tensors changed while {tmp.name} was written")


def unique_storage(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the later names of tensors that share storage with an earlier one (a
    tied `lm_head.weight` after `model.embed_tokens.weight`): safetensors stores each once."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor
    return out


class WeightsStore:
    """The weights engines load, one folder per pushed version (see module docstring).

    Args:
        root: the checkpoint folder (shared with the engines); folders go under `root/weights`.
        source_dir: the initial model folder (config and tokenizer files are copied from it).
        keep: newest folders kept.
    """

    def __init__(self, root: Path, source_dir: Path, keep: int = 2):
        self.root = Path(root) / "weights"
        self.source_dir = Path(source_dir)
        self.keep = keep

    def path(self, version: int) -> Path:
        return self.root / f"v_{version:08d}"

    def write(
        self,
        version: int,
        state: dict[str, torch.Tensor],
        intact: Callable[[], bool] = lambda: True,
    ) -> Path:
        """Write `state` (a CPU snapshot) as the weights of `version`; returns the folder.
        `intact`: as in `CheckpointStore.save`.

        Raises:
            OSError: the disk refused the write (nothing is published).
            SnapshotChanged: `intact()` was False (nothing is published).
        """
        final = self.path(version)
        tmp = self.root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(unique_storage(state), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if self.source_dir.is_dir():
            for src in self.source_dir.iterdir():
                if src.is_file() and not _NOT_COPIED.search(src.name):
                    shutil.copy2(src, tmp / src.name)
        _publishable(tmp, intact)
        if final.exists():  # a version trained again after a crash
            shutil.rmtree(final)
        tmp.rename(final)
        self.prune(written=version)
        return final

    def prune(self, written: int | None = None) -> None:
        """Delete all but the newest `keep` folders by version number; never `written`, the
        version just written (it is pushed next)."""
        versions = sorted(self._versions(), key=lambda v: (v == written, v), reverse=True)
        for version in versions[self.keep :]:
            shutil.rmtree(self.path(version), ignore_errors=True)

    def drop_after(self, version: int) -> int:
        """Delete the folders of versions above `version`, the one the trainer resumes from;
        returns how many. They are left from steps no checkpoint covers (a stop without its
        checkpoint); kept, they would outrank the versions trained again from `version`."""
        return drop_above(self.root, {v: self.path(v) for v in self._versions()}, version)

    def _versions(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return [int(m.group(1)) for p in self.root.iterdir() if (m := _VERSION_DIR.match(p.name))]


def load_training_state(path: Path, name: str) -> Any | None:
    """`training/<name>.pt` of checkpoint `path`, or None when it was not saved."""
    file = Path(path) / TRAINING_DIR / f"{name}.pt"
    return torch.load(file, weights_only=False) if file.is_file() else None


def servable_state(model: Any) -> tuple[PreTrainedModel, dict[str, torch.Tensor] | None]:
    """(the plain transformers model, the state dict to save): for a peft model, the base
    model's weights with the LoRA deltas merged in (W + scale B A) under the base names; for a
    plain model, (model, None) = its own state dict."""
    if not hasattr(model, "get_base_model"):
        return model, None
    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    modules = dict(base.named_modules())
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        owner = modules.get(name.rsplit(".base_layer.", 1)[0]) if ".base_layer." in name else None
        if owner is not None and name.endswith("base_layer.weight"):
            tensor = tensor + owner.get_delta_weight("default").to(tensor.dtype)
        merged[clean] = tensor.detach()  # unmerged tensors keep their storage (tied aliases)
    return base, merged


def verify_checkpoint(
    path: Path, model: PreTrainedModel, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """Every tensor of `state_dict` (default: the model's) is in `path/model.safetensors` with
    its shape and dtype, or is a tied alias (same storage) of one that is.

    Raises:
        ContractError: a tensor is missing, or has another shape or dtype.
    """
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        saved = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
        shapes = {name: list(s.get_shape()) for name, s in saved.items()}
        dtypes = {name: s.get_dtype() for name, s in saved.items()}
    state = state_dict if state_dict is not None else model.state_dict()
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


@dataclass
class PushReport:
    version: int
    ok: list[str]
    """Engines that now serve `version`."""
    failed: dict[str, str]
    """Engine URL -> last error, for engines that failed every attempt."""
    seconds: float
    via: str = "disk"
    """How the weights went: `disk` or `distributed`."""
    skipped: list[str] = field(default_factory=list)
    """Engines in `ok` that already served `version` or a newer one (not pushed)."""
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Engine URL -> wall-clock (start, end) of its push, in time.time() seconds."""


SKIPPED = "skipped"


class WeightPusher:
    """Loads a checkpoint into every engine with SGLang's `/update_weights_from_disk`.

    `flush_cache` is on (no stale prefix cache, BUG-15) and in-flight requests are not aborted
    (BUG-16). Each engine gets `attempts` tries with exponential backoff and jitter. An engine
    that still fails, or is past `engine_deadline_s`, is reported in the `PushReport` (the
    caller counts it, logs it and pushes the newest checkpoint to it again at the next step);
    only when every engine fails is `UpstreamError` raised. With a shared `fleet` the engines
    are the fleet's at each push, and a `FleetWatcher` catches up engines (fleet_push.py).

    Args:
        engine_urls: engine base URLs.
        timeout_s: seconds for one call (an engine finishes in-flight requests first).
        attempts: tries per engine.
        client: an httpx client (tests inject a mock transport).
        backoff_s: first retry delay in seconds (doubles, capped at 30 s).
        pause: "in_place" = pause each engine in place around its update (rows in flight
            continue under the new weights; `trainer.push.pause`), "abort" = pause in abort
            mode around it (rows in flight end with their partial output, which the gateway
            continues under the new weights), "none" = plain update.
        engine_deadline_s: seconds one engine's push may take, every attempt (0 = none).
        fleet: the shared fleet (core/fleet.Fleet) instead of `engine_urls`; None = fixed.
        refresh_s: seconds between the fleet watcher's passes.
    """

    def __init__(
        self,
        engine_urls: list[str],
        *,
        timeout_s: float,
        attempts: int,
        client: httpx.Client | None = None,
        backoff_s: float = 1.0,
        pause: str = "none",
        engine_deadline_s: float = 0.0,
        fleet: Any = None,
        refresh_s: float = 2.0,
    ):
        self.pause = pause
        self.static_urls = list(engine_urls)
        self.fleet = fleet
        self.engine_deadline_s = engine_deadline_s
        self.latest: tuple[Path, int] | None = None
        """The weights folder and version of the newest push (what a joined engine gets)."""
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.client = client or httpx.Client()
        self.backoff_s = backoff_s
        self.deltas: Any = None
        """`deltas.DeltaPushes` when `trainer.push.delta` is on (set by `attach_deltas`)."""
        self.watcher = FleetWatcher(self, fleet, refresh_s).start() if fleet else None

    @property
    def engine_urls(self) -> list[str]:
        """The engines a push goes to now: the fleet's (the last list read when Redis does
        not answer), or the fixed list."""
        if self.fleet is not None:
            try:
                self.static_urls = self.fleet.urls()
            except Exception as exc:  # noqa: BLE001 (redis errors: push to the last list)
                log.warning("fleet unreadable (%s); pushing to %s", exc, self.static_urls)
        return self.static_urls

    def push(self, model_path: Path, version: int) -> PushReport:
        """Push to every engine at once (one thread per engine, each within
        `engine_deadline_s`). An engine that already serves `version` or a newer one is left
        as it is and counted as ok (`skipped`).

        Raises:
            UpstreamError: every engine failed `attempts` times (the message has the last).
        """
        t0 = time.perf_counter()
        report = PushReport(version, [], {}, 0.0)
        urls = self.engine_urls
        self.latest = (Path(model_path), version)  # what the fleet watcher gives joined engines
        results = push_each(
            urls,
            lambda url: self.push_with_retries(url, model_path, version),
            self.engine_deadline_s,
        )
        for url in urls:
            error, span = results[url]
            report.spans[url] = span
            if error is None:
                report.ok.append(url)
            elif error == SKIPPED:
                report.ok.append(url)
                report.skipped.append(url)
            else:
                report.failed[url] = error
        report.seconds = time.perf_counter() - t0
        if self.fleet is not None and report.ok:  # gateways hold back engines serving less
            try:
                self.fleet.set_version(version)
            except Exception as exc:  # noqa: BLE001 (redis errors: the push stands)
                log.warning("fleet version not recorded (%s)", exc)
        if urls and not report.ok:
            last = next(reversed(report.failed.values()))
            raise UpstreamError(
                f"no engine took weight version {version} after {self.attempts} attempts "
                f"each: {last}"
            )
        return report

    def _lock(self, url: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(url, threading.Lock())

    def busy(self, url: str) -> bool:
        """True while a push to `url` runs."""
        return self._lock(url).locked()

    def push_with_retries(self, url: str, model_path: Path, version: int) -> str | None:
        """None when `url` took `version`, SKIPPED when it already serves it or a newer one,
        else the last error. One push per engine at a time (a later one waits, then finds the
        version served and skips), so an engine never gets an older version after a newer."""
        lock = self._lock(url)
        if not lock.acquire(timeout=self.engine_deadline_s or -1):
            return f"a push to {url} still runs after {self.engine_deadline_s} s"
        try:
            return self._push_locked(url, model_path, version)
        finally:
            lock.release()

    def _push_locked(self, url: str, model_path: Path, version: int) -> str | None:
        served = self.served_version(url)
        if served is not None and served >= version:
            log.info("engine %s serves version %d; version %d not pushed", url, served, version)
            return SKIPPED
        stop: Any = stop_after_attempt(self.attempts)
        if self.engine_deadline_s:
            stop = stop | stop_after_delay(self.engine_deadline_s)
        retrying = Retrying(
            stop=stop,
            wait=wait_exponential(multiplier=self.backoff_s, max=30.0)
            + wait_random(0, self.backoff_s),
            retry=retry_if_exception_type((httpx.HTTPError, UpstreamError)),
            reraise=True,
        )
        try:
            for attempt in retrying:
                with attempt:
                    self._push_one(url, model_path, version)
        except (httpx.HTTPError, UpstreamError) as exc:
            return str(exc) or type(exc).__name__
        return None

    def served_version(self, url: str) -> int | None:
        """`url`'s weight version (`/model_info`, 404: `/get_model_info`), None if it cannot say."""
        for path in ("/model_info", "/get_model_info"):  # the second: SGLang before 0.5.12
            try:
                reply = self.client.get(f"{url.rstrip('/')}{path}", timeout=10.0)
                if reply.status_code != 404:
                    ok = reply.status_code == 200
                    return parse_weight_version(reply.json().get("weight_version")) if ok else None
            except Exception as exc:  # noqa: BLE001 (best effort: the push itself reports errors)
                log.debug("engine %s did not report its weight version: %s", url, exc)
                return None
        return None

    def _push_one(self, url: str, model_path: Path, version: int) -> None:
        paused = self.pause in ("in_place", "abort") and self._pause(url)
        try:
            self._update(url, model_path, version)
        finally:
            if paused:
                self.client.post(f"{url.rstrip('/')}/continue_generation", json={}, timeout=60)

    def _pause(self, url: str) -> bool:
        """Pause `url` in the mode of `self.pause` (in_place or abort); False (logged) when the
        engine cannot."""
        try:
            reply = self.client.post(
                f"{url.rstrip('/')}/pause_generation", json={"mode": self.pause}, timeout=60
            )
        except httpx.HTTPError as exc:
            log.warning("engine %s could not pause (%s, %s); plain update", url, self.pause, exc)
            return False
        if reply.status_code != 200:
            log.warning(
                "engine %s refused to pause (%s, HTTP %s); plain update",
                url,
                self.pause,
                reply.status_code,
            )
            return False
        return True

    def _update(self, url: str, model_path: Path, version: int) -> None:
        if self.deltas is not None:  # trainer.push.delta: the delta first, else the full weights
            if self.deltas.push(self.client, url, Path(model_path), version, self.timeout_s):
                return
            model_path = self.deltas.full_folder(Path(model_path), version)
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
                version,
                url,
                response.status_code,
                reply.get("message"),
            )
            raise UpstreamError(
                f"engine {url} refused weights {model_path} (version {version}): HTTP "
                f"{response.status_code} {reply.get('message')!r}. Check the engine log."
            )
        log.info("engine %s now serves weight_version %s", url, version)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.client.close()
