"""AdamW with bfloat16 moments: stochastic rounding, the same step as torch's AdamW, a second
moment that still decays, checkpoints, and the `trainer.optim.state_dtype` setting."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError
from torch.testing import assert_close

from flywheel.core.trainer_settings import OptimSettings
from flywheel.trainer.adamw_bf16 import AdamWBf16State, optimizer_state_dtype, stochastic_round_bf16
from flywheel.trainer.step import build_optimizer

from .factories import tiny_model


def test_stochastic_rounding_worked_example():
    # x = 1 + 2^-10: bits 0x3F802000, bf16 neighbours 1.0 and 1 + 2^-7; dropped bits 0x2000 =
    # 8192, so noise >= 65536 - 8192 = 57344 rounds up, anything below rounds down.
    x = 1 + 2**-10
    down = stochastic_round_bf16(torch.tensor([x]), torch.tensor([57343], dtype=torch.int32))
    up = stochastic_round_bf16(torch.tensor([x]), torch.tensor([57344], dtype=torch.int32))
    assert float(down) == 1.0
    assert float(up) == 1 + 2**-7
    # negative values round in magnitude the same way
    neg = stochastic_round_bf16(torch.tensor([-x]), torch.tensor([57344], dtype=torch.int32))
    assert float(neg) == -(1 + 2**-7)


def test_stochastic_rounding_is_unbiased():
    # P(up) = 1/8, so the mean of 200k roundings of 1 + 2^-10 is 1 + 2^-7 / 8 = 1 + 2^-10; its
    # standard error is 2^-7 * sqrt(1/8 * 7/8) / sqrt(2e5) = 5.8e-6. Rounding to nearest gives
    # 1.0 every time (an error of 2^-10 = 9.8e-4).
    n = 200_000
    noise = torch.randint(
        0, 1 << 16, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(1)
    )
    rounded = stochastic_round_bf16(torch.full((n,), 1 + 2**-10), noise)
    assert rounded.dtype == torch.bfloat16
    assert abs(float(rounded.double().mean()) - (1 + 2**-10)) < 4e-5
    assert float(torch.tensor(1 + 2**-10).to(torch.bfloat16)) == 1.0


def _grads(model: torch.nn.Module, step: int) -> None:
    torch.manual_seed(step)
    ids = torch.randint(0, 128, (2, 9))
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()


def test_same_step_as_torch_adamw_within_bf16_moments():
    settings = OptimSettings(lr=1e-2, weight_decay=0.1, state_dtype="bfloat16")
    ours_model, ref_model = tiny_model(seed=3), tiny_model(seed=3)
    ours = build_optimizer(ours_model, settings)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, betas=settings.betas, weight_decay=0.1)
    assert isinstance(ours, AdamWBf16State)
    for step in range(4):
        for model in (ours_model, ref_model):
            _grads(model, step)
        ours.step()
        ref.step()
        if step == 0:
            # the first update reads the fp32 moments before they are rounded: torch's step
            for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
                assert_close(a, b, atol=1e-7, rtol=1e-6)
    moved = worst = 0.0
    start = tiny_model(seed=3)
    for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True):
        moved = max(moved, float((b - start.get_parameter(name)).detach().abs().max()))
        worst = max(worst, float((a - b).detach().abs().max()))
        state = ours.state[a]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    # four steps of about lr = 1e-2 each moved the weights by up to ~4e-2; bf16 moments (a
    # relative error near 2^-8 = 0.4% per moment) move them differently by far less
    assert moved > 1e-2
    assert worst < 0.02 * moved


def test_second_moment_still_decays_where_rounding_to_nearest_sticks():
    # v = 1 and zero gradients: v_t = 0.999^t, 0.999^2000 = 0.1352. Rounding to nearest would
    # keep v at 1.0 forever (0.999 is nearer 1.0 than the next bf16 below it, 1 - 2^-8).
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = AdamWBf16State([p], lr=0.0, weight_decay=0.0)
    p.grad = torch.zeros_like(p)
    opt.step()
    opt.state[p]["exp_avg_sq"].fill_(1.0)
    for _ in range(1999):
        opt.step()
    mean_v = float(opt.state[p]["exp_avg_sq"].double().mean())
    assert abs(mean_v - 0.999**2000) < 0.01, mean_v


def test_checkpoint_round_trip_resumes_the_same_steps():
    settings = OptimSettings(lr=1e-2, state_dtype="bfloat16")
    model = tiny_model(seed=5)
    opt = build_optimizer(model, settings)
    for step in range(2):
        _grads(model, step)
        opt.step()
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved_state = copy.deepcopy(opt.state_dict())  # state_dict() holds the live tensors
    for step in range(2, 4):
        _grads(model, step)
        opt.step()
    continued = {k: v.clone() for k, v in model.state_dict().items()}

    resumed_model = tiny_model(seed=5)
    resumed_model.load_state_dict(saved_weights)
    resumed = build_optimizer(resumed_model, settings)
    resumed.load_state_dict(saved_state)
    assert all(
        s["exp_avg"].dtype == torch.bfloat16 for s in resumed.state.values()
    )  # torch's loader casts moments to fp32; ours casts them back
    for step in range(2, 4):
        _grads(resumed_model, step)
        resumed.step()
    for name, value in resumed_model.state_dict().items():
        assert torch.equal(value, continued[name]), name  # same rounding on replay


def test_loads_a_float32_adamw_checkpoint():
    model = tiny_model(seed=6)
    fp32 = build_optimizer(model, OptimSettings(lr=1e-2, state_dtype="float32"))
    _grads(model, 0)
    fp32.step()
    bf16 = build_optimizer(model, OptimSettings(lr=1e-2, state_dtype="bfloat16"))
    bf16.load_state_dict(fp32.state_dict())
    p = next(model.parameters())
    assert bf16.state[p]["exp_avg"].dtype == torch.bfloat16
    assert_close(bf16.state[p]["exp_avg"].float(), fp32.state[p]["exp_avg"], atol=1e-6, rtol=1e-2)


def test_state_dtype_setting():
    params = list(tiny_model(seed=1).parameters())
    assert optimizer_state_dtype("auto", params)[0] == "bfloat16"  # fp32 on the CPU
    assert optimizer_state_dtype("float32", params)[0] == "float32"
    bf16_params = [p.detach().to(torch.bfloat16) for p in params]
    assert optimizer_state_dtype("auto", bf16_params)[0] == "float32"
    with pytest.raises(ValueError, match='state_dtype = "bfloat16" needs plain float32'):
        optimizer_state_dtype("bfloat16", bf16_params)
    with pytest.raises(ValidationError):
        OptimSettings(state_dtype="bf16")  # a misspelling is refused
    assert isinstance(build_optimizer(tiny_model(seed=1), OptimSettings()), AdamWBf16State)
    plain = build_optimizer(tiny_model(seed=1), OptimSettings(state_dtype="float32"))
    assert isinstance(plain, torch.optim.AdamW) and plain.param_groups[0]["fused"]
