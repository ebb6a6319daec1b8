"""LoRA adapters (peft) for large policies: only the low-rank matrices train.

`add_lora` wraps the fp32 policy with peft's LoRA on `[trainer.lora] target_modules` (rank
`rank`, scaling `alpha / rank`, no dropout so the recomputed logprobs are
deterministic). The base weights are frozen; AdamW holds state for the adapters only (a small
fraction of the parameters). Checkpoints hold the merged weights W + (alpha / r) B A under the
base model's names (`weights.servable_state`), so engines load them as a plain model. LoRA:
Hu et al. 2021, arXiv:2106.09685.
"""

from __future__ import annotations

import logging
from typing import Any, cast

from transformers import PreTrainedModel

from flywheel.core.trainer_settings import LoraSettings

log = logging.getLogger(__name__)


def add_lora(model: PreTrainedModel, s: LoraSettings) -> Any:
    """`model` with LoRA adapters (a peft `PeftModel`) by `[trainer.lora]` rank, alpha and
    target_modules, in train mode.

    Raises:
        ImportError: peft is not installed (install the trainer extra).
    """
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415 (optional dependency)

    config = LoraConfig(
        r=s.rank,
        lora_alpha=cast(Any, s.alpha),  # peft annotates int; a float scale is valid
        lora_dropout=0.0,
        target_modules=list(s.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    peft_model.train()
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log.info(
        "LoRA rank %d on %s: %d of %d parameters train (%.2f%%)",
        s.rank,
        ",".join(s.target_modules),
        trainable,
        total,
        100 * trainable / total,
    )
    return peft_model
