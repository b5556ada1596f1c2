"""JSON safety: a graph file is data, never code.

Loading executes nothing (an audit hook watches for exec, compile, imports, pickle, processes);
truncated, corrupted, oversized and wrong-version documents give a ``KernelError`` naming the
load and what is wrong, never another exception; whatever loads is a usable graph that passes
lint and draws in every format (``tests/test_graph_files.py`` mutates each field); and for
random DAG functions of MLX ops, kernels (failing ones too) and module scopes,
``Graph.from_json(g.to_json()) == g``.
"""

from __future__ import annotations

import base64
import copy
import json
import pickle
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import networkx as nx
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import graphkern as gk
from graphkern.tracing import graph as graph_module
from graphkern.viz.graph_diff import diff

S = gk.Status
LOAD_OP = "load a graphkern graph from JSON"

AXPY = gk.Kernel("json_axpy", ["x", "y"], ["out"],
                 metal="uint i = thread_position_in_grid.x; out[i] = x[i] * T(2) + y[i];",
                 reference=lambda x, y: [x * 2 + y])
SPLIT = gk.Kernel("json_split", ["x"], ["pos", "neg"],
                  metal="uint i = thread_position_in_grid.x; pos[i] = max(x[i], T(0)); "
                        "neg[i] = min(x[i], T(0));",
                  reference=lambda x: [mx.maximum(x, 0), mx.minimum(x, 0)])
N = 4
SPEC = gk.OutputSpec((N,), mx.float32)


# ----------------------------------------------------------------------------- random DAG programs

UNARY: dict[str, Callable[[mx.array], mx.array]] = {
    "sin": mx.sin, "exp": mx.exp, "tanh": mx.tanh, "neg": mx.negative, "abs": mx.abs,
    "scale": lambda v: v * 2.5, "roundtrip16": lambda v: v.astype(mx.float16).astype(mx.float32),
    "sum_back": lambda v: mx.broadcast_to(mx.sum(v, keepdims=True), (N,)),
}
BINARY: dict[str, Callable[[mx.array, mx.array], mx.array]] = {
    "add": mx.add, "mul": mx.multiply, "max": mx.maximum, "sub": mx.subtract,
}
KERNEL_OPS = ("axpy", "split", "bad_axpy")


@dataclass(frozen=True)
class Program:
    """A random DAG: each instruction reads earlier values by index and appends its results."""

    n_inputs: int
    instructions: tuple[tuple[str, int, int], ...]
    outputs: tuple[int, ...]
    blocks: int  # 0: a plain function; k: an nn.Module with k blocks (module scopes)

    def step(self, values: list[mx.array], op: str, a: int, b: int) -> list[mx.array]:
        x, y = values[a % len(values)], values[b % len(values)]
        if op in UNARY:
            return [UNARY[op](x)]
        if op in BINARY:
            return [BINARY[op](x, y)]
        kw: dict[str, Any] = dict(grid=(N, 1, 1), threadgroup=(0 if op == "bad_axpy" else N, 1, 1),
                                  template=[("T", mx.float32)])
        if op == "split":
            return gk.apply_in_graph(SPLIT, [x], [SPEC, SPEC], **kw).outputs
        return gk.apply_in_graph(AXPY, [x, y], [SPEC], **kw).outputs

    def run(self, values: list[mx.array], instructions: tuple[tuple[str, int, int], ...]) -> list[mx.array]:
        values = list(values)
        for op, a, b in instructions:
            values += self.step(values, op, a, b)
        return values

    def function(self) -> Callable[..., Any]:
        program = self
        if not self.blocks:
            def fn(*inputs: mx.array) -> list[mx.array]:
                values = program.run(list(inputs), program.instructions)
                return [values[i % len(values)] for i in program.outputs]
            return fn

        class Block(nn.Module):
            def __init__(self, part: tuple[tuple[str, int, int], ...]) -> None:
                super().__init__()
                self.part = part
                self.gain = mx.full((N,), 1.5)  # a parameter: an input node in this scope

            def __call__(self, *values: mx.array) -> list[mx.array]:
                return program.run([v * self.gain for v in values], self.part)

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                size = -(-len(program.instructions) // program.blocks)
                self.blocks = [Block(program.instructions[i:i + size])
                               for i in range(0, len(program.instructions), size)]

            def __call__(self, *inputs: mx.array) -> list[mx.array]:
                values = list(inputs)
                for block in self.blocks:
                    values = block(*values)
                return [values[i % len(values)] for i in program.outputs]

        return Model()


PROGRAMS = st.builds(
    Program,
    n_inputs=st.integers(1, 3),
    instructions=st.lists(st.tuples(st.sampled_from([*UNARY, *BINARY, *KERNEL_OPS]),
                                    st.integers(0, 30), st.integers(0, 30)),
                          min_size=1, max_size=12).map(tuple),
    outputs=st.lists(st.integers(0, 40), min_size=1, max_size=3).map(tuple),
    blocks=st.integers(0, 3),
)


def traced(program: Program) -> gk.Graph:
    inputs = [mx.arange(N, dtype=mx.float32) * (i + 1) - 1 for i in range(program.n_inputs)]
    return gk.trace(program.function(), *inputs)


# ----------------------------------------------------------------------------- helpers


@contextmanager
def no_code_runs() -> Iterator[list[tuple[str, Any]]]:
    """Record every audit event that would mean code runs or loads while the block executes."""
    seen: list[tuple[str, Any]] = []
    watching = [True]
    forbidden = ("exec", "compile", "import", "pickle.find_class", "marshal.loads", "os.system",
                 "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "ctypes", "code.__new__")

    def hook(event: str, args: Any) -> None:
        if watching[0] and event.startswith(forbidden):
            seen.append((event, args))

    _install_hook(hook)
    try:
        yield seen
    finally:
        watching[0] = False
        _HOOKS.remove(hook)


_HOOKS: list[Callable[[str, Any], None]] = []


def _install_hook(hook: Callable[[str, Any], None]) -> None:
    """Audit hooks cannot be removed: one dispatcher is installed once, hooks come and go."""
    if not getattr(_install_hook, "installed", False):
        sys.addaudithook(lambda event, args: [h(event, args) for h in list(_HOOKS)] and None)
        _install_hook.installed = True  # type: ignore[attr-defined]
    _HOOKS.append(hook)


def load_fails(text: str | bytes, fragment: str = "") -> gk.KernelError:
    with pytest.raises(gk.KernelError) as info:
        gk.Graph.from_json(text)
    err = info.value
    assert err.operation == LOAD_OP and err.status == S.INVALID_INPUT and err.description
    assert fragment in err.description, err.description
    return err


def assert_usable(g: gk.Graph) -> None:
    """A loaded graph passes lint, answers every inspection call, draws in every format and
    writes itself back identically."""
    g.lint()
    g.summary()
    g.failures()
    g.affected_outputs()
    g.collapse(1)
    assert isinstance(g.status, gk.Status) and g.ok == (g.status == S.OK)
    g.to_html()
    g.to_dot(stats=True)
    g.to_model_explorer()
    diff(SAMPLE, g).to_html()
    assert gk.Graph.from_json(g.to_json()) == g


SAMPLE = gk.trace(lambda x, y: (mx.exp(gk.apply_in_graph(AXPY, [x, y], [SPEC], grid=(N, 1, 1),
                                                             threadgroup=(0, 1, 1)).outputs[0]),
                                x + y), mx.ones((N,)), mx.ones((N,)))
SAMPLE_TEXT = SAMPLE.to_json()
# warm-up: networkx compiles its dispatch wrappers and tabulate is imported on first use; that
# is library code loading once, not the document's content, so it happens before any watching
gk.Graph.from_json(SAMPLE_TEXT).summary()


# ----------------------------------------------------------------------------- tests


@given(program=PROGRAMS)
def test_round_trip_of_random_traced_dags(program: Program) -> None:
    g = traced(program)
    note(g.summary())
    text = g.to_json()
    with no_code_runs() as seen:
        loaded = gk.Graph.from_json(text)
    assert not seen
    assert loaded == g and loaded.to_json() == text
    assert loaded.status == g.status and loaded.failures() == g.failures()
    assert nx.utils.graphs_equal(loaded.nx, g.nx)  # attributes too, not only the JSON form
    assert loaded.kernels() == g.kernels()
    assert loaded.summary() == g.summary()
    expected_kernels = sum(1 for op, _, _ in program.instructions if op in KERNEL_OPS)
    assert len(g.kernels()) == expected_kernels
    assert (g.status == S.INVALID_LAUNCH) == any(op == "bad_axpy" for op, _, _ in program.instructions)


def test_loading_never_executes_code(tmp_path: Any) -> None:
    """Payloads that a pickle-, eval- or object-hook-based loader would run stay inert strings."""
    canary = tmp_path / "ran"

    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (open, (str(canary), "w"))

    payloads = [
        base64.b64encode(pickle.dumps(Boom())).decode(),
        pickle.dumps(Boom()).decode("latin-1"),
        f"__import__('os').system('touch {canary}')",
        {"py/object": "os.system", "py/reduce": [f"touch {canary}"]},  # jsonpickle
        {"__class__": "subprocess.Popen", "args": ["touch", str(canary)]},
        {"!!python/object/apply:os.system": [f"touch {canary}"]},  # YAML tag
    ]
    doc = json.loads(SAMPLE_TEXT)
    for i, payload in enumerate(payloads):
        doc["nodes"][0][f"payload_{i}"] = payload
        doc["graph"][f"payload_{i}"] = payload
        doc["edges"][0][f"payload_{i}"] = payload
    text = json.dumps(doc)
    with no_code_runs() as seen:
        loaded = gk.Graph.from_json(text)
        loaded.summary()
    assert not seen, seen
    assert not canary.exists()
    first = loaded.node(doc["nodes"][0]["id"])
    assert [first[f"payload_{i}"] for i in range(len(payloads))] == payloads  # kept as plain data

    def plain(value: Any) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, (str, int, float, bool))

    assert plain(dict(loaded.nx.graph))
    assert all(plain(d) for _, d in loaded.nx.nodes(data=True))
    assert all(plain(d) for _, _, d in loaded.nx.edges(data=True))
    with pytest.raises(gk.KernelError):  # a pickle is not a graph file
        gk.Graph.from_json(pickle.dumps(SAMPLE.to_dict()))


def test_every_truncation_is_a_clear_error() -> None:
    text = SAMPLE_TEXT
    cuts = sorted({*range(0, len(text), max(1, len(text) // 300)), len(text) - 1, 1})
    for cut in cuts:
        err = load_fails(text[:cut])
        assert "truncated" in err.description or "not a graphkern graph" in err.description
    assert gk.Graph.from_json(text) == SAMPLE


@pytest.mark.parametrize("version", [0, 2, 99, "1", 1.5, None, True, [1]])
def test_wrong_versions_are_refused_by_name(version: Any) -> None:
    doc = json.loads(SAMPLE_TEXT)
    doc["version"] = version
    err = load_fails(json.dumps(doc), "version")
    assert "reads version 1" in err.description


@pytest.mark.parametrize("schema", ["graphkern.graphs", "", None, 1])
def test_other_schemas_are_refused(schema: Any) -> None:
    doc = json.loads(SAMPLE_TEXT)
    doc["schema"] = schema
    load_fails(json.dumps(doc), "not a graphkern graph")
    del doc["schema"]
    load_fails(json.dumps(doc), "not a graphkern graph")


def test_oversized_documents_are_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph_module, "MAX_JSON_BYTES", len(SAMPLE_TEXT) - 1)
    load_fails(SAMPLE_TEXT, "over")
    load_fails(SAMPLE_TEXT.encode(), "over")
    monkeypatch.setattr(graph_module, "MAX_JSON_BYTES", len(SAMPLE_TEXT))
    assert gk.Graph.from_json(SAMPLE_TEXT) == SAMPLE


@pytest.mark.parametrize("text", [
    "", " ", "null", "[]", "{}", "0", '"graph"', "[" * 100_000, '{"a":' * 100_000,
    "1" * 5_000,  # over Python's int-string limit: a ValueError that is not a JSONDecodeError
    '{"schema": "graphkern.tracing.graph", "version": 1, "graph": {}, "nodes": [], "edges": [], "x": '
    + "9" * 5000 + "}",
    b"\xff\xfe\x00{", b'{"schema": "\xc3\x28"}', "\ud800", 12, None, ["{}"],
], ids=["empty", "space", "null", "list", "object", "number", "string", "deep-list", "deep-object",
        "huge-int", "huge-int-field", "utf16-bom", "bad-utf8", "lone-surrogate", "int", "none", "list-arg"])
def test_garbage_gives_a_clear_error(text: Any) -> None:
    load_fails(text)


def test_empty_graph_round_trips() -> None:
    doc = {"schema": graph_module.SCHEMA, "version": graph_module.SCHEMA_VERSION, "graph": {},
           "nodes": [], "edges": []}
    g = gk.Graph.from_json(json.dumps(doc))
    assert g.ok and g.nx.number_of_nodes() == 0 and gk.Graph.from_json(g.to_json()) == g


# structured corruption: one value anywhere replaced by another JSON value
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
              st.text(max_size=5), st.sampled_from(["input", "kernel", "op", "float32", "x", "output_0"])),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.text(max_size=4), children, max_size=3)),
    max_leaves=6,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


SAMPLE_PATHS = [p for p in _paths(json.loads(SAMPLE_TEXT)) if p]


@given(path=st.sampled_from(SAMPLE_PATHS), value=JSON_VALUES, delete=st.booleans())
def test_structurally_corrupted_documents_load_or_fail_clearly(path: tuple[Any, ...], value: Any,
                                                               delete: bool) -> None:
    doc = copy.deepcopy(json.loads(SAMPLE_TEXT))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if delete and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    try:
        g = gk.Graph.from_json(json.dumps(doc))
    except gk.KernelError as err:
        assert err.operation == LOAD_OP and err.status == S.INVALID_INPUT and err.description
        return
    assert_usable(g)


@given(data=st.data())
def test_byte_level_corruption_loads_or_fails_clearly(data: st.DataObject) -> None:
    raw = bytearray(SAMPLE_TEXT.encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    try:
        g = gk.Graph.from_json(bytes(raw))
    except gk.KernelError as err:
        assert err.operation == LOAD_OP and err.status == S.INVALID_INPUT
        return
    assert_usable(g)
