"""Prometheus metric helpers shared by the services."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter


def labeled_counter(name: str, documentation: str, label: str, values: Iterable[str]) -> Counter:
    """A counter with one label whose known `values` are exported from the start (at 0), so a
    dashboard or alert sees every series before its first event."""
    counter = Counter(name, documentation, [label])
    for value in values:
        counter.labels(value)
    return counter
