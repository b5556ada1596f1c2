"""Decoding routes chosen by measurement (graphkern.models.route_timing): a patched decoder stack on
a GPU times its decoding calls on the kernels and on the stock layers and keeps the faster.

The clock is the test's: each call's time is set by the route it took, so the choice is exact.
The GPU decision is simulated (the kernels run their references on the CPU), so patched and stock
logits compare exactly in float32."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from model_comparisons import PROMPT, eval_twins  # noqa: E402

import graphkern as gk  # noqa: E402
import graphkern.models.route_timing as route_timing  # noqa: E402
import graphkern.models.routes as routes  # noqa: E402
from graphkern.models.route_timing import (  # noqa: E402
    MAX_TRIALS,
    SKIPPED_CALLS,
    TIMED_CALLS,
    TRIALS,
    RouteTimer,
    decode_route_choices,
)

Taken = list[tuple[Any, str]]  # (call shape, route) for each decoding call measured
MEASURED_CALLS = 2 * TRIALS * (SKIPPED_CALLS + TIMED_CALLS)


class StepClock:
    """A clock that moves on by the time of the route the last call took: ``after(route)``."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds, self.now = seconds, 0.0

    def __call__(self) -> float:
        return self.now

    def after(self, route: str) -> None:
        self.now += self.seconds[route]


def _run(timer: RouteTimer, clock: StepClock, calls: int, key: Any = (1, 1)) -> list[str]:
    taken = []
    for _ in range(calls):
        route = timer.route(key)
        taken.append(route)
        clock.after(route)
    return taken


@pytest.mark.parametrize("kernels, stock, chosen", [(2.0, 1.0, "stock"), (1.0, 2.0, "kernels"),
                                                    (1.0, 1.0, "kernels")])
def test_the_faster_route_is_kept(kernels: float, stock: float, chosen: str) -> None:
    clock = StepClock({"kernels": kernels, "stock": stock})
    timer = RouteTimer(clock=clock)
    taken = _run(timer, clock, MEASURED_CALLS + 10)
    assert taken[:MEASURED_CALLS].count("kernels") == taken[:MEASURED_CALLS].count("stock")
    assert taken[MEASURED_CALLS:] == [chosen] * 10
    report = timer.report()[(1, 1)]
    assert report["route"] == chosen
    assert report["kernels_ms"] == pytest.approx(1e3 * kernels)
    assert report["stock_ms"] == pytest.approx(1e3 * stock)
    assert report["timed_calls"] == {"kernels": TRIALS * TIMED_CALLS, "stock": TRIALS * TIMED_CALLS}


def test_the_first_calls_of_each_turn_are_not_timed() -> None:
    """A route's first calls (tracing, the other route's work still on the device) may take any
    time: a slow first call of each kernel turn does not make the stock layers win."""
    clock = StepClock({"kernels": 1.0, "stock": 1.5})
    timer = RouteTimer(clock=clock)
    previous = None
    for _ in range(MEASURED_CALLS + 1):
        route = timer.route((1, 1))
        clock.after(route)
        if route != previous:
            clock.now += 100.0  # a switch: the call is slow
        previous = route
    assert timer.chosen((1, 1)) == "kernels"


def test_a_turn_slowed_by_something_else_does_not_decide() -> None:
    """The host or the device busy elsewhere during one turn only slows that turn: each route
    counts its best turn, so kernels 20% faster than stock still win though their first turn ran
    60% slower (the median of all their calls would have made stock win)."""
    clock = StepClock({"kernels": 1.0, "stock": 1.2})
    timer = RouteTimer(clock=clock)
    for call in range(MEASURED_CALLS + 1):
        route = timer.route((1, 1))
        clock.after(route)
        if call < SKIPPED_CALLS + TIMED_CALLS:  # the first turn: the kernels'
            clock.now += 0.6
    assert timer.chosen((1, 1)) == "kernels"
    assert timer.report()[(1, 1)]["kernels_ms"] == pytest.approx(1e3)


def test_a_route_slower_in_every_turn_loses() -> None:
    """Only the best turn counts, but both of the slower route's turns are slower."""
    clock = StepClock({"kernels": 1.0, "stock": 1.2})
    timer = RouteTimer(clock=clock)
    for _ in range(MEASURED_CALLS + 1):
        route = timer.route((1, 1))
        clock.after(route)
        if route == "kernels":
            clock.now += 0.6  # every kernels call: 1.6 against 1.2
    assert timer.chosen((1, 1)) == "stock"


def test_each_call_shape_is_measured_on_its_own() -> None:
    clock = StepClock({"kernels": 1.0, "stock": 2.0})
    timer = RouteTimer(clock=clock)
    _run(timer, clock, MEASURED_CALLS + 1, key=(1, 1))
    clock.seconds = {"kernels": 2.0, "stock": 1.0}  # eight rows: the stock layers are faster
    _run(timer, clock, MEASURED_CALLS + 1, key=(8, 1))
    assert (timer.chosen((1, 1)), timer.chosen((8, 1))) == ("kernels", "stock")


def test_calls_of_other_shapes_between_are_not_counted() -> None:
    """A call's time is the interval to the next call of its shape on its thread; a prompt of
    another shape between (a new generation) breaks it, and the measurement runs more trials."""
    clock = StepClock({"kernels": 1.0, "stock": 2.0})
    timer = RouteTimer(clock=clock)
    for _ in range(MEASURED_CALLS + 1):
        route = timer.route((1, 1))
        clock.after(route)
        timer.route((1, 64))  # a prompt between every two steps: nothing is ever timed
        clock.now += 1000.0
    assert timer.chosen((1, 1)) is None
    assert timer.report()[(1, 1)]["timed_calls"] == {"kernels": 0, "stock": 0}
    _run(timer, clock, 2 * MAX_TRIALS * (SKIPPED_CALLS + TIMED_CALLS))
    assert timer.chosen((1, 1)) is not None


def test_a_shape_never_timed_keeps_the_kernels() -> None:
    clock = StepClock({"kernels": 1.0, "stock": 1.0})
    timer = RouteTimer(clock=clock)
    for _ in range(2 * MAX_TRIALS * (SKIPPED_CALLS + TIMED_CALLS) + 1):
        timer.route((1, 1))
        timer.route((2, 1))  # every call's successor is another shape's
    assert timer.chosen((1, 1)) == "kernels" and timer.chosen((2, 1)) == "kernels"


def test_calls_from_another_thread_are_not_counted() -> None:
    clock = StepClock({"kernels": 1.0, "stock": 1.0})
    timer = RouteTimer(clock=clock)
    timer.route((1, 1))
    worker = threading.Thread(target=timer.route, args=((1, 1),))
    worker.start()
    worker.join()
    assert timer.report()[(1, 1)]["timed_calls"] == {"kernels": 0, "stock": 0}


def test_forget_measures_again() -> None:
    clock = StepClock({"kernels": 2.0, "stock": 1.0})
    timer = RouteTimer(clock=clock)
    _run(timer, clock, MEASURED_CALLS + 1)
    timer.forget()
    assert timer.chosen((1, 1)) is None and timer.report() == {}


# ----------------------------------------------------------------------------- in a model


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> Callable[[nn.Module, dict[str, float]], Taken]:
    """Routes decide as on CUDA and decoding routes are measured; ``watch(model, seconds)`` gives
    the model's stack a clock moved on by each decoding call's route, and returns the routes
    taken, ``(call shape, route)`` a measured call."""
    monkeypatch.setattr(routes, "on_gpu_backend", lambda: True)
    monkeypatch.setattr(route_timing, "measures_routes", lambda: True)
    taken: Taken = []
    real = RouteTimer.route

    def watch(model: nn.Module, seconds: dict[str, float]) -> Taken:
        clock = StepClock(seconds)
        model.model.route_timer().clock = clock

        def route(self: RouteTimer, key: Any) -> str:
            found = real(self, key)
            taken.append((key, found))
            clock.after(found)  # the call about to run takes its route's time
            return found

        monkeypatch.setattr(RouteTimer, "route", route)
        return taken

    return watch


def _greedy(model: nn.Module, steps: int) -> list[mx.array]:
    cache = make_prompt_cache(model)
    logits = [model(PROMPT, cache=cache)]
    for _ in range(steps):
        logits.append(model(mx.argmax(logits[-1][:, -1:], axis=-1), cache=cache))
        mx.eval(logits[-1])
    return logits


@pytest.mark.parametrize("arch", ["llama", "phi3"])
@pytest.mark.parametrize("seconds, chosen", [({"kernels": 2.0, "stock": 1.0}, "stock"),
                                             ({"kernels": 1.0, "stock": 2.0}, "kernels")])
def test_a_patched_model_decodes_on_the_faster_route_as_stock_does(
        arch: str, seconds: dict[str, float], chosen: str, measured: Any) -> None:
    stock, patched = eval_twins(arch)
    taken = measured(patched, seconds)
    steps = MEASURED_CALLS + 4
    theirs, ours = _greedy(stock, steps), _greedy(patched, steps)
    assert all(mx.allclose(a, b, atol=1e-5, rtol=0.0).item() for a, b in zip(theirs, ours))
    decoded = [route for key, route in taken if key == (1, 1)]  # the prompt is a call of its own shape
    assert len(decoded) == steps and decoded[MEASURED_CALLS:] == [chosen] * 4
    choices = decode_route_choices(patched)
    assert list(choices) == ["model"] and choices["model"][(1, 1)]["route"] == chosen


@pytest.mark.parametrize("route", ["kernel", "stock"])
def test_a_forced_route_is_not_measured(route: str, measured: Any) -> None:
    _, patched = eval_twins("llama")
    taken = measured(patched, {"kernels": 1.0, "stock": 1.0})
    gk.set_route(patched, route)
    _greedy(patched, 3)
    assert taken == [] and decode_route_choices(patched) == {"model": {}}


def test_setting_the_route_again_forgets_what_was_measured(measured: Any) -> None:
    _, patched = eval_twins("llama")
    measured(patched, {"kernels": 2.0, "stock": 1.0})
    _greedy(patched, MEASURED_CALLS + 1)
    assert decode_route_choices(patched)["model"][(1, 1)]["route"] == "stock"
    gk.set_route(patched, "auto")
    assert decode_route_choices(patched) == {"model": {}}


def test_a_trace_records_the_kernels_whatever_was_chosen(measured: Any) -> None:
    """A graphkern trace of a decoding call records the fused kernels though the stock layers
    were chosen, and is not one of the calls timed."""
    _, patched = eval_twins("llama")
    taken = measured(patched, {"kernels": 2.0, "stock": 1.0})
    _greedy(patched, MEASURED_CALLS + 1)
    assert decode_route_choices(patched)["model"][(1, 1)]["route"] == "stock"
    calls = len(taken)
    graph = gk.trace(lambda token: patched(token), PROMPT[:, :1])
    kernels = {graph.node(k)["kernel"] for k in graph.kernels()}
    assert {"gk_norm_projections", "gk_norm_swiglu"} <= kernels
    assert len(taken) == calls


def test_the_cpu_does_not_measure() -> None:
    """Off a GPU the kernels run their references and every call takes them."""
    _, patched = eval_twins("llama")
    _greedy(patched, MEASURED_CALLS + 1)
    assert decode_route_choices(patched) == {"model": {}}


def test_reading_the_routes_of_what_is_not_a_module_is_refused_by_name() -> None:
    _, patched = eval_twins("llama")
    with pytest.raises(gk.ModelError, match="takes an mlx.nn.Module and got WrappedModel"):
        decode_route_choices(gk.wrap(patched))
