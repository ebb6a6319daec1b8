"""A LoRA policy (`trainer.lora.rank > 0`, a peft wrapper) through the trainer's logprobs and
step: every layout reaches the decoder inside the wrapper, the logprobs equal a full forward's,
and one step moves the adapters only."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from flywheel.core.trainer_settings import LoraSettings
from flywheel.trainer.algorithms.losses import normalizer_for
from flywheel.trainer.logprobs import naive_token_logprobs, selected_token_logprobs
from flywheel.trainer.lora import add_lora
from flywheel.trainer.step import accumulate, prepare_batch
from flywheel.trainer.weights import load_model

from .factories import make_sample, step_config


def group():
    prompt = list(range(100, 120))  # 20 shared prompt tokens: one shared-prefix cluster
    samples = []
    for i, completion_len in enumerate((3, 7, 5)):
        sample = make_sample(
            prompt_len=20, completion_len=completion_len, reward=float(i % 2), seed=i
        )
        sample.token_ids[:20] = prompt
        samples.append(sample)
    return [samples]


@pytest.fixture
def lora_model(tiny_model_dir):
    torch.manual_seed(0)
    model = add_lora(load_model(tiny_model_dir), LoraSettings(rank=4, alpha=8.0))
    with torch.no_grad():  # peft starts B at 0 (a no-op adapter): give it a value
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prefix"])
def test_lora_logprobs_equal_a_full_forward(lora_model, layout):
    batch, _ = prepare_batch(group(), step_config(batch={"layout": "padded"}))
    with torch.no_grad():
        lp = selected_token_logprobs(
            lora_model,
            batch.input_ids_BT,
            batch.attention_mask_BT,
            batch.temperature_B,
            batch.loss_mask_BT,
            packed=layout == "packed",
            shared_prefix=layout == "shared_prefix",
        )
        full = naive_token_logprobs(
            lora_model, batch.input_ids_BT, batch.attention_mask_BT, batch.temperature_B
        )
    mask = batch.loss_mask_BT
    assert int(mask.sum()) == 3 + 7 + 5
    assert_close(lp.logprobs_BT[mask], full[mask], atol=2e-5, rtol=1e-5)
    # the adapters matter: without them (B = 0) the logprobs differ
    with torch.no_grad(), lora_model.disable_adapter():
        plain = naive_token_logprobs(
            lora_model, batch.input_ids_BT, batch.attention_mask_BT, batch.temperature_B
        )
    assert not torch.allclose(plain[mask], full[mask], atol=1e-4)


def test_a_lora_step_gives_gradients_to_the_adapters_only(lora_model):
    cfg = step_config(batch={"layout": "shared_prefix", "micro_batch_size": 3})
    batch, _ = prepare_batch(group(), cfg)
    acc = accumulate(lora_model, batch, cfg, normalizer_for(batch.loss_mask_BT))
    assert acc.loss != 0.0
    with_grad = [n for n, p in lora_model.named_parameters() if p.grad is not None]
    assert with_grad and all("lora_" in n for n in with_grad)
    assert any(
        float(p.grad.abs().sum()) > 0 for n, p in lora_model.named_parameters() if "lora_A" in n
    )
