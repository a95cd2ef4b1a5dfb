"""Reading this process's Prometheus series (the servers of a test run share them)."""

from __future__ import annotations

from prometheus_client import REGISTRY


def value(name: str, **labels: str) -> float:
    """A sample's value; 0 for a series that does not exist yet."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def snapshot(*names: str, **labels: str) -> dict[str, float]:
    return {name: value(name, **labels) for name in names}


def moved(before: dict[str, float], **labels: str) -> dict[str, float]:
    return {name: value(name, **labels) - was for name, was in before.items()}
