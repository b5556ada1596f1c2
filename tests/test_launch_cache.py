"""One launch cache (graphkern.launching.launch_cache), one thread state (graphkern.launching.context)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

import graphkern as gk
import graphkern.kernels as gkk
from graphkern.kernels.base import LAUNCHES
from graphkern.launching import backends, context, launch_cache, launch_paths, mlx_kernels, validation
from graphkern.launching.autodiff import vjp_enabled
from graphkern.launching.launch_cache import LaunchCache
from graphkern.models.prefill import kernels_only, stock_layers, stock_layers_run

X = mx.arange(8, dtype=mx.float32)
SPEC = [gk.OutputSpec((8,), mx.float32)]
CONFIG: dict[str, Any] = dict(grid=(8, 1, 1), threadgroup=(8, 1, 1))


def gpu_kernel(name: str) -> gk.Kernel:
    """A kernel with a CUDA source, run by the ``opaque_gpu`` stand-in."""
    return gk.Kernel(name, ["x"], ["out"], cuda="/* stands in */", reference=lambda x: [x * 3])


def test_a_cache_keeps_its_bound_dropping_the_least_recently_used() -> None:
    cache = LaunchCache("bounded", maxsize=8, group=None)
    for i in range(8):
        cache.put(i, str(i))
    assert cache.get(0) == "0"  # now the most recently used
    for i in range(8, 40):
        cache.put(i, str(i))
        assert len(cache) <= 8
    assert len(cache) == 8 and sorted(cache) == list(range(32, 40))
    cache.put(40, "40")
    cache.get(33)
    cache.put(41, "41")  # 34 goes, not 33
    assert 33 in cache and 34 not in cache and len(cache) == 8
    assert cache.get("absent") is None and cache.stats()["misses"] == 1


def test_the_validated_launches_stay_at_their_bound_past_it() -> None:
    kernel = gk.Kernel("bounded_launches", ["x"], ["out"], reference=lambda x: [x])
    bound = validation.VALIDATED.maxsize
    assert bound is not None
    first = validation.validated_launch(kernel, SPEC, (1, 1, 1), (1, 1, 1))
    for i in range(2, bound + 50):
        validation.validated_launch(kernel, SPEC, (i, 1, 1), (1, 1, 1))
        if i % 1000 == 0:  # the first one is in use: it stays while older ones go
            assert validation.validated_launch(kernel, SPEC, (1, 1, 1), (1, 1, 1)) is first
    assert len(validation.VALIDATED) == bound
    assert gk.cache_stats()["validated launches"]["size"] == bound
    assert validation.validated_launch(kernel, SPEC, (1, 1, 1), (1, 1, 1)) is first


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = mx.ones((8,))

    def __call__(self, x: mx.array) -> mx.array:
        return gkk.rms_norm(x, self.weight) * 2


def test_clear_caches_empties_every_cache_and_the_next_calls_build_again(
        opaque_gpu: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    monkeypatch.setattr(mlx_kernels, "build_mlx_kernel", lambda backend, kernel: built.append(kernel.name))
    kernel = gpu_kernel("cleared")
    model = _Scaled()
    compiled = gk.compile(model)
    bound = gk.bind(kernel, SPEC, **CONFIG)
    x = mx.ones((2, 8))

    def run_everything() -> None:
        assert gk.apply(kernel, [X], SPEC, **CONFIG)[0].tolist() == (X * 3).tolist()
        assert bound(X)[0].tolist() == (X * 3).tolist()
        assert mx.allclose(gkk.rms_norm(x, model.weight), mx.fast.rms_norm(x, model.weight, 1e-5)).item()
        assert mx.allclose(compiled(x), model(x)).item()
        gk.kernel_cache.get("cuda", kernel)

    run_everything()
    gkk.rms_norm(x, None)  # a plan with a constant of its signature (the absent weight's stand-in)
    before = gk.cache_stats()
    for group in ("validated launches", "thread launch forms", "layer launches", "compiled graphs",
                  "mlx kernels", "plan parts", "reference keywords"):
        assert before[group]["size"] > 0, (group, before[group])
    assert len(LAUNCHES.constants) > 0
    launched = opaque_gpu.count("cleared")
    gk.clear_caches()
    after = gk.cache_stats()
    assert all(figures["size"] == 0 for figures in after.values()), after
    assert len(LAUNCHES) == 0 and len(LAUNCHES.constants) == 0
    assert compiled.trace_count() == 0 and len(launch_paths.thread_forms(bound.launch)) == 0
    run_everything()  # everything again: built anew, and right
    again = gk.cache_stats()
    for group in ("validated launches", "thread launch forms", "layer launches", "compiled graphs"):
        assert again[group]["misses"] > 0 and again[group]["size"] > 0, (group, again[group])
    assert built == ["cleared", "cleared"]  # MLX's kernel object built again
    assert opaque_gpu.count("cleared") > launched  # the compiled launch form traced again


#: Function caches that hold fixed resources for the process (no entry per launch, kernel or
#: graph): libclang's handles and MLX's preamble (metal-check), the viewer's static files, the C
#: library's float functions, the detected backend.
_FIXED_RESOURCES = {
    "graphkern.kernels.host_math._libm", "graphkern.launching.backends._detected_backend",
    "graphkern.metal_check.frontend._clang", "graphkern.metal_check.frontend._index",
    "graphkern.metal_check.frontend._builtin_declarations",
    "graphkern.metal_check.frontend._precompiled_preamble", "graphkern.metal_check.source.utils_preamble",
    "graphkern.viz.html._static", "graphkern.viz.html._vendor_js",
    "graphkern.launching.context._clear_streams_holding_gil",
}


def test_every_function_cache_is_seen_by_cache_stats() -> None:
    """A ``functools`` cache whose entries grow with what runs is made with ``memoized`` (or
    registered with ``track_function``): ``gk.cache_stats()`` counts it, ``gk.clear_caches()``
    empties it."""
    for info in pkgutil.walk_packages(gk.__path__, "graphkern."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    registered = {id(adapter.function) for adapter in launch_cache._kept}
    unseen = sorted(
        f"{name}.{attribute}" for name, module in list(sys.modules.items()) if name.startswith("graphkern")
        for attribute, value in vars(module).items()
        if hasattr(value, "cache_info") and hasattr(value, "cache_clear")
        and getattr(value, "__module__", None) == name and id(value) not in registered)
    assert sorted(set(unseen) - _FIXED_RESOURCES) == []
    assert len(registered) >= 15


def test_a_new_thread_never_inherits_the_forms_of_a_dead_thread_with_its_id(opaque_gpu: list[str]) -> None:
    kernel = gpu_kernel("reused_ident")
    bound = gk.bind(kernel, SPEC, **CONFIG)
    seen: dict[str, Any] = {}

    def first() -> None:
        with backends.using_backend("cuda"):  # the override is per thread
            bound(mx.arange(8, dtype=mx.float32))
        seen["ident"], seen["forms"] = threading.get_ident(), launch_paths.thread_forms(bound.launch)

    thread = threading.Thread(target=first)
    thread.start()
    thread.join()
    assert len(seen["forms"]) == 1

    def later() -> None:
        seen["later"] = threading.get_ident(), launch_paths.thread_forms(bound.launch)

    # CPython usually hands a new thread the id of one that ended at once (not always: the id is
    # the thread's stack address); every new thread, that one included, starts with no forms
    for _ in range(100):
        thread = threading.Thread(target=later)
        thread.start()
        thread.join()
        ident, forms = seen["later"]
        assert forms == []  # the dead thread's compiled form is not handed to a new one
        if ident == seen["ident"]:
            break
    launched = opaque_gpu.count("reused_ident")
    thread = threading.Thread(target=lambda: seen.update(out=bound(X)[0].tolist()))
    thread.start()
    thread.join()
    assert seen["out"] == (X * 3).tolist()
    assert opaque_gpu.count("reused_ident") == launched  # nor its backend override: reference


def test_every_setting_of_the_thread_reaches_the_traced_function_and_comes_back() -> None:
    inside: dict[str, Any] = {}

    def fn(x: mx.array) -> mx.array:
        inside.update(thread=threading.current_thread(), backend=gk.active_backend(),
                      vjp=vjp_enabled(), stock=stock_layers_run(), kernels_only=context.state.kernels_only)
        return x * 2

    with backends.using_backend("cuda"), gk.without_vjp(), stock_layers(), kernels_only():
        gk.trace(fn, X)
        assert (gk.active_backend(), vjp_enabled(), stock_layers_run()) == ("cuda", False, True)
    assert inside["thread"] is not threading.current_thread()  # it ran on the deep-stack thread
    settings = ("backend", "vjp", "stock", "kernels_only")
    assert [inside[name] for name in settings] == ["cuda", False, True, True]
    gk.trace(fn, X)  # the deep-stack thread went back to its own settings
    assert [inside[name] for name in settings] == [gk.active_backend(), True, False, False]
