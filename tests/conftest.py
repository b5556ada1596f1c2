"""Shared test setup: the ``gpu`` marker skips without a GPU backend; hypothesis profiles; a
stand-in GPU backend for the CPU (``opaque_gpu``)."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, settings

from graphkern import runtime

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


@pytest.fixture
def opaque_gpu(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Launches resolve to the CUDA backend and run the reference with no gradient through it,
    as MLX's CustomKernel has none; yields the names of the kernels launched, one per launch."""
    calls: list[str] = []

    def run_native(launch, inputs):  # type: ignore[no-untyped-def]
        calls.append(launch.kernel.name)
        return [mx.stop_gradient(o) for o in runtime.run_reference(launch, inputs)]

    monkeypatch.setattr(runtime, "_run_native", run_native)
    with runtime.using_backend("cuda"):
        yield calls
