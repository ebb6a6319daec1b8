"""Prometheus metric names: what the code registers, the naming convention, and the dashboard.

The inventory is taken from the code itself: every module under services/flywheel that uses
prometheus_client is imported, and the collectors it registers are read from the registry (plus
the engine's own per-instance registry and the stream-gauge collector). The Grafana dashboard's
PromQL may only name series those metrics export, with labels they have.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "services"
DASHBOARDS = sorted((ROOT / "deploy/grafana/dashboards").glob("*.json"))
SERVICES = ("gateway", "engine", "reward", "teacher", "trainer", "stream")
TARGET_LABELS = {"instance", "job"}
"""Labels Prometheus adds to every scraped series."""
SUFFIXES = {
    "counter": ["_total", "_created"],
    "gauge": [""],
    "info": ["_info"],
    "histogram": ["_bucket", "_count", "_sum", "_created"],
    "summary": ["_count", "_sum", "_created", ""],
    "stateset": [""],
    "enum": [""],
}


def _metric_modules() -> list[str]:
    mods = []
    for path in sorted((SRC / "flywheel").rglob("*.py")):
        if "_proto" in path.parts:
            continue
        if "prometheus_client" in path.read_text():
            mods.append(".".join(path.relative_to(SRC).with_suffix("").parts))
    return mods


@pytest.fixture(scope="module")
def families() -> dict[str, tuple[str, frozenset[str]]]:
    """Family name -> (type, label names) of every Flywheel metric the code defines."""
    for module in _metric_modules():
        importlib.import_module(module)
    from flywheel.core.stream_stats import StreamStatsCollector  # noqa: PLC0415
    from flywheel.engine.metrics import EngineMetrics  # noqa: PLC0415

    wrappers = [c for c in REGISTRY._collector_to_names if isinstance(c, MetricWrapperBase)]
    engine = EngineMetrics()
    wrappers += [v for v in vars(engine).values() if isinstance(v, MetricWrapperBase)]
    out = {
        w._name: (w._type, frozenset(w._labelnames))
        for w in wrappers
        if w._name.startswith("flywheel_")
    }
    for fam in StreamStatsCollector(None, None).describe():  # type: ignore[arg-type]
        out[fam.name] = (fam.type, frozenset(_labels_of_family(fam)))
    assert isinstance(engine.registry, CollectorRegistry)
    return out


def _labels_of_family(fam) -> list[str]:
    return list(getattr(fam, "_labelnames", ()))


@pytest.fixture(scope="module")
def series(families) -> dict[str, frozenset[str]]:
    """Exported series name -> label names (histogram buckets also carry `le`)."""
    out = {}
    for name, (kind, labels) in families.items():
        for suffix in SUFFIXES[kind]:
            out[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def test_inventory_is_read_from_the_code(families):
    # One known metric per service proves every service's definitions were found.
    for name in (
        "flywheel_gateway_samples_published",
        "flywheel_engine_generated_tokens",
        "flywheel_reward_samples",
        "flywheel_trainer_steps",
        "flywheel_stream_lag_entries",
    ):
        assert name in families, name
    assert families["flywheel_stream_lag_entries"] == ("gauge", frozenset({"stream", "group"}))
    assert families["flywheel_engine_weight"][0] == "info"


def test_metric_names_follow_the_convention(families):
    """flywheel_<service>_<what>[_<unit>]; base units spelled out; time is in seconds."""
    for name, (_kind, labels) in families.items():
        assert re.fullmatch(rf"flywheel_({'|'.join(SERVICES)})_[a-z][a-z0-9_]*", name), name
        words = name.split("_")
        assert not {"ms", "msec", "millis", "milliseconds", "secs", "sec", "us"} & set(words), (
            f"{name}: use base units (_seconds)"
        )
        if {"latency", "duration", "time"} & set(words):
            assert name.endswith("_seconds"), f"{name}: a time must end in _seconds"
        assert not name.endswith("_total"), f"{name}: prometheus_client appends _total"
        for label in labels:
            assert re.fullmatch(r"[a-z][a-z0-9_]*", label), (name, label)


def _queries() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((panel["title"], target["expr"]))
    return out


def test_dashboard_covers_what_operators_watch():
    (dashboard,) = DASHBOARDS
    titles = " | ".join(p["title"].lower() for p in json.loads(dashboard.read_text())["panels"])
    for topic in (
        "throughput",
        "latency",
        "stream lag",
        "reward",
        "kl",
        "staleness",
        "weight version",
        "engine",
        "errors",
    ):
        assert topic in titles, topic


def test_every_dashboard_query_uses_exported_series_and_labels(series):
    queries = _queries()
    assert len(queries) >= 20
    used = set()
    for title, expr in queries:
        names = re.findall(r"\bflywheel_[a-z0-9_]+", expr)
        assert names, (title, expr)
        for name in names:
            assert name in series, f"panel {title!r}: {name} is not exported by any service"
            used.add(name)
        # Labels in selectors {label=...} must exist on the metric they select.
        for name, selector in re.findall(r"\b(flywheel_[a-z0-9_]+)\{([^}]*)\}", expr):
            for label in re.findall(r"([a-z_]+)\s*(?:=|!=|=~|!~)", selector):
                assert label in series[name], (title, name, label)
        # Labels grouped by must exist on every metric in the aggregation.
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                for name in names:
                    assert label in series[name] | TARGET_LABELS, (title, name, label)
    assert len(used) >= 15


def test_readme_documents_the_convention_and_the_dashboard_metrics(series):
    readme = (ROOT / "deploy/README.md").read_text()
    assert "flywheel_<service>_<what>[_<unit>][_total]" in readme
    for _, expr in _queries():
        for name in re.findall(r"\bflywheel_[a-z0-9_]+", expr):
            base = re.sub(r"_(bucket|count|sum|created)$", "", name)
            assert base in readme or base.rsplit("_", 1)[0] in readme, name
