"""The algorithm catalog matches the registries, imports without torch, and prints as a table."""

from __future__ import annotations

import subprocess
import sys
import typing

import pydantic
import pytest

from flywheel.core.algorithm_catalog import CATALOG, KINDS, format_table, names_for
from flywheel.core.settings import TrainerSettings
from flywheel.core.trainer_settings import AlgorithmSettings
from flywheel.ops import cli
from flywheel.trainer import algorithms


def registries() -> dict[str, dict]:
    return {name: getattr(algorithms, name) for name in algorithms.__all__}


def test_every_registry_entry_has_exactly_one_catalog_row_and_back():
    rows = {(row.registry, row.name) for row in CATALOG}
    assert len(rows) == len(CATALOG)
    entries = {(reg, name) for reg, table in registries().items() for name in table}
    assert rows == entries
    assert all(row.kind in KINDS and row.paper and row.inputs for row in CATALOG)


def test_every_settings_choice_is_registered():
    fields = AlgorithmSettings.model_fields
    choices = typing.get_args(fields["rollout_correction"].annotation)
    assert set(choices) <= set(registries()["CORRECTIONS"])
    for field, registry in [
        ("advantage", ["ADVANTAGES"]),
        ("policy_loss", ["POLICY_LOSSES"]),
        ("loss_aggregation", ["AGGREGATIONS"]),
        ("token_weights", ["WEIGHTS"]),
        ("regularizers", ["KL_ESTIMATORS", "TERMS"]),
    ]:
        registered = set().union(*(registries()[r] for r in registry))
        assert names_for(field) == registered, field
        for name in registered:
            value = {"token_weights": [name], "regularizers": {name: 0.1}}.get(field, name)
            TrainerSettings(algorithm={field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("advantage", "grpo_typo"),
        ("policy_loss", "ppo"),
        ("token_weights", ["entropy"]),
        ("regularizers", {"k4": 0.1}),
        ("params", {"nope": {"x": 1}}),
    ],
)
def test_settings_refuse_unknown_parts_naming_the_choices(field, value):
    with pytest.raises(pydantic.ValidationError, match="flywheel algorithms list") as caught:
        TrainerSettings(algorithm={field: value})
    message = caught.value.errors()[0]["msg"]
    assert "['" not in message, message  # the choices in words, not a list repr


def test_catalog_imports_without_torch():
    code = "import sys; import flywheel.core.algorithm_catalog; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_algorithms_list_prints_the_table(capsys):
    assert cli.main(["algorithms", "list"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == format_table()
    lines = out.splitlines()
    assert lines[0].split() == ["name", "kind", "paper", "inputs"]
    assert any(line.startswith("gspo ") and " ratio " in line for line in lines)
    assert len(lines) == len(CATALOG) + 2


def _group_inputs(others: float):
    """One group of 4 with every input an estimator reads; row 0 fixed, the other rows' rewards
    and step scores scaled by `others`."""
    import torch

    from flywheel.trainer.algorithms.advantages import AdvantageInputs

    gen = torch.Generator().manual_seed(0)
    mask_BT = torch.ones(4, 5, dtype=torch.bool)
    rewards_B = torch.tensor([1.0, 0.0, 1.0, 0.3], dtype=torch.float64)
    rewards_B[1:] = rewards_B[1:] * others + (1 - others) * torch.tensor([0.9, 0.2, 0.6])
    step_BT = torch.full((4, 5), float("nan"))
    step_BT[:, 2] = torch.tensor([0.8, 0.1, 0.5, 0.4])
    step_BT[1:, 2] = step_BT[1:, 2] * others + (1 - others) * 0.7
    step_BT[:, 4] = torch.tensor([0.2, 0.9, 0.3, 0.6])
    return AdvantageInputs(
        rewards_B=rewards_B,
        group_index_B=torch.zeros(4, dtype=torch.long),
        teacher_logprobs_BT=-torch.rand(4, 5, generator=gen) * 3,
        rollout_logprobs_BT=-torch.rand(4, 5, generator=gen) * 3,
        teacher_mask_BT=mask_BT,
        token_ids_BT=torch.tensor(
            [[5, 6, 7, 8, 9], [5, 6, 1, 2, 3], [5, 4, 7, 8, 9], [5, 6, 7, 1, 1]]
        ),
        loss_mask_BT=mask_BT,
        entropy_BT=torch.rand(4, 5, generator=gen) * 2,
        turn_index_B=torch.zeros(4, dtype=torch.long),
        step_rewards_BT=step_BT,
        wrong_hint_logprobs_BT=-torch.rand(4, 5, generator=gen) * 3,
    )


def test_catalog_group_relative_matches_what_each_estimator_does():
    """An estimator is group-relative when a sample's advantage moves with the rewards (and step
    scores) of the other members of its group; the catalog says so for exactly those, and
    settings refuse them with group_size = 1."""
    import torch

    from flywheel.core.algorithm_catalog import group_relative_advantages
    from flywheel.trainer.algorithms.advantages import ADVANTAGES, AdvantageConfig

    relative = set()
    for name, estimator in ADVANTAGES.items():
        outs = [estimator(_group_inputs(others), AdvantageConfig()) for others in (1.0, 0.0)]
        row0 = [
            o.advantages_BT[0] if o.advantages_BT is not None else o.advantages_B[0] for o in outs
        ]
        if not torch.allclose(row0[0].float(), row0[1].float()):
            relative.add(name)
    assert relative == group_relative_advantages()
    assert {row.name for row in CATALOG if row.group_relative} <= set(registries()["ADVANTAGES"])
    assert "opd" not in relative and "grpo" in relative
