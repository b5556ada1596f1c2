"""Graph files: every field is checked when a file loads, and whatever loads can be drawn.

A hand-edited optional field (``graph.modules`` a list, a kernel's ``template`` of triples,
``template_floats`` holding text, ``stats`` of strings...) is refused by ``Graph.from_json`` with a
``GraphFormatError`` naming the field, and by the commands that read graph files (``show``,
``diff``, ``view``) with one ``error:`` line and exit status 2, instead of loading and then
crashing the drawings. Every kind of file graphkern writes loads and draws in every format.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import viz_graphs as vg
from click.testing import CliRunner

import graphkern as gk
from graphkern.cli import main
from graphkern.distributed import merge
from graphkern.viz.graph_diff import diff
from graphkern.viz.model_explorer import to_model_explorer_node_data

LOAD_OP = "load a graphkern graph from JSON"
AXPY = gk.Kernel("files_axpy", ["x", "y"], ["out"],
                 metal="uint i = thread_position_in_grid.x; out[i] = x[i] * T(2) + y[i];",
                 reference=lambda x, y: [x * 2 + y])


def _axpy(x: mx.array, y: mx.array) -> mx.array:
    return gk.apply_in_graph(AXPY, [x, y], [gk.OutputSpec(x.shape, x.dtype)], grid=(x.size, 1, 1),
                             threadgroup=(x.size, 1, 1), template=[("T", x.dtype)]).outputs[0]


def _base() -> dict[str, Any]:
    """A real trace with modules, kernel sources, kernels and their templates, one node holding
    values and one holding a comparison: every optional field the mutations below break."""
    doc = json.loads(vg.traced().to_json())
    kernel = _node(doc, "kernel")
    kernel["template_floats"] = {"EPS": 1e-05}
    _node(doc, "op").update(stats={"min": 0.0, "max": 1.0, "mean": 0.5, "absmax": 1.0, "nan": 0, "inf": 0},
                            comparison={"against": "x", "max_abs": 0.0, "max_rel": 0.0, "ok": True})
    kernel["reference_check"] = {"max_abs": 0.0, "max_rel": 0.0, "mismatched": 0, "rtol": 1e-5, "atol": 1e-5}
    return doc


def _node(doc: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(n for n in doc["nodes"] if n["kind"] == kind)


def _kernel_edge(doc: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in doc["edges"] if e["target"] == _node(doc, "kernel")["id"])


BASE = _base()
#: where a mutation goes: the graph's own attributes, the first kernel or op node, an edge into a kernel
PLACES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "graph": lambda doc: doc["graph"],
    "kernel": lambda doc: _node(doc, "kernel"),
    "op": lambda doc: _node(doc, "op"),
    "edge": _kernel_edge,
}
#: (place, field, value written there, what the error must say)
MUTATIONS: list[tuple[str, str, Any, str]] = [
    ("graph", "modules", ["layers.0"], "graph: modules must be an object, got list"),
    ("graph", "modules", {"layers.0": 3}, "modules['layers.0'] must be a string, got int"),
    ("graph", "kernel_sources", ["metal"], "kernel_sources must be an object, got list"),
    ("graph", "kernel_sources", {"abc": {"metal": 1}}, "kernel_sources['abc']['metal'] must be a string"),
    ("graph", "kernel_sources", {"abc": "source"}, "kernel_sources['abc'] must be an object, got str"),
    ("graph", "name", 7, "name must be a string, got int"),
    ("graph", "backend", None, "backend must be a string, got None"),
    ("graph", "mlx_version", 0.32, "mlx_version must be a string, got float"),
    ("graph", "rank", -1, "rank must be a non-negative int, got -1"),
    ("graph", "group_size", 0, "group_size must be a positive int, got 0"),
    ("graph", "ranks", ["0"], "ranks[0] must be a non-negative int, got str"),
    ("graph", "unmatched_collectives", [1], "unmatched_collectives[0] must be a string, got int"),
    ("graph", "values", {"nodes": "3"}, "values['nodes'] must be a non-negative int, got str"),
    ("kernel", "template", [[1, 2, 3]],
     "template[0] must be a [name, value] pair of strings, got a list of 3"),
    ("kernel", "template", [["T", 1]], "template[0][1] must be a string, got int"),
    ("kernel", "template", "T=float32", "template must be a list, got str"),
    ("kernel", "template_floats", {"EPS": "x"}, "template_floats['EPS'] must be a number, got str"),
    ("kernel", "template_floats", [1e-5], "template_floats must be an object, got list"),
    ("kernel", "grid", 8, "grid must be a list or None, got int"),
    ("kernel", "threadgroup", [[1], 1, 1], "threadgroup[0] must be an int or a string, got list"),
    ("kernel", "input_names", "x", "input_names must be a list, got str"),
    ("kernel", "source_hash", 5, "source_hash must be a string, got int"),
    ("kernel", "generated_name", 5, "generated_name must be a string or None, got int"),
    ("kernel", "kernel", None, "kernel must be a string, got None"),
    ("kernel", "source", ["x"], "source must be a string or None, got list"),
    ("kernel", "call_index", -2, "call_index must be a non-negative int, got -2"),
    ("kernel", "reference_check", {"max_abs": "big"}, "reference_check['max_abs'] must be a number, got str"),
    ("kernel", "reference_check", [0.0], "reference_check must be an object, got list"),
    ("op", "stats", {"min": "a", "max": "b", "mean": "c", "absmax": "d", "nan": 0, "inf": 0},
     "stats min/max/mean/absmax must be finite numbers or all None"),
    ("op", "stats", {"min": 0.0, "max": 1.0, "mean": 0.5, "absmax": 1.0, "nan": "0", "inf": 0},
     "stats['nan'] is '0', not a count"),
    ("op", "stats", [0.0, 1.0], "stats must have the keys"),
    ("op", "output_stats", [{"min": 0.0}], "output_stats[0] must have the keys"),
    ("op", "output_stats", {"0": None}, "output_stats must be a list, got dict"),
    ("op", "comparison", {"against": "x", "max_abs": "0.1"},
     "comparison['max_abs'] must be a number or None"),
    ("op", "comparison", {"against": "x", "ok": "yes"}, "comparison['ok'] must be true or false or None"),
    ("op", "module_outputs", "layers.0", "module_outputs must be a list, got str"),
    ("op", "values_note", 3, "values_note must be a string, got int"),
    ("op", "message", None, "message must be a string, got None"),
    ("op", "arguments", {}, "arguments must be a string, got dict"),
    ("op", "root_cause", 3, "root_cause must be a string or None, got int"),
    ("op", "on_rank", "0", "on_rank must be a non-negative int, got str"),
    ("op", "state", "yes", "state must be true or false, got str"),
    ("op", "label", None, "label must be a string, got None"),
    ("op", "order", -1, "order must be a non-negative int, got -1"),
    ("edge", "inputs", "x", "inputs must be a list, got str"),
    ("edge", "inputs", [0], "inputs[0] must be a string, got int"),
    ("edge", "cross_rank", "yes", "cross_rank must be true or false, got str"),
    ("edge", "index", "0", "index must be a non-negative int, got str"),
    ("edge", "dtype", "float33", "unknown dtype 'float33'"),
]
IDS = [f"{place}.{field}={json.dumps(value)[:24]}" for place, field, value, _ in MUTATIONS]


def mutated(place: str, field: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    PLACES[place](doc)[field] = value
    return doc


def run(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_the_unmutated_file_loads_and_draws() -> None:
    graph = gk.Graph.from_json(json.dumps(BASE))
    graph.lint()
    assert graph.to_html() and graph.to_dot(stats=True) and graph.to_model_explorer()


def test_the_error_names_the_node_and_the_field() -> None:
    with pytest.raises(gk.GraphFormatError) as info:
        gk.Graph.from_json(json.dumps(mutated("kernel", "template_floats", {"EPS": "x"})))
    kernel = _node(BASE, "kernel")["id"]
    assert info.value.description == f"node {kernel!r}: template_floats['EPS'] must be a number, got str"


@pytest.mark.parametrize("place, field, value, message", MUTATIONS, ids=IDS)
def test_a_malformed_field_is_refused_at_load(place: str, field: str, value: Any, message: str) -> None:
    with pytest.raises(gk.GraphFormatError) as info:
        gk.Graph.from_json(json.dumps(mutated(place, field, value)))
    err = info.value
    assert err.operation == LOAD_OP and err.status == gk.Status.INVALID_INPUT
    assert message in err.description, err.description


@pytest.mark.parametrize("place, field, value, message", MUTATIONS, ids=IDS)
def test_the_commands_refuse_a_malformed_file(tmp_path: Path, place: str, field: str, value: Any,
                                             message: str) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(BASE))
    bad.write_text(json.dumps(mutated(place, field, value)))
    for args in (["show", str(bad), "--html", str(tmp_path / "g.html"), "--dot", str(tmp_path / "g.dot"),
                  "--model-explorer", str(tmp_path / "g.me.json")],
                 ["show", str(good), str(bad)],
                 ["diff", str(good), str(bad), "--html", str(tmp_path / "d.html")],
                 ["diff", str(bad), str(good)],
                 ["view", str(bad), "--no-browser", "--out", str(tmp_path / "v.html")]):
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        assert r.output.startswith(f"error: cannot load {bad}: ") and message in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output  # one line, no traceback
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json", "good.json"]  # nothing written


def test_a_file_that_breaks_the_graphs_structure_is_refused_by_the_commands(tmp_path: Path) -> None:
    doc = copy.deepcopy(BASE)
    doc["nodes"][-1]["order"] = 0  # two nodes first
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    r = run("show", str(bad))
    assert r.exit_code == 2 and r.output.startswith("error: cannot load") and "'order'" in r.output


# ----------------------------------------------------------------------------- every valid file draws


def _inspected() -> gk.Graph:
    """Values on every node, a NaN and an Inf, a kernel checked against its reference."""
    def fn(x: mx.array, y: mx.array) -> tuple[mx.array, ...]:
        return mx.log(_axpy(x, y)), *mx.split(x * y, 2)

    x, y = mx.array([1.0, -1.0, 0.5, 2.0]), mx.array([0.0, 2.0, -1.0, 1.0])
    return gk.Inspector(check_kernels=True)(fn, x, y)


def _compared() -> gk.Graph:
    return gk.compare(lambda x: mx.exp(_axpy(x, x)), lambda x: mx.exp(_axpy(x, x * 1.01)), mx.ones((4,))).b


def _job() -> gk.Graph:
    return merge([gk.trace(lambda x: mx.distributed.all_sum(mx.exp(x)) * 2, mx.ones((2,)))])


def _empty() -> gk.Graph:
    return gk.Graph.from_json(json.dumps({"schema": "graphkern.tracing.graph", "version": 1, "graph": {},
                                          "nodes": [], "edges": []}))


VALID: dict[str, Callable[[], Any]] = {
    "traced": vg.traced,
    "traced, a refused launch": lambda: vg.traced(failed=True),
    "traced, no kernel": lambda: vg.traced(kernel=False),
    "patched llama (template floats)": lambda: vg.llama(2),
    "llama, a failed layer": lambda: vg.llama(2, broken=1),
    "inspected (stats, NaN, reference checks)": _inspected,
    "compared": _compared,
    "merged job (collectives)": _job,
    "hand-built, failed": lambda: gk.Graph(vg.small(failed=True).nx),
    "hand-built transformer": lambda: gk.Graph(vg.transformer(2, failed_layer=1).nx),
    "empty": _empty,
}


@pytest.mark.parametrize("name", VALID)
def test_every_valid_file_loads_and_every_renderer_draws_it(name: str, tmp_path: Path) -> None:
    graph = VALID[name]()
    text = graph.to_json()
    loaded = gk.Graph.from_json(text)
    assert loaded == graph
    loaded.lint()
    loaded.summary()
    assert loaded.to_html().startswith("<!DOCTYPE html>")
    assert loaded.to_dot(stats=True).startswith("digraph")
    assert loaded.to_model_explorer()["graphs"]
    to_model_explorer_node_data(loaded)
    changes = diff(loaded, loaded)
    assert not changes and changes.to_html()
    f = tmp_path / "g.json"
    f.write_text(text)
    r = run("show", str(f), "--brief", "--html", str(tmp_path / "g.html"), "--dot", str(tmp_path / "g.dot"),
            "--model-explorer", str(tmp_path / "g.me.json"))
    assert r.exit_code == (0 if loaded.ok else 1), r.output
    assert run("diff", str(f), str(f)).exit_code == 0
    assert run("view", str(f), "--no-browser", "--out", str(tmp_path / "v.html")).exit_code == 0
