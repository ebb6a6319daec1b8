"""`trainer.precision`: auto picks bf16 autocast only on CUDA with native bf16; fp32 on a CPU."""

from __future__ import annotations

import pytest
import torch

from flywheel.core.trainer_settings import TrainerSettings
from flywheel.trainer import precision as precision_module
from flywheel.trainer.precision import resolve_precision
from flywheel.trainer.step import StepConfig


@pytest.mark.parametrize(
    ("precision", "native", "device", "bf16", "says"),
    [
        ("auto", False, "cuda", False, "no native bf16"),
        ("auto", True, "cuda", True, "native bf16"),
        ("auto", True, "cpu", False, "match the engine's fp32"),
        ("auto", False, "cpu", False, "match the engine's fp32"),
        ("fp32", True, "cuda", False, "fp32 (set)"),
        ("bf16_autocast", False, "cpu", True, "emulated"),
        ("bf16_autocast", True, "cpu", True, "bf16 autocast (set)"),
    ],
)
def test_precision_resolution(monkeypatch, precision, native, device, bf16, says):
    monkeypatch.setattr(precision_module, "native_bf16", lambda device: native)
    on, why = resolve_precision(precision, torch.device(device))
    assert on is bf16
    assert says in why


def test_default_on_a_cpu_is_fp32_whatever_its_bf16_support():
    # even with AVX512-BF16/AMX (native_bf16 True on this machine) a CPU trains in fp32
    cfg = StepConfig.from_settings(TrainerSettings(device="cpu"))
    assert TrainerSettings().precision == "auto"
    assert cfg.bf16_autocast is False
