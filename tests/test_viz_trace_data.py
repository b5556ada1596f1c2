"""What the drawings need from a trace, and scopes never lost silently: modules reached through
module globals are found like closures, a trace that runs a module it cannot see warns, failures
name their module path, a failed launch keeps the configuration it was given, kernels carry their
input names, float template arguments and sources on every backend."""

from __future__ import annotations

import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import viz_graphs as vg

import graphkern as gk
from graphkern.tracing.recorder import float_template_names

TOKENS = mx.array([[1, 2, 3, 4]])

MODULE = textwrap.dedent('''
    import graphkern as gk
    from graphkern.models.tiny import tiny_model

    model = tiny_model("llama")
    gk.patch(model)

    def patched(tokens):
        return model(tokens)

    class Runner:
        def __init__(self):
            self.net = model

        def forward(self, tokens):
            return self.net(tokens)

    class Box:
        pass

    box = Box()
    box.m = model

    def hidden(tokens):
        return getattr(box, "m")(tokens)
''')


@pytest.fixture
def mymodels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    (tmp_path / "mymodels.py").write_text(MODULE)
    (tmp_path / "usesmodels.py").write_text("import mymodels\n\ndef run(t):\n    return mymodels.model(t)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("mymodels", "usesmodels"):
        sys.modules.pop(name, None)
    import mymodels

    yield mymodels
    for name in ("mymodels", "usesmodels"):
        sys.modules.pop(name, None)


def _scoped(graph: gk.Graph) -> float:
    ops = [d for _, d in graph.nx.nodes(data=True) if d["kind"] in ("op", "kernel")]
    return sum(1 for d in ops if d["scope"]) / len(ops)


def _no_scope_warning(fn: Any, *args: Any) -> gk.Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("error", gk.ScopeWarning)
        return gk.trace(fn, *args)


def test_a_model_in_a_module_global_is_found(mymodels: Any) -> None:
    direct = gk.trace(mymodels.model, TOKENS)
    graph = _no_scope_warning(mymodels.patched, TOKENS)
    assert _scoped(graph) == _scoped(direct) > 0.9
    # parameters are named inputs under the global's name, not anonymous constants
    weight = "model.model.layers.0.input_layernorm.weight"
    assert graph.node(weight)["kind"] == "input" and graph.node(weight)["state"] is True
    assert graph.node("tokens")["kind"] == "input" and "state" not in graph.node("tokens")
    assert not [n for n, d in graph.nx.nodes(data=True)
                if d["kind"] == "constant" and d.get("value", "").startswith("<float32[")]
    kernels = {graph.node(k)["scope"] for k in graph.kernels()}
    assert "model.model.layers.1.input_layernorm" in kernels


def test_a_model_through_a_module_or_a_plain_object_is_found(mymodels: Any) -> None:
    import usesmodels

    assert _scoped(_no_scope_warning(usesmodels.run, TOKENS)) > 0.9
    graph = _no_scope_warning(mymodels.Runner().forward, TOKENS)
    assert _scoped(graph) > 0.9 and graph.node("net.model.norm.weight")["kind"] == "input"


def test_a_module_the_trace_cannot_see_is_reported(mymodels: Any) -> None:
    with pytest.warns(gk.ScopeWarning, match="hidden ran the nn.Module Model but graphkern found no module"):
        graph = gk.trace(mymodels.hidden, TOKENS)
    assert _scoped(graph) == 0   # what the warning is about
    with warnings.catch_warnings():   # no module in sight, none run: nothing to say
        warnings.simplefilter("error", gk.ScopeWarning)
        gk.trace(lambda x: mx.exp(x) * 2, mx.ones((3,)))


@pytest.mark.parametrize("refused", ["install", "removal"])
def test_a_refused_profile_hook_only_loses_the_report(mymodels: Any, refused: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """CPython refuses sys.setprofile while it still installs one on the thread (seen with threads
    tracing at once): the trace goes on, at worst without naming the module it could not see."""
    import sys

    real = sys.setprofile
    calls: list[Any] = []

    def setprofile(function: Any) -> None:
        calls.append(function)
        if (refused == "install" and len(calls) == 1) or (refused == "removal" and len(calls) == 2):
            raise RuntimeError("Cannot install a profile function while another profile function "
                               "is being installed")
        real(function)

    monkeypatch.setattr(sys, "setprofile", setprofile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = gk.trace(mymodels.hidden, TOKENS)
    assert graph.nx.number_of_nodes() > 0 and sys.getprofile() is None
    named = [w for w in caught if issubclass(w.category, gk.ScopeWarning)]
    assert len(named) == (1 if refused == "removal" else 0)


def test_a_compiled_function_on_a_global_model_sees_new_weights(mymodels: Any) -> None:
    compiled = gk.compile(mymodels.patched)
    assert mx.allclose(compiled(TOKENS), mymodels.model(TOKENS)).item()
    head = mymodels.model.lm_head
    head.weight = head.weight * 2
    assert mx.allclose(compiled(TOKENS), mymodels.model(TOKENS)).item()


def test_failures_name_their_module_path() -> None:
    model = vg.llama_model(3)
    norm = model.model.layers[1].input_layernorm
    norm.weight = norm.weight[:-1]  # one feature short: refused
    with pytest.raises(gk.GraphError) as info:
        gk.wrap(model)(TOKENS)
    message = str(info.value)
    assert "'RMSNorm' in model.layers.1.input_layernorm failed with MODULE_ERROR" in message
    failure = gk.trace(model, TOKENS).failures()[0]
    assert failure.scope == "model.layers.1.input_layernorm"
    assert str(failure).startswith("'RMSNorm' in model.layers.1.input_layernorm: MODULE_ERROR")
    bare = gk.trace(lambda x: gk.apply_in_graph(vg_kernel(), [x, x], [gk.OutputSpec((8,), mx.float32)],
                                                grid=(8, 1, 1), threadgroup=(0, 1, 1)).outputs[0],
                    mx.ones((8,)))
    assert "(outside any module)" in str(bare.failures()[0])


def vg_kernel() -> gk.Kernel:
    return gk.Kernel("scale_add", ["x", "y"], ["out"], metal=vg.SCALE_ADD_METAL, cuda=vg.SCALE_ADD_CUDA,
                     reference=lambda x, y: [x * 2 + y])


def test_a_refused_launch_keeps_the_configuration_it_was_given() -> None:
    g = vg.traced(failed=True)
    bad, good = g.node("scale_add_1"), g.node("scale_add")
    assert bad["status"] == gk.Status.INVALID_LAUNCH
    assert bad["grid"] == [32, 1, 1] and bad["threadgroup"] == [0, 1, 1]
    assert bad["template"] == [["T", "float32"]] and bad["backend"] == "reference"
    assert good["threadgroup"] == [256, 1, 1]
    # garbage is kept as text, never raised on
    odd = gk.trace(lambda x: gk.apply_in_graph(vg_kernel(), [x, x], [gk.OutputSpec((8,), mx.float32)],
                                               grid="wide", threadgroup=(1.5, 1, 1),
                                               template=[("T", object)]).outputs[0], mx.ones((8,)))
    node = odd.node(odd.kernels()[0])
    assert node["grid"] == ["'wide'"] and node["threadgroup"] == ["1.5", 1, 1]
    assert node["template"][0][0] == "T" and node["status"] != 0
    odd.lint()


def test_kernels_carry_names_floats_and_sources() -> None:
    g = vg.llama(2)
    kernels = {g.node(k)["kernel"]: g.node(k) for k in g.kernels()}
    norm, rope = kernels["gk_rms_norm"], kernels["gk_rope_qk"]
    assert norm["input_names"] == ["x", "w"]
    assert rope["input_names"] == ["q", "k", "offset", "freqs", "q_weight", "k_weight"]
    assert norm["template_floats"] == {"EPS": 1e-05}
    assert rope["template_floats"]["BASE"] == 10000.0 and rope["template_floats"]["SCALE"] == 1.0
    assert ["EPS", "925353388"] in norm["template"]   # the exact bits stay in the template
    assert "template_floats" not in kernels["gk_swiglu"]
    sources = g.nx.graph["kernel_sources"][norm["source_hash"]]
    assert sources["reference"].startswith("def rms_norm_reference")
    assert set(sources) == {"metal", "cuda", "reference"} and all(sources.values())
    # a patched layer keeps its own class: the kernel is a detail of it (its kernel node)
    assert g.nx.graph["modules"]["model.layers.0.self_attn"] == "Attention"
    assert g.nx.graph["modules"]["model.layers.0.input_layernorm"] == "RMSNorm"
    assert g.nx.graph["modules"]["model"] == "LlamaModel"
    assert gk.Graph.from_json(g.to_json()) == g
    metal = "y[0] = x[0] * as_type<float>(S);"
    assert float_template_names(gk.Kernel("k", ["x"], ["y"], metal=metal)) == {"S"}
