"""What a compiled graph needs to run on several ranks: the group, the agreement, the watchdog.

``gk.compile`` and ``gk.wrap`` hold a :class:`RankSync` when the function they compile runs over
a group of more than one rank (``group=``, else a ``mx.distributed.Group`` held by one of its
modules, as mlx-lm's sharded layers hold theirs). It agrees with the other ranks before a new
signature runs (``graphkern.distributed.agreement``) and, with ``timeout=``, watches every call
that may communicate (``graphkern.distributed.watchdog``) and checks, before it runs, that every
rank is about to run a graph with the same collectives (``check_step``). Without ``timeout=``
steady calls cost nothing more.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx

from ..compiling.extensions import describe_call
from ..nodes import KernelError, Status
from ..tracing.graph import Graph
from .agreement import COMMUNICATING, GroupError, StepCheck, agree, check_step, collectives_of
from .watchdog import Job

__all__ = ["RankSync", "find_group", "rank_sync"]


def find_group(modules: Any) -> Any:
    """The largest ``mx.distributed.Group`` held as an attribute by one of ``modules`` (mlx-lm's
    sharded linears hold ``group``, its MoE blocks ``sharding_group``), or None.

    >>> find_group([]) is None
    True
    """
    best = None
    for module in modules:
        for value in vars(module).values():
            if isinstance(value, mx.distributed.Group) and (best is None or value.size() > best.size()):
                best = value
    return best


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise KernelError("compile a graphkern graph", f"timeout must be a positive number of seconds, "
                          f"got {timeout!r}", Status.INVALID_INPUT)
    return float(timeout)


def rank_sync(modules: Any, group: Any = None, timeout: Any = None) -> RankSync | None:
    """The ``RankSync`` of a function whose modules are ``modules``, or None when it runs on one
    rank (no group of more than one found, none given). ``timeout`` is checked either way."""
    seconds = _check_timeout(timeout)
    if group is not None and not isinstance(group, mx.distributed.Group):
        raise KernelError("compile a graphkern graph", f"group must be an mx.distributed.Group, got "
                          f"{type(group).__name__}", Status.INVALID_INPUT)
    group = group if group is not None else find_group(modules)
    if group is None or group.size() == 1:
        return None
    return RankSync(group, seconds)


class RankSync:
    """The agreement and the watchdog of one compiled function on its group (see the module)."""

    def __init__(self, group: Any, timeout: float | None) -> None:
        self.group = group
        self.timeout = timeout
        self.job = Job.of(group) if timeout is not None else None
        self._outcomes: dict[Any, GroupError | None] = {}
        # per graph: the call it traced (for messages) and its collectives, described once
        self._described: dict[int, tuple[Graph, str, tuple[str, ...]]] = {}
        self._steps: dict[int, tuple[Graph, StepCheck]] = {}  # per graph: what check_step sends
        self._agreed: Graph | None = None  # the graph agreed on in this call: no check needed

    def agree(self, key: Any, graph: Graph | None, error: KernelError | None, what: str) -> None:
        """Agree once per signature ``key``; raises the ``GroupError`` every rank raises.
        ``what`` names the call (``describe_call``)."""
        if key not in self._outcomes:
            with self.watch(graph, f"agreement on {what}", what):
                job = self.job
                outcome, token = agree(self.group, graph, error, what,
                                       job.proposal if job is not None else 0)
                if outcome is None or not outcome.crossed:
                    self._outcomes[key] = outcome
                if job is not None:
                    job.join(token)  # the job's flight folder is named after rank 0's token
            self._agreed = graph if outcome is None else None
        else:
            outcome = self._outcomes[key]
        if outcome is not None:
            if not outcome.in_step:
                self.failed(outcome)  # with a watchdog, the others hear of it before they hang
            raise outcome

    def evaluate(self, outputs: Any, graph: Graph | None = None, call: str | None = None,
                 inputs: list[mx.array] | None = None) -> None:
        """Evaluate ``outputs`` as one watched call (``graph`` the trace they come from, ``call``
        its name when there is none); as ``mx.eval`` without a watchdog. A watched call of a
        graph first checks that every rank runs the same collectives (``check_step``, unless the
        ranks agreed on this graph in this very call): else it raises ``GroupError`` on every
        rank and nothing runs. ``inputs`` (the call's arrays) name the call in that error."""
        agreed, self._agreed = self._agreed, None
        with self.watch(graph, call):
            if graph is not None and self.job is not None and graph is not agreed:
                self._check(graph, inputs or [])
            mx.eval(outputs)

    def _check(self, graph: Graph, inputs: list[mx.array]) -> None:
        known = self._steps.get(id(graph))
        if known is None or known[0] is not graph:
            known = self._steps[id(graph)] = (graph, StepCheck(self.group.rank(), graph))
        name = str(graph.nx.graph.get("name", "graph"))
        error = check_step(self.group, known[1], describe_call(name, inputs))
        if error is not None:
            raise error

    @contextmanager
    def watch(self, graph: Graph | None, call: str | None = None, what: str | None = None) -> Iterator[None]:
        """The body as one watched call when there is a watchdog, else as it is. ``call`` names
        it in the flight record (default: the call ``graph`` was traced for)."""
        if self.job is None or self.timeout is None:
            yield
            return
        traced, collectives = self._describe(graph, what)
        with self.job.watch(self.timeout, call or traced, collectives):
            yield

    def failed(self, error: Exception) -> None:
        """This rank failed while running: abort the job (with a watchdog) so no rank waits."""
        self._agreed = None  # the call agreed on never ran: the next one is checked
        if self.job is not None:
            self.job.fail(error)

    def forget(self, graph: Graph) -> None:
        """Drop what is kept for ``graph`` (its trace was dropped). The signature's agreement is
        kept: tracing it again gives the same graph, and the other ranks do not agree again."""
        for table in (self._described, self._steps):
            known = table.get(id(graph))
            if known is not None and known[0] is graph:
                del table[id(graph)]

    def clear(self) -> None:
        self._agreed = None
        self._outcomes.clear()
        self._described.clear()
        self._steps.clear()

    def _describe(self, graph: Graph | None, what: str | None) -> tuple[str, tuple[str, ...]]:
        if graph is None:
            return what or "a call", ()
        known = self._described.get(id(graph))
        if known is None or known[0] is not graph:
            known = self._described[id(graph)] = (
                graph, what or str(graph.nx.graph.get("name", "graph")),
                tuple(c.describe() for c in collectives_of(graph) if c.op in COMMUNICATING))
        return known[1], known[2]


