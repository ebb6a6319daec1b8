"""`python -m flywheel.trainer.export CHECKPOINT OUT`: a plain Hugging Face model folder.

Copies a trainer checkpoint (`<checkpoint_dir>/step_00000012`, or the checkpoint folder itself
for its newest step) to OUT without the trainer's state (`trainer_state.json`, `training/`):
config, `model.safetensors` (LoRA merged), tokenizer and generation config, which any engine
(SGLang, vLLM, transformers) can serve.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from flywheel.trainer.weights import STATE_FILE, WEIGHTS_FILE, CheckpointStore


def export_hf(checkpoint: Path, out: Path) -> Path:
    """Copy checkpoint `checkpoint` to `out` as a plain Hugging Face folder (config, weights,
    tokenizer, generation config) without the trainer's state; atomic (temporary sibling, then
    rename). Returns `out`.

    Raises:
        FileNotFoundError: `checkpoint` has no model.safetensors.
        FileExistsError: `out` exists.
    """
    checkpoint, out = Path(checkpoint), Path(out)
    if not (checkpoint / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"{checkpoint} has no {WEIGHTS_FILE}; pass a step_* folder")
    if out.exists():
        raise FileExistsError(f"{out} exists; choose a new folder")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for src in checkpoint.iterdir():
        if src.is_file() and src.name != STATE_FILE:
            shutil.copy2(src, tmp / src.name)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flywheel.trainer.export", description=__doc__)
    parser.add_argument("checkpoint", type=Path, help="a step_* folder or the checkpoint folder")
    parser.add_argument("out", type=Path, help="new folder to write")
    args = parser.parse_args(argv)
    source = args.checkpoint
    if not (source / "model.safetensors").is_file():
        latest = CheckpointStore(source, keep=1_000_000, source_dir=source).latest()
        if latest is None:
            print(
                f"error: {source} holds no checkpoint (no step_*/model.safetensors); pass a "
                "step folder or the trainer's checkpoint_dir",
                file=sys.stderr,
            )
            return 2
        source = latest.path
    try:
        export_hf(source, args.out)
    except (FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {source} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
