"""fsdp2 refuses the settings it does not combine with, before any model is loaded."""

from __future__ import annotations

import pytest

from flywheel.core.settings import load_settings
from flywheel.trainer.service import check_fsdp_settings


@pytest.mark.parametrize(("trainer", "says"), [
    ({"lora_rank": 8}, "lora_rank"),
    ({"push_mode": "distributed"}, "push_mode"),
    ({"token_weights": ["high_entropy_only"]}, "own forward"),
])
def test_fsdp2_refuses(trainer, says):
    settings = load_settings(trainer={"distributed_strategy": "fsdp2"} | trainer)
    with pytest.raises(ValueError, match=says):
        check_fsdp_settings(settings)


def test_fsdp2_accepts_the_defaults():
    settings = load_settings(trainer={"distributed_strategy": "fsdp2",
                                      "batch_layout": "packed"})
    check_fsdp_settings(settings)
    assert load_settings().trainer.distributed_strategy == "all_reduce"
