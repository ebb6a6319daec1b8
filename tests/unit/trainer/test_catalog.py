"""The algorithm catalog matches the registries, imports without torch, and prints as a table."""

from __future__ import annotations

import subprocess
import sys
import typing

import pydantic
import pytest

from flywheel.core.algorithm_catalog import CATALOG, KINDS, format_table, names_for
from flywheel.core.settings import TrainerSettings
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
    fields = TrainerSettings.model_fields
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
            TrainerSettings(**{field: value})


@pytest.mark.parametrize(
    "field,value",
    [
        ("advantage", "grpo_typo"),
        ("policy_loss", "ppo"),
        ("token_weights", ["entropy"]),
        ("regularizers", {"k4": 0.1}),
        ("algorithm_params", {"nope": {"x": 1}}),
    ],
)
def test_settings_refuse_unknown_parts_naming_the_choices(field, value):
    with pytest.raises(pydantic.ValidationError, match="flywheel algorithms list"):
        TrainerSettings(**{field: value})


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
