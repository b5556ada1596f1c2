"""Messages and pictures say what happened in the user's terms: a patched layer keeps its class,
a kernel's inputs are labelled by name, tracing a wrapped model or a numpy array says what to do
(and the process exits cleanly after), a failure on a placeholder is not a second root cause,
and long diffs and tables are summarised."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
import viz_graphs as vg
from click.testing import CliRunner

import graphkern as gk
from graphkern.cli import main
from graphkern.viz.dot import to_dot
from graphkern.viz.html import viewer_data

ROOT = Path(__file__).resolve().parent.parent
TOKENS = mx.array([[1, 2, 3, 4]])


# ----------------------------------------------------------------------------- the user's classes


def test_a_patched_llama_keeps_its_class_names_in_graphs_messages_and_repr() -> None:
    pytest.importorskip("mlx_lm")
    from graphkern.models.tiny import tiny_model

    model = tiny_model("llama")
    patched = gk.patch(model)
    assert patched[0].path == "model" and patched[0].original == "LlamaModel"
    assert "sliding" not in patched[0].rule
    assert patched[0].rule == "decoder stack (Llama): each residual add fused into the next RMSNorm"
    graph = gk.trace(model, TOKENS)
    modules = graph.nx.graph["modules"]
    assert modules["model"] == "LlamaModel" and modules["model.layers.1"] == "TransformerBlock"
    assert modules["model.layers.1.self_attn"] == "Attention" and modules["model.norm"] == "RMSNorm"
    assert not [cls for cls in modules.values() if cls.startswith("Kernel")]
    text = repr(model)
    assert "(model): LlamaModel(kernel=add_rms_norm" in text
    assert "(input_layernorm): RMSNorm(64, eps=1e-05, kernel=add_rms_norm)" in text
    assert "Kernel" not in text
    # a failing patched layer is named by its class in the failure
    norm = model.model.layers[1].post_attention_layernorm
    norm.weight = norm.weight[:-1]  # one feature short: refused
    failure = gk.trace(model, TOKENS).failures()[0]
    assert failure.message.startswith("call module 'model.layers.1.post_attention_layernorm' (RMSNorm): ")


# ----------------------------------------------------------------------------- inputs by name

PAIR = gk.Kernel("pair", ["x", "q_weight", "k_weight"], ["out"], reference=lambda x, q, k: [x * q + k])


def _pair(x: mx.array, w: mx.array) -> mx.array:
    return gk.apply_in_graph(PAIR, [x, w, w], [gk.OutputSpec(x.shape, x.dtype)], grid=(x.size, 1, 1),
                             threadgroup=(8, 1, 1)).outputs[0]


def test_one_array_passed_as_two_kernel_inputs_is_labelled_with_both_names() -> None:
    graph = gk.trace(_pair, mx.ones(8), mx.full((8,), 2.0))
    edges = {key: data for _, _, key, data in graph.nx.in_edges("pair", keys=True, data=True)}
    assert sorted((d["index"], d["inputs"]) for d in edges.values()) == [(0, ["x"]),
                                                                        (1, ["q_weight", "k_weight"])]
    graph.lint()  # raises on a field the schema does not know
    assert gk.Graph.from_json(graph.to_json()) == graph
    rows = [e for e in viewer_data(graph)["edges"] if len(e) > 7]
    assert sorted(e[7] for e in rows) == ["q_weight, k_weight", "x"]
    dot = to_dot(graph, weights=True)
    assert 'label=" q_weight, k_weight float32[8]"' in dot and 'label=" x float32[8]"' in dot


ROPE_INPUTS = ["q", "k", "offset", "freqs", "q_weight", "k_weight"]


def test_rope_qk_inputs_keep_their_names_when_they_share_an_array() -> None:
    pytest.importorskip("mlx_lm")
    graph = vg.llama(2)
    rope = next(k for k in graph.kernels() if graph.node(k)["kernel"] == "gk_rope_qk")
    edges = sorted(graph.nx.in_edges(rope, data=True), key=lambda e: e[2]["index"])
    named = [name for _, _, d in edges for name in d.get("inputs", [])]
    assert named == ROPE_INPUTS  # each once, in order
    for _, _, d in edges:  # an edge's index is its first input's position
        if d.get("inputs"):
            assert ROPE_INPUTS.index(d["inputs"][0]) == d["index"]


# ----------------------------------------------------------------------------- what to trace


def test_tracing_a_wrapped_model_says_to_trace_the_model() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    wrapped = gk.wrap(model)
    for run in (gk.trace, gk.inspect):
        with pytest.raises(gk.KernelError, match=r"this is a gk.wrap\(\)ped model.*trace the model "
                                                 r"itself.*wrapped.graph"):
            run(wrapped, mx.ones((2, 4)))
    with pytest.raises(gk.KernelError, match=r"gk.compile\(\)d function.*compiled.graph"):
        gk.trace(gk.compile(lambda x: x * 2), mx.ones(2))
    assert gk.trace(wrapped.model, mx.ones((2, 4))).status == gk.Status.OK


def test_a_factory_function_says_to_trace_the_model_it_builds() -> None:
    def make_model() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4))

    with pytest.raises(gk.KernelError, match=r"make_model returned a Sequential \(an nn.Module\) and "
                                             r"no arrays: it builds a model; trace the model it returns"):
        gk.trace(make_model)


NUMPY_SCRIPT = textwrap.dedent("""
    import numpy as np, mlx.core as mx, mlx.nn as nn, graphkern as gk
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    x = np.ones((2, 4), dtype=np.float32)
    for name, call in [("trace", lambda: gk.trace(model, x)), ("inspect", lambda: gk.inspect(model, x)),
                       ("compare", lambda: gk.compare(model, model, x))]:
        try:
            call()
        except gk.KernelError as exc:
            print(name, exc)
    print(gk.inspect(model, mx.array(x)).status.name)
""")


@pytest.mark.slow
def test_a_numpy_input_is_refused_by_name_and_the_process_exits_cleanly() -> None:
    for _ in range(2):  # the abort at exit came and went from run to run
        proc = subprocess.run([sys.executable, "-c", NUMPY_SCRIPT], capture_output=True, text=True,
                              cwd=ROOT, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "terminate called" not in proc.stderr
        lines = proc.stdout.splitlines()
        message = ("trace a function with graphkern: argument 'x' of Sequential is a numpy.ndarray, "
                   "not an MLX array: pass mx.array(x) instead")
        assert lines == [f"{name} {message}" for name in ("trace", "inspect", "compare")] + ["OK"]


def test_a_model_called_with_an_mlx_lm_cache_is_refused_by_name_with_the_way_that_works() -> None:
    """A KV cache holds its arrays in attributes, which MLX's capture cannot take as inputs: the
    trace says which argument, what it holds, and that ``gk.wrap`` traces such a step; the
    wrapped model then traces that very call, and the same model traces without the cache."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache

    from graphkern.models.tiny import tiny_model

    model = tiny_model("llama")
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=cache)
    for call in (gk.trace, gk.inspect):
        with pytest.raises(gk.KernelError) as info:
            call(model, mx.array([[4]]), cache=cache)
        message = str(info.value)
        assert "argument 'cache[0]' of Model is a KVCache holding MLX arrays (keys, values)" in message
        assert "gk.wrap(model)" in message
    assert cache[0].offset == 3  # refused before the model ran: the cache did not move
    wrapped = gk.wrap(model)
    wrapped(mx.array([[4]]), cache=cache)
    assert {"inputs", "cache[0].keys"} <= set(wrapped.graph.nodes("input"))
    assert gk.trace(model, mx.array([[4]])).status.name == "OK"


# ----------------------------------------------------------------------------- inspect


def test_inspect_keeps_numpy_warnings_to_itself() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graph = gk.inspect(lambda x: mx.log(x) * x, mx.array([0.0, 1.0, float("inf")]))
    assert graph.failures()[0].node == "x"  # the Inf came in with the input


class _Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def __call__(self, x: mx.array) -> mx.array:
        raise ValueError("boom")


def test_a_failure_on_a_failed_nodes_placeholder_is_upstream_failed() -> None:
    model = nn.Sequential(_Raises(), nn.Linear(8, 2), nn.ReLU())  # layers.1 gets a (2, 4) stand-in
    for run in (gk.trace, gk.inspect):
        graph = run(model, mx.ones((2, 4)))
        assert [(f.node, f.status) for f in graph.failures()] == [("_Raises", gk.Status.MODULE_ERROR)]
        follow = graph.node("Linear")
        assert follow["status"] == gk.Status.UPSTREAM_FAILED and follow["root_cause"] == "_Raises"
        assert follow["message"].startswith("failed after its input came from failed node '_Raises' "
                                            "(a placeholder, not a real value): call module 'layers.1'")


# ----------------------------------------------------------------------------- the command line


def run_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


FACTORY = textwrap.dedent("""
    import mlx.nn as nn
    def make_model():
        return nn.Sequential(nn.Linear(4, 4))
    def forward(x, y):
        return x + y
""")


def test_cli_a_factory_or_a_missing_input_says_what_to_fix(tmp_path: Path) -> None:
    source = tmp_path / "factory.py"
    source.write_text(FACTORY)
    code, _, err = run_cli("trace", f"{source}:make_model", "-i", "2,4")
    assert code == 2 and (f"{source}:make_model takes no arguments but 1 -i/--input was given. If it "
                          "builds and returns the model, name the model instead") in err
    code, _, err = run_cli("debug", f"{source}:forward")
    assert code == 2 and (f"{source}:forward takes 2 arguments (x, y) and 0 -i/--input were given: "
                          "give one -i SHAPE:DTYPE for each, e.g. -i 1,16:int32 -i 1,16:int32") in err
    code, _, err = run_cli("trace", f"{source}:make_model")
    assert code == 1 and "it builds a model; trace the model it returns instead" in err


@pytest.mark.slow
def test_cli_diff_and_show_summarise_a_big_graph(tmp_path: Path) -> None:
    pytest.importorskip("mlx_lm")
    stock, patched = tmp_path / "stock.json", tmp_path / "patched.json"
    stock.write_text(vg.llama(12, patched=False).to_json())
    patched.write_text(vg.llama(12).to_json())
    code, out, _ = run_cli("diff", str(stock), str(patched))
    lines = out.splitlines()
    assert code == 1 and len(lines) < 15
    assert "  [model.layers.0 … model.layers.11] +0 -68 ~13 each (12 modules)" in lines
    assert lines[-1].endswith("lines in full: --full prints every node)")
    code, out, _ = run_cli("diff", str(stock), str(patched), "--full")
    assert len(out.splitlines()) > 1000 and "[model.layers.11.self_attn]" in out
    code, out, _ = run_cli("show", str(patched))
    assert code == 0 and out.splitlines()[-1] == "(784 nodes: --full prints the per-node table)"
    code, out, _ = run_cli("show", str(patched), "--full")
    assert len(out.splitlines()) > 784
    assert json.loads(patched.read_text())["graph"]["modules"]["model.layers.0"] == "TransformerBlock"
