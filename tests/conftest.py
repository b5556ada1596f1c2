"""Shared test setup: the ``gpu`` marker skips without a GPU backend; hypothesis profiles."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=10_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_GPU = mx.cuda.is_available() or mx.metal.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no GPU backend (MLX has neither CUDA nor Metal here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
