import mlx.core as mx
import networkx as nx
import pytest

import graphkern as gk
from graphkern.tracing.capture import innermost_common_scope
from graphkern.tracing.graph import topological_order


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


@pytest.mark.slow
def test_very_deep_graphs_trace_without_overflowing_the_stack():
    # MLX's export recurses per primitive; the default 8 MiB stack dies near 50,000.
    def deep(x):
        for _ in range(15_000):
            x = mx.tanh(mx.sin(x) * x + x)
        return x

    g = gk.trace(deep, mx.ones((2,)))
    assert len(g.nodes("op")) == 60_000 and g.ok
