"""Reading a /metrics answer in the tests, with prometheus-client's own parser."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Series:
    """Every sample by (name, sorted labels); the parser rejects a malformed exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(series: Series, name: str, **labels: str) -> float:
    return series[(name, tuple(sorted(labels.items())))]


def delta(before: Series, after: Series, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)
