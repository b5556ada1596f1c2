"""Property tests: launch validation and status propagation on random DAGs."""

import mlx.core as mx
import networkx as nx
from hypothesis import given
from hypothesis import strategies as st
from kernels_fixture import SCALE_ADD

import graphkern as gk
from graphkern.tracing.graph import propagate_status

dims = st.one_of(st.integers(-3, 40), st.sampled_from([0, 2**31, 2**31 - 1, 1025]),
                 st.floats(allow_nan=False, width=16), st.booleans())
triples = st.one_of(st.tuples(dims, dims, dims), st.lists(st.integers(1, 8), max_size=4))
dtypes = st.sampled_from([mx.float32, mx.float16, mx.int32, "float32", None])
template_values = st.one_of(st.sampled_from([mx.float32, mx.float16]), st.integers(-5, 5),
                            st.booleans(), st.floats(allow_nan=False), st.text(max_size=3))


def expected_problem(grid, threadgroup, shape, dtype, template):
    """The status a correct validator must report (specs, then launch, then template), or None."""

    def bad(d):
        return not (type(d) is int and 0 < d < 2**31)

    if any(type(d) is not int or d < 0 for d in shape) or not isinstance(dtype, mx.Dtype):
        return gk.Status.INVALID_OUTPUT_SPEC
    for dimsn in (grid, threadgroup):
        if not isinstance(dimsn, (tuple, list)) or len(dimsn) != 3 or any(bad(d) for d in dimsn):
            return gk.Status.INVALID_LAUNCH
    if threadgroup[0] * threadgroup[1] * threadgroup[2] > 1024:
        return gk.Status.INVALID_LAUNCH
    names = [n for n, _ in template]
    if len(set(names)) != len(names) or any(
            not isinstance(v, (mx.Dtype, int)) or (type(v) is int and abs(v) >= 2**31)
            for _, v in template):
        return gk.Status.INVALID_TEMPLATE
    return None


@given(grid=triples, threadgroup=triples, dtype=dtypes,
       shape_extra=st.lists(st.integers(-2, 3), max_size=2),
       template=st.lists(st.tuples(st.sampled_from(["T", "N", "B"]), template_values), max_size=3))
def test_launch_validation_matches_the_rules(grid, threadgroup, dtype, shape_extra, template):
    x = mx.arange(6, dtype=mx.float32)
    shape = (6,) if not shape_extra else (6, *shape_extra)
    spec = [gk.OutputSpec(shape, dtype)]
    kernel = gk.Kernel("prop", ["x", "y"], ["out"],
                       reference=lambda x, y: [(x * 2 + y).reshape(shape) if shape == (6,) else
                                               mx.zeros(shape, dtype)])
    expected = expected_problem(grid, threadgroup, shape, dtype, template)
    result = gk.apply_in_graph(kernel, [x, x], spec, grid=grid, threadgroup=threadgroup,
                               template=template)
    if expected is None:
        assert result.ok, result.error
        assert result.outputs[0].shape == shape and result.outputs[0].dtype == dtype
    else:
        assert result.status == expected, (result.status, result.error)
        assert result.error.operation == "apply a graphkern kernel"
    # the same launch through apply raises exactly when apply_in_graph reports a failure
    try:
        gk.apply(kernel, [x, x], spec, grid=grid, threadgroup=threadgroup, template=template)
        raised = None
    except gk.KernelError as exc:
        raised = exc.status
    assert raised == (None if result.ok else result.status)
    assert gk.apply(SCALE_ADD, [x, x], [gk.OutputSpec((6,), mx.float32)], grid=(6, 1, 1),
                    threadgroup=(6, 1, 1))[0].tolist() == (x * 3).tolist()


@st.composite
def random_dags(draw):
    n = draw(st.integers(1, 25))
    edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=60))
    failed = draw(st.lists(st.integers(0, n - 1), max_size=4))
    codes = draw(st.lists(st.sampled_from([s for s in gk.Status if s not in
                                           (gk.Status.OK, gk.Status.UPSTREAM_FAILED)]),
                          min_size=len(failed), max_size=len(failed)))
    g = nx.MultiDiGraph()
    g.add_nodes_from((i, {"status": 0}) for i in range(n))
    g.add_edges_from((min(u, v), max(u, v)) for u, v in edges if u != v)
    for node, code in zip(failed, codes):
        g.nodes[node]["status"] = int(code)
    return g, dict(zip(failed, codes))


#: Failures that depend on what a node was given: below another failure, not roots of their own.
FOLLOW_ON = {gk.Status.MODULE_ERROR, gk.Status.INVALID_INPUT, gk.Status.REFERENCE_ERROR,
             gk.Status.RUNTIME_ERROR}


@given(random_dags())
def test_propagation_marks_exactly_the_descendants_with_their_earliest_root(case):
    g, failed = case
    roots = propagate_status(g)
    order = {n: g.nodes[n]["order"] for n in g}
    assert all(order[u] < order[v] for u, v in g.edges())
    real = {n for n, code in failed.items()
            if code not in FOLLOW_ON or not any(a in failed for a in nx.ancestors(g, n))}
    assert set(roots) == real and roots == sorted(roots, key=order.__getitem__)
    for node in g:
        data = g.nodes[node]
        upstream_roots = [a for a in nx.ancestors(g, node) if a in real]
        if node in real:
            assert data["status"] == failed[node] and data["root_cause"] == node
        elif node in failed:  # it failed on a failed node's placeholder
            assert data["status"] == gk.Status.UPSTREAM_FAILED
            assert data["root_cause"] == min(upstream_roots, key=order.__getitem__)
            assert data["message"].startswith("failed after its input came from failed node")
        elif upstream_roots:
            assert data["status"] == gk.Status.UPSTREAM_FAILED
            assert data["root_cause"] == min(upstream_roots, key=order.__getitem__)
        else:
            assert data["status"] == gk.Status.OK and data["root_cause"] is None
