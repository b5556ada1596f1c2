"""Ranks agree before they run a new signature: statuses and collective sequences, exchanged once.

Every rank traces a new signature on its own. Before any rank runs it, the ranks exchange in one
``all_gather`` of a few dozen bytes each rank's status and a fingerprint of its collective sequence
(op, reduction, group size, shapes and dtypes of every group-wide collective in call order, and a
hash of its point-to-point messages). When every rank is OK and the sequences agree, all run.
Otherwise every rank takes a second, equally symmetric exchange of the details and raises the same
:class:`GroupError`: the first failing rank with its root-cause node and status, or the first
collective that differs. Both exchanges are entered by every rank, so the group stays usable.
The header also carries a job token (rank 0's stands): the watchdog names the job's flight folder
after it.

Ranks that each traced two signatures can still call them crosswise (rank 0 one, rank 1 the
other), which no agreement sees. Watched calls (``timeout=``) check every call: :func:`check_step`
exchanges the fingerprint of the graph each rank is about to run (one ``all_gather`` of 44 bytes)
and refuses the call on every rank when they differ.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from ..nodes import KernelError, NodeKind, Status
from ..tracing.graph import Failure, Graph, GraphError
from .collectives import REAL

__all__ = ["COMMUNICATING", "GROUP_WIDE", "Collective", "GroupError", "StepCheck", "agree", "check_step",
           "collectives_of", "exchange_bytes", "gather_bytes"]

_AGREE = "run a graphkern compiled graph across ranks"
_HEADER = struct.Struct("<IiQQQIQ")  # magic, status, fingerprint, sends, receives, detail bytes, token
_MAGIC = 0x67_6B_61_67  # "gkag"
_STEP_MAGIC = 0x67_6B_73_74  # "gkst": check_step's header, the same size as an agreement's
_MASK = (1 << 64) - 1
_P2P = ("send", "recv")
#: the collectives every rank of the group enters together
GROUP_WIDE = frozenset({"all_sum", "all_gather", "all_max", "all_min", "sum_scatter"})
#: the collectives that move data in a forward pass (``sum_gradients`` only does in the backward)
COMMUNICATING = GROUP_WIDE | frozenset(_P2P)


class GroupError(GraphError):
    """Raised on every rank when the ranks cannot run a call together: a rank's graph has a failed
    node (``rank``, ``node`` and ``status`` name it), or the ranks' collective sequences differ
    (``collective`` is the position of the first that differs). Every rank raises it at the same
    point, so the group stays usable for the next call (``in_step``; False only when the ranks
    were found running different code).

    >>> err = GroupError("rank 1 of 2: node 'k' failed", Status.INVALID_LAUNCH, rank=1, node="k")
    >>> err.rank, err.node, err.status.name
    (1, 'k', 'INVALID_LAUNCH')
    """

    def __init__(self, description: str, status: Status, *, rank: int | None = None,
                 node: str | None = None, collective: int | None = None,
                 operation: str = _AGREE, in_step: bool = True) -> None:
        KernelError.__init__(self, operation, description, status)
        self.rank = rank
        self.node = node  # type: ignore[assignment]
        self.collective = collective
        self.in_step = in_step
        self.crossed = False
        self.failure = Failure(node or "<ranks>", self.status, description, ())
        self.affected_outputs = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.description, self.status, self.rank, self.node,
                           self.collective, self.operation, self.in_step))


def _rebuild(cls: type[GroupError], description: str, status: Status, rank: int | None,
             node: str | None, collective: int | None, operation: str, in_step: bool) -> GroupError:
    return cls(description, status, rank=rank, node=node, collective=collective, operation=operation,
               in_step=in_step)


@dataclass(frozen=True)
class Collective:
    """One collective node of a rank's graph, as the ranks compare them."""

    index: int  # position among the call's collectives
    node: str
    op: str
    reduce: str | None
    group_size: int
    peer: int | None
    inputs: tuple[str, ...]  # "float32[1, 3, 64]" each
    outputs: tuple[str, ...]
    scope: str

    @property
    def signature(self) -> str:
        """What must be the same on every rank."""
        reduce = f"({self.reduce})" if self.reduce else ""
        peer = f" peer {self.peer}" if self.peer is not None else ""
        return (f"{self.op}{reduce} {', '.join(self.inputs) or '-'} -> {', '.join(self.outputs)}"
                f" over {self.group_size}{peer}")

    def describe(self) -> str:
        """``all_sum(sum) float32[1, 3, 64] -> ... over 2 in model.layers.0.self_attn.o_proj``."""
        return f"{self.signature} in {self.scope or 'the top level'} ({self.node})"


def collectives_of(graph: Graph) -> list[Collective]:
    """The collective nodes of ``graph`` in call order.

    >>> import mlx.core as mx, graphkern as gk
    >>> [c.op for c in collectives_of(gk.trace(lambda x: mx.distributed.all_sum(x) * 2, mx.ones(2)))]
    ['all_sum']
    """
    g = graph.nx
    found = []
    for node, data in g.nodes(data=True):
        if data.get("kind") != str(NodeKind.COLLECTIVE):
            continue
        ins = sorted(g.in_edges(node, data=True), key=lambda e: e[2].get("index", 0))
        outs: dict[str, str] = {}
        for _, _, key, edge in g.out_edges(node, keys=True, data=True):
            outs.setdefault(key, _tensor(edge))
        found.append(Collective(data.get("call_index", 0), node, data["op"], data.get("reduce"),
                                data.get("group_size", 1), data.get("peer"),
                                tuple(_tensor(e) for _, _, e in ins if not e.get("cross_rank")),
                                tuple(outs.values()), data.get("scope", "")))
    return sorted(found, key=lambda c: c.index)


def _tensor(edge: dict[str, Any]) -> str:
    return f"{edge['dtype']}{list(edge['shape'])}"


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _messages(rank: int, collectives: list[Collective]) -> tuple[list[str], list[str]]:
    """This rank's point-to-point messages as ``src->dst #k dtype[shape]``, sends and receives
    apart; every send of the job must meet a receive written the same way."""
    sends: list[str] = []
    receives: list[str] = []
    count: Counter[tuple[int, int]] = Counter()
    for c in collectives:
        if c.op not in _P2P or c.peer is None:
            continue
        src, dst = (rank, c.peer) if c.op == "send" else (c.peer, rank)
        k = count[(src, dst)]
        count[(src, dst)] += 1
        tensor = (c.inputs if c.op == "send" else c.outputs)[:1]
        text = f"{src}->{dst} #{k} {''.join(tensor)}"
        (sends if c.op == "send" else receives).append(text)
    return sends, receives


@dataclass
class _Report:
    """What one rank tells the others."""

    rank: int
    status: int
    node: str | None
    message: str
    collectives: list[Collective]

    def fingerprints(self) -> tuple[int, int, int]:
        """The group-wide collectives' fingerprint, and the sums of the sends' and receives' hashes."""
        group = [c.signature for c in self.collectives if c.op not in _P2P]
        sends, receives = _messages(self.rank, self.collectives)
        return _hash("\n".join(group)), sum(map(_hash, sends)) & _MASK, sum(map(_hash, receives)) & _MASK

    def header(self, detail: bytes, token: int) -> bytes:
        return _HEADER.pack(_MAGIC, self.status, *self.fingerprints(), len(detail), token)

    def detail(self, call: str = "") -> bytes:
        sends, receives = _messages(self.rank, self.collectives)
        return json.dumps({"rank": self.rank, "status": self.status, "node": self.node, "call": call,
                           "message": self.message, "sends": sends, "receives": receives,
                           "collectives": [[c.signature, c.describe(), c.node]
                                           for c in self.collectives if c.op not in _P2P]}).encode()


def exchange_bytes(group: Any, data: bytes) -> list[bytes]:
    """Every rank's ``data`` (all the same length), in rank order, through one ``all_gather``."""
    array = mx.array(np.frombuffer(data, dtype=np.uint8)) if data else mx.zeros((0,), mx.uint8)
    gathered = REAL["all_gather"](array, group=group)
    mx.eval(gathered)
    rows = np.asarray(gathered).reshape(group.size(), len(data))
    return [row.tobytes() for row in rows]


def gather_bytes(group: Any, data: bytes) -> list[bytes]:
    """Every rank's ``data`` (of any length), in rank order: two ``all_gather`` calls, the lengths
    and then the data padded to the longest."""
    lengths = [int.from_bytes(b, "little") for b in exchange_bytes(group, len(data).to_bytes(8, "little"))]
    return [b[:n] for b, n in zip(exchange_bytes(group, data.ljust(max(lengths), b" ")), lengths)]


def agree(group: Any, graph: Graph | None, error: KernelError | None, what: str,
          token: int = 0) -> tuple[GroupError | None, int]:
    """Exchange this rank's status and collective sequence with the others (see the module's text);
    the error every rank raises (or None when all may run), and rank 0's ``token``. ``graph`` is
    this rank's trace, or None with ``error`` when tracing raised. ``what`` names the call in
    messages."""
    rank, size = group.rank(), group.size()
    report = _report(rank, graph, error)
    detail = report.detail()
    headers = [_HEADER.unpack(h) for h in exchange_bytes(group, report.header(detail, token))]
    crossed = _crossed(headers, what)
    if crossed is not None:
        return crossed, 0
    if any(h[0] != _MAGIC for h in headers):
        return GroupError(f"the ranks' agreement on {what} read garbage: another rank "
                          f"was inside a different collective (the ranks run different code), so "
                          f"the group is out of step", Status.RUNTIME_ERROR, in_step=False), 0
    ok = all(h[1] == 0 for h in headers) and len({h[2] for h in headers}) == 1
    if ok and sum(h[3] for h in headers) & _MASK == sum(h[4] for h in headers) & _MASK:
        return None, headers[0][6]
    longest = max(h[5] for h in headers)
    details = [json.loads(d[:h[5]]) for d, h in
               zip(exchange_bytes(group, detail.ljust(longest, b" ")), headers)]
    return _verdict(details, rank, size, what), headers[0][6]


class StepCheck:
    """What one rank says about a graph it is about to run, for :func:`check_step`: computed once
    per graph."""

    def __init__(self, rank: int, graph: Graph) -> None:
        self.report = _report(rank, graph, None)
        self.header = _HEADER.pack(_STEP_MAGIC, 0, *self.report.fingerprints(), 0, 0)


def check_step(group: Any, step: StepCheck, call: str) -> GroupError | None:
    """Check that every rank is about to run a graph with the same collectives (one ``all_gather``
    of 44 bytes); else every rank gets the same ``GroupError`` naming each rank's call (``call``,
    as ``describe_call`` writes it) and the first collective that differs, and none runs."""
    headers = [_HEADER.unpack(h) for h in exchange_bytes(group, step.header)]
    crossed = _crossed(headers, call)
    if crossed is not None:
        return crossed
    if any(h[0] != _STEP_MAGIC for h in headers):
        return GroupError(f"the ranks' check of {call} read garbage: another rank was inside a "
                          f"different collective (the ranks run different code, or not every rank "
                          f"passed timeout=), so the group is out of step", Status.RUNTIME_ERROR,
                          in_step=False)
    if len({h[2] for h in headers}) == 1 and sum(h[3] for h in headers) & _MASK == \
            sum(h[4] for h in headers) & _MASK:
        return None
    details = [json.loads(d) for d in gather_bytes(group, step.report.detail(call))]
    calls = ", ".join(f"rank {d['rank']} {d['call']}" for d in details)
    return _verdict(details, group.rank(), group.size(), f"this call ({calls})")


def _crossed(headers: list[tuple[Any, ...]], what: str) -> GroupError | None:
    """The error when some ranks agree on a new signature while the others check one they ran
    before (each took one exchange: the group is in step), else None."""
    kinds = {h[0] for h in headers}
    if kinds != {_MAGIC, _STEP_MAGIC}:
        return None
    new = [r for r, h in enumerate(headers) if h[0] == _MAGIC]
    old = [r for r, h in enumerate(headers) if h[0] == _STEP_MAGIC]
    error = GroupError(f"the ranks called with different signatures at {what}: rank(s) {new} met a "
                       f"signature they had not run before, rank(s) {old} one they had; no rank ran it",
                       Status.INVALID_INPUT)
    error.crossed = True  # says nothing about the signature itself: not to be remembered
    return error


def _report(rank: int, graph: Graph | None, error: KernelError | None) -> _Report:
    if graph is None:
        assert error is not None
        return _Report(rank, int(error.status) or int(Status.RUNTIME_ERROR), "<trace>", str(error), [])
    collectives = collectives_of(graph)
    failure = graph.error()
    if failure is None:
        return _Report(rank, 0, None, "", collectives)
    return _Report(rank, int(failure.status), failure.node, failure.failure.message, collectives)


def _verdict(details: list[dict[str, Any]], rank: int, size: int, what: str) -> GroupError:
    failed = [d for d in details if d["status"]]
    if failed:
        first = failed[0]
        status = Status(first["status"])
        others = "".join(f"; rank {d['rank']} failed too ({Status(d['status']).name} at {d['node']!r})"
                         for d in failed[1:])
        return GroupError(f"rank {first['rank']} of {size} cannot run {what}: node {first['node']!r} "
                          f"failed with {status.name}: {first['message']}{others}; no rank ran it",
                          status, rank=first["rank"], node=first["node"])
    sequences = [d["collectives"] for d in details]
    longest = max(len(s) for s in sequences)
    for k in range(longest):
        entries = [s[k] if k < len(s) else None for s in sequences]
        if len({e[0] if e else None for e in entries}) == 1:
            continue
        lines = "; ".join(f"rank {r}: " + (e[1] if e else f"none (it has {len(sequences[r])})")
                          for r, e in enumerate(entries))
        mine = entries[rank]
        return GroupError(f"the ranks' collectives differ for {what}: collective #{k}: "
                          f"{lines}; no rank ran it", Status.RUNTIME_ERROR,
                          node=mine[2] if mine else None, collective=k)
    sends = Counter(m for d in details for m in d["sends"])
    receives = Counter(m for d in details for m in d["receives"])
    unmatched = sorted((sends - receives).elements()) + [f"{m} (received, never sent)" for m in
                                                         sorted((receives - sends).elements())]
    return GroupError(f"the ranks' point-to-point messages do not pair up for {what}: "
                      f"{'; '.join(unmatched[:6])}; no rank ran it", Status.RUNTIME_ERROR)

