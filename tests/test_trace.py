import mlx.core as mx
import mlx.nn as nn
import networkx as nx
import pytest
from kernels_fixture import SCALE_ADD, scale_add, split_sign

import graphkern as gk

X = mx.arange(8, dtype=mx.float32)
Y = mx.ones((8,))


def mlx_primitives(fn, *args):
    names = []
    mx.export_function(lambda e: names.append(e["name"]) if e["type"] == "primitive" else None, fn, *args)
    return sorted(names)


@pytest.mark.parametrize(
    "fn, args",
    [
        (lambda x, y: mx.exp(x) + y * 2, (X, Y)),
        (lambda x: mx.softmax(x.reshape(2, 4), axis=-1).sum(), (X,)),
        (lambda a, b: (a @ b, mx.maximum(a, 0).T), (mx.ones((3, 3)), mx.ones((3, 3)))),
    ],
)
def test_ops_match_mlx_primitives_one_for_one(fn, args):
    g = gk.trace(fn, *args)
    assert sorted(g.nx.nodes[n]["op"] for n in g.nodes("op")) == mlx_primitives(fn, *args)
    assert len(g.nodes("input")) == len(args)
    assert g.status == gk.Status.OK and g.ok


def test_edges_carry_shapes_and_dtypes():
    g = gk.trace(lambda x: (x.astype(mx.float16) * 2).reshape(2, 4), X)
    shapes = {(g.nx.nodes[u]["op"], d["dtype"], d["shape"]) for u, _, d in g.nx.edges(data=True)}
    assert ("AsType", "float16", (8,)) in shapes
    assert ("Reshape", "float16", (2, 4)) in shapes
    assert nx.is_directed_acyclic_graph(g.nx)


def test_each_kernel_call_is_exactly_one_kernel_node():
    def fn(x, y):
        a = scale_add(x, y).outputs[0]
        pos, neg = split_sign(a - 3).outputs
        return pos * neg + 1, a

    g = gk.trace(fn, X, Y)
    assert [g.node(k)["kernel"] for k in g.kernels()] == ["scale_add", "split_sign"]
    assert sorted(g.nx.nodes[n]["op"] for n in g.nodes("op")) == ["Add", "Broadcast", "Broadcast",
                                                                  "Multiply", "Subtract"]
    assert g.inputs_of("scale_add") == ["x", "y"]
    assert g.output_types("split_sign") == ["float32[8]", "float32[8]"]
    # no tag or Depends survives
    assert not [n for n in g.nx if g.nx.nodes[n]["op"] == "Depends"]
    node = g.node("scale_add")
    assert node["backend"] == "reference" and node["grid"] == [8, 1, 1]
    assert node["threadgroup"] == [256, 1, 1] and node["template"] == [["T", "float32"]]
    assert node["source_hash"] == SCALE_ADD.source_hash


def test_kernel_node_on_the_metal_path_folds_custom_kernel(monkeypatch):
    monkeypatch.setenv("GRAPHKERN_BACKEND", "metal")  # metal kernels trace (not run) on Linux
    g = gk.trace(lambda x, y: scale_add(x, y).outputs[0] * 2, X, Y)
    assert g.kernels() == ["scale_add"]
    node = g.node("scale_add")
    assert node["backend"] == "metal"
    assert node["generated_name"].startswith("custom_kernel_scale_add_")
    assert "thread_position_in_grid" in node["source"]
    assert "CustomKernel" not in {g.nx.nodes[n]["op"] for n in g.nx}


def test_trace_time_failure_propagates_to_descendants_and_outputs():
    def fn(x, y):
        good = scale_add(x, y).outputs[0]
        bad = scale_add(good, y, threadgroup=(0, 1, 1)).outputs[0]
        return mx.exp(bad), good + 1

    g = gk.trace(fn, X, Y)
    assert g.status == gk.Status.INVALID_LAUNCH
    [failure] = g.failures()
    assert failure.node == "scale_add_1" and failure.affected_outputs == ("output_0",)
    assert "threadgroup entries must be positive" in failure.message
    assert g.node("exp")["status"] == gk.Status.UPSTREAM_FAILED
    assert g.node("exp")["root_cause"] == "scale_add_1"
    assert g.node("output_1")["status"] == gk.Status.OK
    assert g.affected_outputs() == ["output_0"]
    assert "UPSTREAM_FAILED <- scale_add_1" in g.summary()


def test_first_root_cause_in_topological_order_wins():
    def fn(x, y):
        a = scale_add(x, y, threadgroup=(0, 1, 1)).outputs[0]
        b = gk.apply_in_graph(SCALE_ADD, [a, y], [(X.shape, mx.int32)], grid=(8, 1, 1),
                              threadgroup=(8, 1, 1), template=[("T", 1.5)]).outputs[0]
        return b

    g = gk.trace(fn, X, Y)
    assert [f.node for f in g.failures()] == ["scale_add", "scale_add_1"]
    assert g.status == gk.Status.INVALID_LAUNCH
    assert g.node("output_0")["root_cause"] == "scale_add"


def test_failed_kernel_with_unused_outputs_is_still_shown():
    def fn(x, y):
        scale_add(x, y, threadgroup=(0, 1, 1))
        return x + y

    g = gk.trace(fn, X, Y)
    assert g.kernels() == ["scale_add"] and g.status == gk.Status.INVALID_LAUNCH
    assert g.failures()[0].affected_outputs == ()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(8)
        self.proj = nn.Linear(8, 8)

    def __call__(self, x):
        h = self.proj(self.norm(x))
        return scale_add(h.reshape(-1), x.reshape(-1)).outputs[0].reshape(x.shape)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [Block(), Block()]
        self.head = nn.Linear(8, 2)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_module_scopes_on_ops_kernels_and_parameters():
    net = Net()
    x = mx.ones((2, 8))
    g = gk.trace(net, x)
    scopes = {g.nx.nodes[n]["scope"] for n in g.nodes("op")}
    assert {"layers.0.norm", "layers.0.proj", "layers.1.norm", "layers.1.proj", "head"} <= scopes
    assert [g.node(k)["scope"] for k in g.kernels()] == ["layers.0", "layers.1"]
    assert g.node("layers.0.proj.weight")["kind"] == "input"
    assert g.node("layers.0.proj.weight")["scope"] == "layers.0.proj"
    matmul_scopes = [g.nx.nodes[n]["scope"] for n in g.nodes("op") if g.nx.nodes[n]["op"] == "AddMM"]
    assert matmul_scopes == ["layers.0.proj", "layers.1.proj", "head"]
    # the module hooks are gone afterwards and the model still works
    assert "__wrapped__" not in vars(type(net.layers[0])).get("__call__", lambda: 0).__dict__
    assert net(x).shape == (2, 2)


def test_collapse_groups_by_scope_depth_with_worst_status():
    net = Net()
    g = gk.trace(net, mx.ones((2, 8)))
    top = g.collapse(1)
    assert {"layers", "head"} <= set(top.nodes)
    two = g.collapse(2)
    assert {"layers.0", "layers.1", "head"} <= set(two.nodes)
    assert all("shape" in d for _, _, d in two.edges(data=True))
    assert nx.is_directed_acyclic_graph(two)


def test_exception_inside_a_module_is_a_failed_node():
    class Broken(nn.Module):
        def __call__(self, x):
            raise ValueError("boom")

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.ok = nn.Linear(4, 4)
            self.broken = Broken()

        def __call__(self, x):
            return mx.exp(self.broken(self.ok(x)))

    g = gk.trace(Outer(), mx.ones((1, 4)))
    [failure] = g.failures()
    assert failure.status == gk.Status.MODULE_ERROR and "boom" in failure.message
    assert g.node(failure.node)["scope"] == "broken"
    assert failure.affected_outputs == ("output_0",)
    assert gk.trace(nn.Linear(4, 4), mx.ones((1, 4))).ok  # the next trace works


def test_trees_scalars_and_keyword_arguments():
    def fn(pair, scale, *, bias):
        a, b = pair
        return {"sum": a * scale + b + bias}

    g = gk.trace(fn, (X, Y), 3.0, bias=mx.zeros(8))
    assert {g.node(n)["label"] for n in g.nodes("input")} == {"pair[0]", "pair[1]", "bias"}


def test_bad_trace_arguments_raise_clear_errors():
    with pytest.raises(gk.KernelError, match="returned no arrays"):
        gk.trace(lambda x: None, X)
    with pytest.raises(gk.KernelError, match="raised ZeroDivisionError"):
        gk.trace(lambda x: 1 / 0, X)
    assert gk.trace(lambda x: x + 1, X).ok


def test_summary_lists_every_node():
    g = gk.trace(lambda x, y: scale_add(x, y).outputs[0], X, Y)
    text = g.summary()
    assert "graph <lambda>: 0 ops, 1 kernels" in text
    for name in g.nx:
        assert name in text


def test_a_module_shared_by_several_parents_is_scoped_under_the_one_calling_it() -> None:
    pytest.importorskip("mlx_lm")
    from graphkern.models.tiny import tiny_model

    # mlx-lm's SwitchGLU takes ``activation=SwiGLU()`` as a default argument: one module object
    # in every MoE layer, registered under layer 0's path
    model = tiny_model("mixtral")
    assert model.model.layers[0].block_sparse_moe.switch_mlp.activation is \
        model.model.layers[1].block_sparse_moe.switch_mlp.activation
    g = gk.trace(model, mx.array([[1, 2, 3, 4]]))
    scopes = {g.node(n)["scope"] for n in g.nodes("op") if g.node(n)["scope"].endswith("activation")}
    assert scopes == {f"model.layers.{i}.block_sparse_moe.switch_mlp.activation" for i in range(2)}


def test_a_failed_module_node_reads_the_outputs_of_the_modules_before_it() -> None:
    class Boom(nn.Module):
        def __call__(self, x: mx.array, y: mx.array) -> mx.array:
            raise ValueError("boom")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 4)
            self.second = nn.Linear(4, 4)
            self.boom = Boom()

        def __call__(self, x: mx.array) -> mx.array:
            return self.boom(self.first(x), self.second(x))

    g = gk.trace(Net(), mx.ones((2, 4)))
    (failed,) = [f.node for f in g.failures()]
    readers = {g.node(p)["scope"] for p in g.nx.predecessors(failed)}
    assert readers == {"first", "second"}  # connected to what it was given, not a loose source
    # and in a patched llama whose layer 5 fused norm fails, fed by layer 4's fused norm and MLP
    import viz_graphs

    g = viz_graphs.llama(8, broken=5)
    (failed,) = [f.node for f in g.failures()]
    assert {g.node(p)["scope"] for p in g.nx.predecessors(failed)} == {
        "model.layers.4.post_attention_layernorm", "model.layers.4.mlp.down_proj"}
