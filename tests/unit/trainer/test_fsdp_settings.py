"""fsdp2 refuses the settings it does not combine with, before any model is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.core.settings import load_settings
from flywheel.trainer.policy import check_fsdp_settings, check_teacher_inputs


@pytest.mark.parametrize(
    ("trainer", "says"),
    [
        ({"lora": {"rank": 8}}, "trainer.lora.rank"),
        ({"push": {"mode": "distributed"}}, "trainer.push.mode = 'disk'"),
        ({"algorithm": {"token_weights": ["high_entropy_only"]}}, "own forward"),
    ],
)
def test_fsdp2_refuses(trainer, says):
    settings = load_settings(trainer={"distributed": {"strategy": "fsdp2"}} | trainer)
    with pytest.raises(ValueError, match=says):
        check_fsdp_settings(settings)


def test_fsdp2_accepts_the_defaults():
    settings = load_settings(
        trainer={"distributed": {"strategy": "fsdp2"}, "batch": {"layout": "packed"}}
    )
    check_fsdp_settings(settings)
    assert load_settings().trainer.distributed.strategy == "all_reduce"


def test_top_k_distillation_without_teacher_top_k_is_refused_at_start():
    with_topk = load_settings(Path(__file__).parents[3] / "recipes" / "opd_topk.toml")
    check_teacher_inputs(with_topk)  # the recipe keeps the teacher's top 8: accepted
    without = load_settings(
        trainer={"algorithm": {"regularizers": {"distill_topk": 1.0}}}
    )  # top_k = 0
    with pytest.raises(ValueError, match=r"top_k = 0"):
        check_teacher_inputs(without)
    check_teacher_inputs(load_settings())  # nothing reads the teacher's top-k
