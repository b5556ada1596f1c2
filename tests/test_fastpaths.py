"""Each fast path of graphkern.launching.fastpaths agrees with the public route it stands for."""

from __future__ import annotations

import os

import mlx.core as mx
import networkx as nx
import pytest

import graphkern as gk
from graphkern.launching import launch_paths, validation
from graphkern.launching.fastpaths import (
    BACKEND_VARIABLE,
    adjacency,
    bulk_multidigraph,
    environ_get,
    move_out_edges,
)


def _decoded(raw: object) -> object:
    return raw.decode() if isinstance(raw, bytes) else raw


@pytest.mark.parametrize("value", [None, "reference", "metal", ""])
def test_the_raw_environment_read_agrees_with_os_environ(monkeypatch: pytest.MonkeyPatch,
                                                          value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("GRAPHKERN_BACKEND", raising=False)
    else:
        monkeypatch.setenv("GRAPHKERN_BACKEND", value)
    assert _decoded(environ_get(BACKEND_VARIABLE)) == os.environ.get("GRAPHKERN_BACKEND")


def test_bulk_graph_equals_the_public_api_graph():
    nodes = {f"n{i}": {"kind": "op", "i": i} for i in range(6)}
    edges = [("n0", "n1", "A", {"shape": (2,)}), ("n0", "n1", "B", {"shape": (3,)}),
             ("n1", "n2", "C", {}), ("n0", "n5", "D", {}), ("n3", "n4", "E", {})]
    expected = nx.MultiDiGraph()
    expected.add_nodes_from(nodes.items())
    expected.add_edges_from(edges)
    built = bulk_multidigraph(nodes, edges)
    assert nx.utils.graphs_equal(built, expected)
    assert list(built.predecessors("n1")) == ["n0"] and built.number_of_edges("n0", "n1") == 2
    assert built.in_degree("n1") == 2 and built.out_degree("n0") == 3
    built.remove_node("n1")  # and it stays a normal, mutable networkx graph
    assert "n1" not in built.succ["n0"] and built.number_of_edges() == 2



def test_adjacency_is_what_the_public_views_show() -> None:
    g = nx.MultiDiGraph([("a", "b"), ("a", "b"), ("b", "c"), ("x", "c")])
    g.nodes["a"]["kind"] = "input"
    nodes, pred, succ = adjacency(g)
    assert {n: dict(d) for n, d in nodes.items()} == dict(g.nodes(data=True))
    assert {n: set(p) for n, p in pred.items()} == {n: set(g.predecessors(n)) for n in g}
    assert {n: set(s) for n, s in succ.items()} == {n: set(g.successors(n)) for n in g}


def test_an_eager_replay_gives_what_the_plain_launch_gives(opaque_gpu: list[str]) -> None:
    kernel = gk.Kernel("fast_replay", ["x", "y"], ["out"], cuda="/* stands in */",
                       reference=lambda x, y: [x * 3 + y])
    spec = [gk.OutputSpec((5,), mx.float32)]
    config = dict(grid=(5, 1, 1), threadgroup=(5, 1, 1))
    x, y = mx.arange(5, dtype=mx.float32), mx.ones((5,))
    launch, inputs = validation.validate(kernel, [x, y], spec, **config)
    plain = launch_paths.run_launch(launch, inputs)[0].tolist()
    assert launch_paths.eager_form(launch) is not None  # built by that first run
    for i in range(3):  # every later gk.apply replays the compiled form
        assert gk.apply(kernel, [x + i, y], spec, **config)[0].tolist() == [v + 3 * i for v in plain]
    with gk.without_vjp():
        assert launch_paths.eager_form(launch) is launch_paths.replayed(launch)
        assert gk.apply(kernel, [x, y], spec, **config)[0].tolist() == plain


def test_moving_a_nodes_out_edges_equals_the_public_api_route():
    def build() -> nx.MultiDiGraph:
        g = nx.MultiDiGraph()
        g.add_edges_from([("a", "tag", "A", {"i": 0}), ("b", "tag", "B", {"i": 1}),
                          ("tag", "c", "T1", {"shape": (2,)}), ("tag", "c", "T2", {"shape": (3,)}),
                          ("tag", "d", "T1", {"shape": (2,)}), ("tag", "e", "T3", {})])
        return g

    sources = {"T1": ("a", "A"), "T2": ("b", "B")}  # T3: nothing made it, the edge goes
    expected = build()
    for _, dst, key, data in list(expected.out_edges("tag", keys=True, data=True)):
        if key in sources:
            expected.add_edge(sources[key][0], dst, key=sources[key][1], **data)
    expected.remove_node("tag")
    moved = build()
    move_out_edges(moved, "tag", sources.get)
    assert nx.utils.graphs_equal(moved, expected)
    assert sorted(moved.edges(keys=True)) == sorted(expected.edges(keys=True))
    assert list(moved.predecessors("c")) == ["a", "b"] and "tag" not in moved


@pytest.mark.parametrize("enabled", [True, False])
def test_the_paused_collector_is_left_as_it_was_found(enabled: bool) -> None:
    import gc

    from graphkern.launching.fastpaths import gc_paused

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(ValueError), gc_paused():
            raise ValueError("a failing trace")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
