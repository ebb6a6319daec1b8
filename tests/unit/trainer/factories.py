"""Builders for trainer tests: tiny random Llama models from a config (never downloaded) and
well-formed Samples."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flywheel.core.codec import new_sample
from flywheel.trainer.step import StepConfig

VOCAB = 128


def tiny_config(vocab: int = VOCAB, hidden: int = 32) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


def tiny_model(seed: int = 0, **config) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**config))
    model.train()
    return model


def make_sample(
    *,
    prompt_len: int = 4,
    completion_len: int = 4,
    reward: float = 1.0,
    group_id: str = "g0",
    temperature: float = 1.0,
    version: int = 0,
    logprob: float = -1.0,
    seed: int = 0,
    **fields,
):
    """A valid Sample: `prompt_len` prompt tokens then `completion_len` sampled tokens."""
    gen = torch.Generator().manual_seed(seed)
    n = prompt_len + completion_len
    sample = new_sample(
        token_ids=torch.randint(1, VOCAB, (n,), generator=gen).tolist(),
        loss_mask=[0] * prompt_len + [1] * completion_len,
        rollout_logprobs=[0.0] * prompt_len + [logprob] * completion_len,
        weight_versions=[-1] * prompt_len + [version] * completion_len,
        prompt_length=prompt_len,
        group_id=group_id,
        reward=reward,
        **({"has_reward": True} | fields),
    )
    sample.sampling.temperature = temperature
    return sample


def step_config(
    base: StepConfig | None = None,
    *,
    algorithm: dict[str, Any] | None = None,
    batch: dict[str, Any] | None = None,
    optim: dict[str, Any] | None = None,
    bf16_autocast: bool | None = None,
) -> StepConfig:
    """`base` (default: the default StepConfig) with fields of its settings sections replaced
    and validated, e.g. `step_config(batch={"micro_batch_size": 2})`."""
    base = base or StepConfig()

    def section(current: Any, update: dict[str, Any] | None) -> Any:
        if not update:
            return current
        return type(current).model_validate(current.model_dump() | update)

    return dataclasses.replace(
        base,
        algorithm=section(base.algorithm, algorithm),
        batch=section(base.batch, batch),
        optim=section(base.optim, optim),
        bf16_autocast=base.bf16_autocast if bf16_autocast is None else bf16_autocast,
    )
