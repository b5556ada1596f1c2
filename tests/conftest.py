"""Shared test setup: the ``gpu`` marker skips without a GPU backend; hypothesis profiles; a
stand-in GPU backend for the CPU (``opaque_gpu``); the modules tests share (planted bugs, graphs
made by hand, model comparisons, the ring's runner...), which live in ``tests/helpers/`` and are
imported by name (``import viz_graphs as vg``)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, settings

from graphkern.launching import backends, launch_paths

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=10_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_GPU = mx.cuda.is_available() or mx.metal.is_available()
HELPERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
if HELPERS not in sys.path:
    sys.path.insert(0, HELPERS)


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
        return [mx.stop_gradient(o) for o in launch_paths.run_reference(launch, inputs)]

    monkeypatch.setattr(launch_paths, "run_native", run_native)
    with backends.using_backend("cuda"):
        yield calls


@pytest.fixture
def two_live_threads() -> Callable[[Callable[[], Any]], tuple[list[Any], list[threading.Thread]]]:
    """``run(work)`` calls ``work()`` in two threads that take turns (one lock) and are alive at
    once (so their idents differ); returns the two results and the threads."""

    def run(work: Callable[[], Any]) -> tuple[list[Any], list[threading.Thread]]:
        results: list[Any] = []
        lock, alive = threading.Lock(), threading.Barrier(2)

        def worker() -> None:
            try:
                with lock:
                    results.append(work())
            finally:
                alive.wait()

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results, threads

    return run


@pytest.fixture(autouse=True, scope="session")
def lint_every_trace():  # type: ignore[no-untyped-def]
    """Every graph a test captures is checked against graphkern.tracing.schema (``Graph.lint``), as
    torch.fx's tests lint every graph they build."""
    from graphkern.tracing.traceable import Traceable

    original = Traceable.trace

    def linted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        graph, spec = original(self, *args, **kwargs)
        graph.lint()
        return graph, spec

    Traceable.trace = linted  # type: ignore[method-assign]
    yield
    Traceable.trace = original  # type: ignore[method-assign]
