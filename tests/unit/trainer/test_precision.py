"""`trainer.precision`: auto picks bf16 autocast only where the device has native bf16."""

from __future__ import annotations

import pytest
import torch

from flywheel.core.trainer_settings import TrainerSettings
from flywheel.trainer import step
from flywheel.trainer.step import StepConfig, native_bf16, resolve_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("precision", "native", "bf16", "says"),
    [
        ("auto", False, False, "no native bf16"),
        ("auto", True, True, "native bf16"),
        ("fp32", True, False, "fp32 (set)"),
        ("bf16_autocast", False, True, "emulated"),
        ("bf16_autocast", True, True, "bf16 autocast (set)"),
    ],
)
def test_precision_resolution(monkeypatch, precision, native, bf16, says):
    monkeypatch.setattr(step, "native_bf16", lambda device: native)
    on, why = resolve_precision(precision, CPU)
    assert on is bf16
    assert says in why


def test_default_on_this_cpu_follows_its_bf16_support():
    # this machine's CPU decides: AVX2-only (no AVX512-BF16/AMX) -> fp32 by default
    cfg = StepConfig.from_settings(TrainerSettings(device="cpu"))
    assert TrainerSettings().precision == "auto"
    assert cfg.bf16_autocast is native_bf16(CPU)
