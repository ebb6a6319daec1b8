"""Every catalog row cites its paper by arXiv id (or says why there is none), and the part's
docstring carries the same ids."""

from __future__ import annotations

import inspect
import re

import pytest

from flywheel.core.algorithm_catalog import CATALOG
from flywheel.trainer import algorithms

ARXIV = re.compile(r"arXiv:(\d{4}\.\d{4,5})")


@pytest.mark.parametrize("row", CATALOG, ids=lambda r: r.name)
def test_catalog_row_names_an_arxiv_id_or_why_not(row):
    assert ARXIV.search(row.paper) or "no arXiv id" in row.paper or "no paper" in row.paper, (
        row.paper
    )


@pytest.mark.parametrize("row", [r for r in CATALOG if ARXIV.search(r.paper)], ids=lambda r: r.name)
def test_part_docstring_cites_the_catalog_ids(row):
    part = getattr(algorithms, row.registry)[row.name]
    text = (inspect.getdoc(part) or "") + (inspect.getmodule(part).__doc__ or "")
    missing = [i for i in ARXIV.findall(row.paper) if i not in text]
    assert not missing, f"{row.name}: {missing} not in its docstring"
