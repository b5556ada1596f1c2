import mlx.core as mx
import networkx as nx

import graphkern as gk
from graphkern.capture import bulk_multidigraph, innermost_common_scope
from graphkern.graph import topological_order


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


def test_topological_order_is_valid_and_stable():
    g = nx.gnp_random_graph(60, 0.1, seed=3, directed=True)
    dag = nx.MultiDiGraph((u, v) for u, v in g.edges() if u < v)
    order = topological_order(dag)
    position = {n: i for i, n in enumerate(order)}
    assert all(position[u] < position[v] for u, v in dag.edges())
    assert order == topological_order(dag)


def test_common_scope_of_merged_primitives():
    assert innermost_common_scope({"a.b"}) == "a.b"
    assert innermost_common_scope({"a", "a.b", "a.b.c"}) == "a.b.c"
    assert innermost_common_scope({"layers.0.norm", "layers.1.norm"}) == "layers"
    assert innermost_common_scope({"x", "y"}) == ""


def test_very_deep_graphs_trace_without_overflowing_the_stack():
    # MLX's export recurses per primitive; the default 8 MiB stack dies near 50,000.
    def deep(x):
        for _ in range(15_000):
            x = mx.tanh(mx.sin(x) * x + x)
        return x

    g = gk.trace(deep, mx.ones((2,)))
    assert len(g.nodes("op")) == 60_000 and g.ok
