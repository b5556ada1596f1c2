"""gk.inspect: values on every node of real models, the node where a NaN starts, files of tensors."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import networkx as nx
import numpy as np
import planted_bugs as pb
import pytest

import graphkern as gk
from graphkern.debugging import statistics
from graphkern.debugging.statistics import array_stats
from graphkern.debugging.values import GraphRun, trace_for_values
from graphkern.models.tiny import tiny_model
from graphkern.tracing import replay
from graphkern.tracing.state import Flat
from graphkern.tracing.traceable import Traceable

S = gk.Status


def _eager_stats(x: mx.array) -> dict[str, float]:
    a = np.asarray(x.astype(mx.float32))
    finite = a[np.isfinite(a)]
    return {"min": float(finite.min()), "max": float(finite.max()), "mean": float(finite.mean()),
            "nan": int(np.isnan(a).sum()), "inf": int(np.isinf(a).sum())}


def _close(stats: dict, expected: dict) -> bool:
    return all(math.isclose(stats[k], expected[k], rel_tol=1e-5, abs_tol=1e-6) for k in expected)


def test_planted_nan_kernel_in_layer_3_is_the_root_cause() -> None:
    g = gk.inspect(pb.nan_llama(), pb.TOKENS)
    g.lint()
    assert g.status == S.NON_FINITE
    root = g.failures()[0]
    data = g.node(root.node)
    assert data["kind"] == "kernel" and data["kernel"] == "nan_sqrt"
    assert data["scope"] == pb.NAN_SCOPE
    assert "nan_sqrt" in root.message and pb.NAN_SCOPE in root.message
    assert "while all its inputs are finite" in root.message
    assert data["stats"]["nan"] == 2 * 8 * 64 and data["stats"]["min"] is None
    (source,) = g.inputs_of(root.node)  # sigmoid of the norm: small positive values
    stats = g.node(source)["stats"]
    assert 0 < stats["min"] <= stats["max"] < 1 and stats["nan"] == stats["inf"] == 0
    # one root; every node it reaches is UPSTREAM_FAILED from it; nothing before it failed
    assert [f.node for f in g.failures()] == [root.node]
    below = nx.descendants(g.nx, root.node)
    assert below and all(g.node(n)["status"] == S.UPSTREAM_FAILED and g.node(n)["root_cause"] == root.node
                         for n in below)
    assert all(g.node(n)["status"] == S.OK for n in g.nodes() if n not in below and n != root.node)
    assert g.node("output_0")["stats"]["nan"] == pb.TOKENS.size * 128
    assert gk.Graph.from_json(g.to_json()) == g


def test_every_node_of_real_models_gets_values_matching_the_eager_run() -> None:
    for arch in ("llama", "qwen3", "gemma", "phi3", "mixtral"):
        for patched in (False, True):
            model = tiny_model(arch)
            if patched:
                gk.patch(model)
            g = gk.inspect(model, pb.TOKENS)
            g.lint()
            assert g.ok, (arch, patched, g.failures())
            assert g.nx.graph["values"] == {"nodes": g.nx.number_of_nodes(), "unreached": 0,
                                            "from_eager_run": 0}, (arch, patched)
            assert _close(g.node("output_0")["stats"], _eager_stats(model(pb.TOKENS))), (arch, patched)
            if patched:
                assert g.kernels() and all("stats" in g.node(k) for k in g.kernels())


def test_op_values_are_the_values_mlx_computes() -> None:
    x = mx.array([[0.5, -1.0, 2.0], [3.0, 0.0, -0.25]])

    def fn(x: mx.array) -> mx.array:
        return mx.softmax(mx.exp(x) * x, axis=-1).T @ x

    g = gk.inspect(fn, x)
    by_op = {g.node(n)["op"]: g.node(n)["stats"] for n in g.nodes("op")}
    assert _close(by_op["Exp"], _eager_stats(mx.exp(x)))
    assert _close(by_op["Softmax"], _eager_stats(mx.softmax(mx.exp(x) * x, axis=-1)))
    assert _close(g.node("output_0")["stats"], _eager_stats(fn(x)))
    assert by_op["Exp"]["absmax"] == pytest.approx(math.exp(3.0))


@pytest.mark.parametrize("host", [True, False], ids=["numpy on the host", "MLX on the device"])
def test_stats_summarise_the_finite_elements_and_count_nan_and_inf(host: bool) -> None:
    def stats(x: mx.array) -> dict:
        batch = statistics.StatsBatch(host=host)
        batch.add(x, lambda s: None)
        return batch.flush()[0]

    none = {"min": None, "max": None, "mean": None, "absmax": None}
    x = mx.array([1.0, -4.0, float("nan"), float("inf"), float("-inf"), 2.0, float("nan")])
    assert stats(x) == {"min": -4.0, "max": 2.0, "mean": pytest.approx(-1 / 3), "absmax": 4.0,
                        "nan": 2, "inf": 2}
    assert stats(x.astype(mx.bfloat16)) == {**stats(x), "mean": pytest.approx(-1 / 3)}
    assert stats(mx.array([float("nan")] * 3)) == {**none, "nan": 3, "inf": 0}
    assert stats(mx.zeros((0, 4))) == {**none, "nan": 0, "inf": 0}
    assert stats(mx.array([3, 1, 2], dtype=mx.int32))["mean"] == 2.0
    assert stats(mx.array([True, False, True, True]))["mean"] == 0.75
    # sums that overflow the dtype: float16 in float32 (or float64), a -3.4e38 mask by scaling
    big = mx.full((4096,), 60000.0, dtype=mx.float16)
    assert stats(big)["mean"] == pytest.approx(60000.0, rel=1e-3)
    mask = mx.full((64,), -3.4e38)
    assert stats(mask)["mean"] == pytest.approx(-3.4e38, rel=1e-5) and stats(mask)["inf"] == 0
    assert array_stats(x) == {**stats(x), "mean": pytest.approx(-1 / 3)}


def test_log_of_zero_is_an_inf_root_and_a_nan_input_is_its_own_root() -> None:
    g = gk.inspect(lambda x: mx.log(x) + 1, mx.array([1.0, 0.0, 2.0]))
    root = g.failures()[0]
    assert g.node(root.node)["op"] == "Log" and g.node(root.node)["stats"]["inf"] == 1
    g = gk.inspect(lambda x, y: x * y, mx.array([1.0, float("nan")]), mx.ones((2,)))
    root = g.failures()[0]
    assert root.node == "x" and g.node("x")["kind"] == "input" and "an input of the call" in root.message
    assert g.node("y")["status"] == S.OK


def test_module_outputs_are_named_on_the_nodes_that_made_them() -> None:
    model = pb.llama()
    g = gk.inspect(model, pb.TOKENS)
    made = {path: n for n in g.nodes() for path in g.node(n).get("module_outputs", [])}
    for i in range(pb.LAYERS):
        assert f"model.layers.{i}" in made and f"model.layers.{i}.mlp" in made
    layer_out = g.node(made["model.layers.7"])
    assert layer_out["op"] == "Add" and layer_out["stats"]["nan"] == 0


def test_a_kernel_with_several_outputs_has_stats_per_output() -> None:
    model = tiny_model("llama")
    gk.patch(model)
    g = gk.inspect(model, pb.TOKENS)
    fused = [k for k in g.kernels() if g.node(k)["kernel"].endswith("add_rms_norm")]
    assert fused
    for k in fused:
        parts = g.node(k)["output_stats"]
        assert len(parts) == 2 and g.node(k)["stats"]["max"] == max(p["max"] for p in parts)


def test_values_are_dropped_once_their_last_reader_ran() -> None:
    model = pb.llama()
    graph, wiring, arrays = trace_for_values(Traceable(model),
                                             *_flat(model))
    run = GraphRun(graph, wiring, arrays)
    computed = {n for n in graph.nodes() if graph.node(n)["kind"] in ("op", "kernel")}
    live = []
    for _ in run.steps():
        live.append(sum(1 for node, _ in run.env if node in computed))
        if run.need_flush:
            run.flush()
    run.flush()
    assert len(computed) > 900 and len(live) == graph.nx.number_of_nodes()
    # (the parameters are the model's own arrays); of the computed values, a transformer keeps
    # the residual stream, a mask and the RoPE tables, not its 999 intermediates
    assert max(live) < 20, max(live)
    assert not run.env


def _flat(model: nn.Module) -> tuple:
    return (Flat.of((pb.TOKENS,), {}, Traceable(model).arg_names),)


def test_an_op_that_cannot_run_again_says_so_and_what_follows_is_reached(monkeypatch) -> None:
    monkeypatch.setattr(replay, "REPLAYED", replay.REPLAYED - {"Softmax"})
    monkeypatch.delitem(replay._TABLE, "Softmax")
    model = pb.llama()
    g = gk.inspect(model, pb.TOKENS)
    softmax = [n for n in g.nodes("op") if g.node(n)["op"] == "Softmax"]
    assert len(softmax) == pb.LAYERS
    for n in softmax:
        assert "stats" not in g.node(n)
        assert "cannot run the MLX primitive 'Softmax'" in g.node(n)["values_note"]
    # the attention's output comes from one eager run of the model; everything after it runs
    assert g.nx.graph["values"]["from_eager_run"] == pb.LAYERS
    assert _close(g.node("output_0")["stats"], _eager_stats(model(pb.TOKENS)))
    unreached = [n for n in g.nodes() if "values_note" in g.node(n)]
    assert all(g.node(n)["scope"].endswith(("self_attn", "o_proj")) for n in unreached)
    # and a NaN downstream is still found where it starts
    g = gk.inspect(pb.nan_llama(), pb.TOKENS)
    assert g.node(g.failures()[0].node)["kernel"] == "nan_sqrt"


def test_a_kernel_given_python_scalars_gets_its_values_from_the_eager_run() -> None:
    shift = gk.Kernel("shift", ["x", "by"], ["out"], reference=lambda x, by: [x + by])

    def fn(x: mx.array) -> mx.array:
        out = gk.launch(shift, [x, 2.5], [gk.OutputSpec(x.shape, x.dtype)], grid=(x.size, 1, 1),
                        threadgroup=(4, 1, 1))[0]
        return out * 2

    class Shifted(nn.Module):
        def __call__(self, x: mx.array) -> mx.array:
            return fn(x)

    g = gk.inspect(Shifted(), mx.arange(4, dtype=mx.float32))
    (k,) = g.kernels()
    assert g.node(k)["stats"] == {"min": 2.5, "max": 5.5, "mean": 4.0, "absmax": 5.5, "nan": 0, "inf": 0}
    assert g.node("output_0")["stats"]["max"] == 11.0


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_full_tensors_are_streamed_to_a_file_on_request(tmp_path, suffix) -> None:
    model = pb.llama(mx.bfloat16)
    path = tmp_path / f"values{suffix}"
    g = gk.Inspector(save=path)(model, pb.TOKENS)
    saved = dict(np.load(path)) if suffix == ".npz" else mx.load(str(path))
    kept = {n for n in g.nodes() if g.node(n)["kind"] in ("op", "kernel")}
    assert set(saved) == kept
    last = g.inputs_of("output_0")[0]
    logits = saved[last]
    if suffix == ".safetensors":
        assert logits.dtype == mx.bfloat16
        logits = np.asarray(logits.astype(mx.float32))
    assert np.array_equal(logits, np.asarray(model(pb.TOKENS).astype(mx.float32)))
    assert not list(tmp_path.glob(".graphkern-*"))  # no partial file left


def test_saving_refuses_a_bad_path(tmp_path) -> None:
    with pytest.raises(gk.KernelError, match=r"\.npz or \.safetensors"):
        gk.Inspector(save=tmp_path / "values.pt")(lambda x: x + 1, mx.ones((2,)))
    with pytest.raises(gk.KernelError, match="does not exist"):
        gk.Inspector(save=tmp_path / "missing" / "v.npz")(lambda x: x + 1, mx.ones((2,)))


def test_kernels_checked_in_place_against_their_references() -> None:
    model = tiny_model("qwen3")
    gk.patch(model)
    g = gk.Inspector(check_kernels=True)(model, pb.TOKENS)
    g.lint()
    checks = [g.node(k)["reference_check"] for k in g.kernels()]
    assert len(checks) == len(g.kernels()) > 5
    assert all(c["mismatched"] == 0 and c["max_abs"] == 0.0 for c in checks)  # CPU: the reference


def test_inspect_keyword_arguments_go_to_the_function() -> None:
    g = gk.inspect(lambda x, scale: x * scale, mx.ones((2,)), scale=mx.array(3.0))
    assert g.node("output_0")["stats"]["max"] == 3.0


def test_progress_on_request_names_the_phase_and_dtype(capsys) -> None:
    gk.Inspector(progress=True)(lambda x: mx.exp(x), mx.ones((3,), mx.bfloat16))
    err = capsys.readouterr().err  # not a terminal: a line a phase
    assert "inspect: tracing" in err and "inspect: values (bfloat16) (3 steps)" in err
    gk.Inspector(progress=False)(lambda x: mx.exp(x), mx.ones((3,)))  # and none when refused
    gk.inspect(lambda x: mx.exp(x), mx.ones((3,)))  # nor by default, off a terminal
    assert capsys.readouterr().err == ""


def test_stats_in_json_are_checked_by_lint() -> None:
    g = gk.inspect(lambda x: x * 2, mx.ones((2,)))
    g.nx.nodes["multiply"]["stats"]["nan"] = -1
    g.nx.nodes["x"]["stats"] = {"min": float("nan"), "max": 1.0, "mean": 1.0, "absmax": 1.0, "nan": 0,
                                "inf": 0}
    with pytest.raises(gk.KernelError) as info:
        g.lint()
    assert "stats['nan'] is -1" in str(info.value) and "finite numbers or all None" in str(info.value)


def test_an_op_that_fails_to_run_again_is_passed_through_an_eager_module_output() -> None:
    class Noisy(nn.Module):  # an odd count of random bits: paired differently, not drawn again
        def __call__(self, x: mx.array) -> mx.array:
            return x + mx.random.uniform(shape=x.shape, key=mx.random.key(7))

    model = nn.Sequential(nn.Linear(3, 3), Noisy(), nn.ReLU())
    x = mx.ones((1, 3))
    g = gk.inspect(model, x)
    (bits,) = [n for n in g.nodes("op") if g.node(n)["op"] == "RandomBits"]
    assert "RandomBits of 3 4-byte values" in g.node(bits)["values_note"]
    assert g.nx.graph["values"]["from_eager_run"] == 1
    noisy_out = next(n for n in g.nodes() if "layers.1" in g.node(n).get("module_outputs", []))
    assert _close(g.node(noisy_out)["stats"], _eager_stats(model.layers[1](model.layers[0](x))))
    assert _close(g.node("output_0")["stats"], _eager_stats(model(x)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.int32])
def test_host_statistics_a_piece_at_a_time_equal_the_whole(monkeypatch, dtype) -> None:
    x = mx.array([3.0, -1.0, 2.0, 8.0, 0.5, -6.0, 1.0, 4.0, 7.0, 2.5], dtype=dtype)
    whole = statistics.host_stats(x)
    monkeypatch.setattr(statistics, "_HOST_PIECE", 3)  # four pieces, the last short
    assert statistics.host_stats(x) == pytest.approx(whole)
    assert whole["min"] == -6.0 and whole["max"] == 8.0 and whole["absmax"] == 8.0
    if dtype != mx.int32:  # a NaN in one piece, an Inf in another, a piece of NaNs alone
        nan, inf = float("nan"), float("inf")
        bad = mx.array([1.0, nan, 2.0, inf, 5.0, 0.0, nan, nan, nan, nan], dtype=dtype)
        stats = statistics.host_stats(bad)
        assert stats == {"min": 0.0, "max": 5.0, "mean": 2.0, "absmax": 5.0, "nan": 5, "inf": 1}
