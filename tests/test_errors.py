"""Error classes by kind: each operation raises its kind, which is a GraphkernError and (as before
the kinds existed) a KernelError, names the operation, and pickles as itself."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

import graphkern as gk
from graphkern import errors
from graphkern.launching.backends import using_backend
from graphkern.viz.dot import render


def _broken_graph() -> None:
    graph = gk.trace(lambda x: x + 1, mx.ones((2,)))
    graph.nx.add_edge("output_0", graph.nodes("input")[0], key="out", dtype="float32", shape=[2])  # a cycle
    graph.lint()


CASES: list[tuple[type[gk.GraphkernError], Callable[[], Any], str, str]] = [
    (gk.GraphFormatError, lambda: gk.Graph.from_json("{"), "load a graphkern graph", "not valid JSON"),
    (gk.GraphFormatError, _broken_graph, "lint a graphkern graph", ""),
    (gk.BackendError, lambda: using_backend("tpu").__enter__(), "choose a graphkern backend", "'tpu'"),
    (gk.ModelError, lambda: gk.wrap(None), "wrap a model", "expects an mlx.nn.Module"),
    (gk.ModelError, lambda: gk.patch(nn.RMSNorm(2), kernels="rms_norm"), "patch a model", "kernels must be"),
    (gk.DrawingError, lambda: render(gk.trace(lambda x: x * 2, mx.ones(2)), "graph.bmp"),
     "render", "the suffix .bmp is not one of"),
]


@pytest.mark.parametrize("kind, call, operation, needle", CASES)
def test_each_operation_raises_its_kind(kind: type[gk.GraphkernError], call: Callable[[], Any],
                                        operation: str, needle: str) -> None:
    with pytest.raises(kind) as info:
        call()
    error = info.value
    assert type(error) is kind and error.operation.startswith(operation) and needle in error.description
    assert isinstance(error, gk.GraphkernError) and isinstance(error, gk.KernelError)  # caught as before
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is kind and str(again) == str(error) and again.status == error.status


def test_the_kinds_are_exported_and_apart() -> None:
    kinds = [gk.GraphFormatError, gk.BackendError, gk.ModelError, gk.DrawingError]
    assert all(getattr(errors, k.__name__) is k and k.__name__ in gk.__all__ for k in kinds)
    assert all(not issubclass(a, b) for a in kinds for b in kinds if a is not b)
    assert issubclass(gk.GraphError, gk.KernelError) and issubclass(gk.KernelError, gk.GraphkernError)
    assert issubclass(gk.PatchWarning, UserWarning) and "PatchWarning" in gk.__all__
