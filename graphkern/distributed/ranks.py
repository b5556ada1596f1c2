"""One picture of a whole job: every rank's graph in one, collectives linked across ranks.

``gather`` collects every rank's graph on every rank (two ``all_gather`` calls every rank makes);
``merge`` joins graphs of several ranks, read back from JSON or gathered, into one ``Graph``:
each rank's nodes sit under a top-level scope ``rank0``, ``rank1``... (a lane in the viewer, a
cluster in DOT, a namespace in Model Explorer) with ids ``rank0/<node>``; the k-th communicating
collective of every rank (``all_sum``, ``all_gather``, ``all_max``, ``all_min``, ``sum_scatter``)
reads the arrays every other rank gave its own k-th, and a ``recv`` reads its matching ``send``:
edges marked ``cross_rank``. Statuses are propagated over the whole job, so a rank's failure marks
what it reaches on every rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import networkx as nx

from ..nodes import KernelError, NodeKind, Status
from ..tracing.graph import Graph
from .agreement import GROUP_WIDE, Collective, collectives_of, gather_bytes

__all__ = ["gather", "merge"]

_MERGE = "merge the graphs of several ranks"


def gather(graph: Graph, group: Any = None) -> list[Graph]:
    """Every rank's ``graph``, in rank order, on every rank (each rank must call it).

    >>> import mlx.core as mx, graphkern as gk
    >>> g = gk.trace(lambda x: mx.distributed.all_sum(x) + 1, mx.ones((2,)))
    >>> [h.nx.graph["rank"] for h in gather(g)]          # one process: a group of one
    [0]
    """
    group = group if group is not None else mx.distributed.init()
    graphs = [Graph.from_json(text) for text in gather_bytes(group, graph.to_json().encode())]
    for rank, g in enumerate(graphs):
        g.nx.graph["rank"] = rank
    return graphs


def _rank_of(graph: Graph, position: int) -> int:
    rank = graph.nx.graph.get("rank")
    if isinstance(rank, int) and not isinstance(rank, bool):
        return rank
    ranks = [d["rank"] for _, d in graph.nx.nodes(data=True)
             if d.get("kind") == str(NodeKind.COLLECTIVE) and isinstance(d.get("rank"), int)]
    return ranks[0] if ranks else position


def merge(graphs: Sequence[Graph]) -> Graph:
    """The graphs of a job's ranks as one ``Graph`` (see the module's text).

    >>> import mlx.core as mx, graphkern as gk
    >>> g = gk.trace(lambda x: mx.distributed.all_sum(x) + 1, mx.ones((2,)))
    >>> job = merge([g])
    >>> job.nodes("collective"), job.node("rank0/all_sum")["scope"]
    (['rank0/all_sum'], 'rank0')
    """
    if not graphs:
        raise KernelError(_MERGE, "no graphs given", Status.INVALID_INPUT)
    by_rank: dict[int, Graph] = {}
    for position, graph in enumerate(graphs):
        if not isinstance(graph, Graph):
            raise KernelError(_MERGE, f"expected graphkern Graphs, got {type(graph).__name__}",
                              Status.INVALID_INPUT)
        rank = _rank_of(graph, position)
        if rank in by_rank:
            raise KernelError(_MERGE, f"two graphs are of rank {rank}", Status.INVALID_INPUT)
        by_rank[rank] = graph
    job = nx.MultiDiGraph()
    first = by_rank[min(by_rank)].nx.graph
    job.graph.update(name=f"{first.get('name', 'graph')} on {len(by_rank)} ranks",
                     backend=first.get("backend", ""), mlx_version=first.get("mlx_version", ""),
                     ranks=sorted(by_rank),
                     modules={f"rank{rank}.{path}": cls for rank, g in by_rank.items()
                              for path, cls in (g.nx.graph.get("modules") or {}).items()},
                     kernel_sources={h: src for g in by_rank.values()
                                     for h, src in (g.nx.graph.get("kernel_sources") or {}).items()})
    for rank in sorted(by_rank):
        _add_rank(job, rank, by_rank[rank].nx)
    unmatched = _link(job, {rank: by_rank[rank] for rank in sorted(by_rank)})
    if unmatched:
        job.graph["unmatched_collectives"] = unmatched
    return Graph(job)


def _name(rank: int, node: Any) -> str:
    return f"rank{rank}/{node}"


def _add_rank(job: nx.MultiDiGraph, rank: int, g: nx.MultiDiGraph) -> None:
    lane = f"rank{rank}"
    for node, data in g.nodes(data=True):
        copy = dict(data)
        copy["scope"] = f"{lane}.{data['scope']}" if data.get("scope") else lane
        copy["on_rank"] = rank
        if data.get("root_cause") is not None:
            copy["root_cause"] = _name(rank, data["root_cause"])
        job.add_node(_name(rank, node), **copy)
    for u, v, key, data in g.edges(keys=True, data=True):
        job.add_edge(_name(rank, u), _name(rank, v), key=key, **data)


def _link(job: nx.MultiDiGraph, graphs: dict[int, Graph]) -> list[str]:
    """Add the cross-rank edges; what could not be matched, as sentences."""
    collectives = {rank: collectives_of(g) for rank, g in graphs.items()}
    unmatched = _link_group_wide(job, collectives) + _link_messages(job, collectives)
    if not nx.is_directed_acyclic_graph(job):  # collectives matched out of their call order
        job.remove_edges_from([(u, v, k) for u, v, k, d in job.edges(keys=True, data=True)
                               if d.get("cross_rank")])
        unmatched.append("the ranks' collectives cannot be matched in call order")
    return unmatched


def _link_group_wide(job: nx.MultiDiGraph, collectives: dict[int, list[Collective]]) -> list[str]:
    """The k-th group-wide collective of every rank reads what every other rank gave its own,
    while the ranks' sequences agree."""
    sequences = {rank: [c for c in cs if c.op in GROUP_WIDE] for rank, cs in collectives.items()}
    for k in range(max(len(s) for s in sequences.values())):
        members = {rank: s[k] for rank, s in sequences.items() if k < len(s)}
        if len(members) != len(sequences) or len({c.signature for c in members.values()}) != 1:
            return [f"collective #{k} differs across ranks: " + "; ".join(
                f"rank {r}: {c.describe()}" for r, c in members.items())]
        for rank, mine in members.items():
            given = [(u, key, data) for u, _, key, data in
                     job.in_edges(_name(rank, mine.node), keys=True, data=True)
                     if not data.get("cross_rank")]
            for other, theirs in members.items():
                if other != rank:
                    _cross(job, given, rank, _name(other, theirs.node))
    return []


def _link_messages(job: nx.MultiDiGraph, collectives: dict[int, list[Collective]]) -> list[str]:
    """The k-th ``recv`` of rank d from rank s reads the k-th ``send`` of s to d."""
    sends: dict[tuple[int, int], list[str]] = {}
    for rank, cs in collectives.items():
        for c in cs:
            if c.op == "send" and c.peer is not None:
                sends.setdefault((rank, c.peer), []).append(_name(rank, c.node))
    unmatched, taken = [], Counter[tuple[int, int]]()
    for rank, cs in collectives.items():
        for c in cs:
            if c.op != "recv" or c.peer is None:
                continue
            channel = (c.peer, rank)
            queue, k = sends.get(channel, []), taken[channel]
            taken[channel] += 1
            if k >= len(queue):
                unmatched.append(f"rank {rank}: {c.describe()} has no matching send")
                continue
            sent = [(queue[k], key, data) for _, _, key, data in
                    job.in_edges(queue[k], keys=True, data=True) if not data.get("cross_rank")]
            _cross(job, sent[:1], c.peer, _name(rank, c.node))
    return unmatched


def _cross(job: nx.MultiDiGraph, sources: list[tuple[str, Any, dict[str, Any]]], rank: int,
           target: str) -> None:
    index = job.in_degree(target)
    for source, key, data in sources:
        job.add_edge(source, target, key=f"rank{rank}/{key}", shape=tuple(data["shape"]),
                     dtype=data["dtype"], index=index, cross_rank=True)
        index += 1
