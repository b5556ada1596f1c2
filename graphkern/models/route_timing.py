"""Decoding routes chosen by measurement: a patched decoder stack on a GPU times its own decoding
calls on its kernels and on its stock layers, a few calls of each taking turns, and keeps the
faster one for that call's shape.

Whether the fused blocks pay depends on the machine as much as on the model. They launch about
half of stock's kernels a block, but each of their launches costs the host more than a stock op's;
decoding a token is bound by the host or by the GPU's reading of the weights, and which one, and
by how much, differs from one host and card to the next. So rather than guessing, the stack
measures what a user's own loop sees: the time from one decoding call to the next, which in
mlx-lm's pipelined loop (``generate_step``, ``BatchGenerator``) is a step's time, whichever of the
host and the GPU bounds it. Like ``torch.backends.cudnn.benchmark``, it costs the first calls of
each shape: ``TRIALS`` rounds of ``SKIPPED_CALLS + TIMED_CALLS`` calls on each route (the first
calls after a switch still overlap the other route's work on the device, and a route's first call
traces its compiled forms, so they are not timed). Each route's time is the median of its best
turn, as ``timeit`` takes the best of its repeats: whatever else the host or the device does
meanwhile only ever slows a turn down, and a route measured in a disturbed turn would otherwise
lose to one that was not. The faster wins; a tie keeps the kernels.

Only the ``"auto"`` route measures, only on a GPU backend and outside graphkern's traces (which
record every kernel whatever is chosen). ``gk.set_route(model, "kernel")`` always decodes on the
kernels, ``"stock"`` always on the stock layers; :func:`decode_route_choices` says what a model
chose.

>>> ticks = iter(range(0, 10_000, 10))            # a clock: each call 10 units after the last
>>> timer = RouteTimer(clock=lambda: next(ticks) / 1000)
>>> routes = [timer.route((1, 1)) for _ in range(2 * TRIALS * (SKIPPED_CALLS + TIMED_CALLS) + 1)]
>>> routes[-1], timer.chosen((1, 1))             # both as fast: the kernels stay
('kernels', 'kernels')
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, Literal

import mlx.nn as nn

from graphkern.errors import ModelError
from graphkern.launching.backends import on_gpu_backend
from graphkern.nodes import Status

__all__ = ["MAX_TRIALS", "SKIPPED_CALLS", "TIMED_CALLS", "TRIALS", "TURN_CALLS", "RouteTimer",
           "decode_route_choices", "measures_routes"]

DecodeRoute = Literal["kernels", "stock"]

#: Calls at the start of each turn that are not timed: the first after a switch overlaps the other
#: route's work still on the device, and a route's first call ever traces its compiled forms.
SKIPPED_CALLS = 2
#: Calls timed in each turn of a route.
TIMED_CALLS = 5
#: Turns of each route (kernels first in even trials, stock first in odd ones) before choosing.
TRIALS = 2
#: Trials at most: a shape whose calls keep being interrupted (by calls of other shapes, or from
#: other threads) before each route has ``TIMED_CALLS`` timed calls keeps the kernels.
MAX_TRIALS = 6
#: Timed calls a turn needs for its median to stand for its route (a turn broken by calls of
#: other shapes may have fewer).
TURN_CALLS = (TIMED_CALLS + 1) // 2


def measures_routes() -> bool:
    """Whether decoding routes are measured on this thread now: on a GPU backend. (On the CPU
    the kernels run their pure-MLX references, which a user runs to check them, not for speed.)"""
    return on_gpu_backend()


class _Choice:
    """The measurement of one call shape: the turns handed out so far, the times seen (by route,
    then by turn), the result."""

    __slots__ = ("plan", "position", "samples", "chosen", "trials")

    def __init__(self) -> None:
        # each call's (route, the turn it is timed in, or None where it is not timed)
        self.plan: list[tuple[DecodeRoute, int | None]] = []
        self.position = 0
        self.samples: dict[DecodeRoute, dict[int, list[float]]] = {"kernels": {}, "stock": {}}
        self.chosen: DecodeRoute | None = None
        self.trials = 0
        for _ in range(TRIALS):
            self._add_trial()

    def _add_trial(self) -> None:
        order: tuple[DecodeRoute, DecodeRoute] = (
            ("kernels", "stock") if self.trials % 2 == 0 else ("stock", "kernels"))
        for route in order:
            turn = 2 * self.trials + (route != order[0])
            self.plan += [(route, None)] * SKIPPED_CALLS + [(route, turn)] * TIMED_CALLS
        self.trials += 1

    def next_route(self) -> tuple[DecodeRoute, int | None]:
        """The route of the next call and the turn it is timed in (None: not timed), or the
        choice once made."""
        if self.chosen is None and self.position >= len(self.plan):
            self._decide()
        if self.chosen is not None:
            return self.chosen, None
        call = self.plan[self.position]
        self.position += 1
        return call

    def add(self, route: DecodeRoute, turn: int, seconds: float) -> None:
        self.samples[route].setdefault(turn, []).append(seconds)

    def timed_calls(self, route: DecodeRoute) -> int:
        return sum(map(len, self.samples[route].values()))

    def seconds(self, route: DecodeRoute) -> float | None:
        """A call's time on ``route``: the median of its best turn among those timed on
        ``TURN_CALLS`` calls or more (of all its calls where none was), None before any."""
        by_turn = self.samples[route].values()
        turns = [statistics.median(times) for times in by_turn if len(times) >= TURN_CALLS]
        if turns:
            return min(turns)
        every = [t for times in by_turn for t in times]
        return statistics.median(every) if every else None

    def _decide(self) -> None:
        kernels, stock = self.seconds("kernels"), self.seconds("stock")
        if (kernels is not None and stock is not None
                and min(self.timed_calls("kernels"), self.timed_calls("stock")) >= TIMED_CALLS):
            self.chosen = "stock" if stock < kernels else "kernels"
        elif self.trials < MAX_TRIALS:
            self._add_trial()
        else:
            self.chosen = "kernels"

    def report(self) -> dict[str, Any]:
        def ms(route: DecodeRoute) -> float | None:
            seconds = self.seconds(route)
            return None if seconds is None else 1e3 * seconds

        return {"route": self.chosen, "kernels_ms": ms("kernels"), "stock_ms": ms("stock"),
                "timed_calls": {route: self.timed_calls(route) for route in self.samples}}


class RouteTimer:
    """One decoder stack's measured choice between its kernels and its stock layers, for each
    shape of decoding call (``key``: its batch and token rows).

    :meth:`route` is asked at the start of every decoding call: it times the call before (the
    interval between the two starts) if that one was a timed call of the same shape on the same
    thread, and answers the route for this one.

    Args:
        clock: seconds, monotonic (``time.perf_counter``); the attribute ``clock`` can be replaced.
    """

    __slots__ = ("_choices", "_last", "clock", "_lock")

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._choices: dict[Hashable, _Choice] = {}
        # the last call: (thread, key, route, the turn it is timed in, start), or None where it
        # is not to be timed
        self._last: tuple[int, Hashable, DecodeRoute, int | None, float] | None = None
        self.clock = clock
        self._lock = threading.Lock()

    def route(self, key: Hashable) -> DecodeRoute:
        """The route of a decoding call of shape ``key`` starting now."""
        choice = self._choices.get(key)
        if choice is not None and choice.chosen is not None:  # decided: the common case, no clock
            self._last = None
            return choice.chosen
        now, thread = self.clock(), threading.get_ident()
        with self._lock:
            if choice is None:
                choice = self._choices.setdefault(key, _Choice())
            last = self._last
            if last is not None and last[3] is not None and last[0] == thread and last[1] == key:
                choice.add(last[2], last[3], now - last[4])
            route, turn = choice.next_route()
            self._last = (thread, key, route, turn, now) if choice.chosen is None else None
            return route

    def chosen(self, key: Hashable) -> DecodeRoute | None:
        """The route chosen for calls of shape ``key``, or None while it is being measured."""
        choice = self._choices.get(key)
        return None if choice is None else choice.chosen

    def report(self) -> dict[Hashable, dict[str, Any]]:
        """Each call shape measured: the route chosen (None while measuring), each route's time a
        call in milliseconds (its best turn's median), and how many calls of each were timed."""
        return {key: choice.report() for key, choice in self._choices.items()}

    def forget(self) -> None:
        """Measure every shape again from the next call."""
        with self._lock:
            self._choices.clear()
            self._last = None


def decode_route_choices(model: Any) -> dict[str, dict[Hashable, dict[str, Any]]]:
    """What each patched decoder stack in ``model`` chose for its decoding calls on the ``"auto"``
    route, by the stack's path and then by call shape ``(batch, tokens)`` (see
    :meth:`RouteTimer.report`): a stack that has not decoded on a GPU maps to ``{}``, and a model
    without patched decoder stacks gives ``{}``.

    Raises:
        ModelError: ``model`` is not an ``nn.Module`` (a ``WrappedModel``: pass its ``.model``).

    >>> import mlx.nn as nn
    >>> decode_route_choices(nn.Linear(2, 2))
    {}
    """
    if not isinstance(model, nn.Module):
        raise ModelError("read the decoding routes chosen",
                         f"decode_route_choices takes an mlx.nn.Module and got {type(model).__name__}",
                         Status.INVALID_INPUT)
    found = {}
    for path, module in model.named_modules():
        timer = getattr(module, "__dict__", {}).get("_gk_route_timer")
        if isinstance(timer, RouteTimer):
            found[path] = timer.report()
    return found
