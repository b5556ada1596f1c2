"""NaN and Inf in a compiled call's outputs: ``all_finite`` looks, ``non_finite_error`` names the node
where they started (``gk.compile(check_finite=True)``, ``gk.wrap(check_finite=True)``).

>>> import mlx.core as mx
>>> all_finite([mx.ones((2,)), {"y": mx.array([1.0, float("nan")])}])
False
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..nodes import Status
from ..tracing.graph import Failure, GraphError
from ..tracing.state import Flat, flatten_outputs
from ..tracing.traceable import Traceable
from .extensions import inspect_values

__all__ = ["all_finite", "non_finite_error"]


def _finite_flag(*arrays: mx.array) -> mx.array:
    flags = [mx.all(mx.isfinite(a)) for a in arrays]
    return flags[0] if len(flags) == 1 else mx.all(mx.stack(flags))


_compiled_finite_flag = mx.compile(_finite_flag)


def all_finite(tree: Any) -> bool:
    """No NaN or Inf in the floating-point arrays of ``tree`` (evaluates them): one reduction per
    array, compiled, on the device; where MLX computes on the CPU, numpy reads the evaluated
    arrays in place instead (an MLX reduction's dispatch costs more than numpy's whole pass)."""
    arrays = [a for a in flatten_outputs(tree)[0] if mx.issubdtype(a.dtype, mx.inexact)]
    if not arrays:
        return True
    if mx.default_device().type != mx.DeviceType.cpu:
        return bool(_compiled_finite_flag(*arrays).item())
    mx.eval(arrays)
    for a in arrays:
        # bfloat16, which numpy lacks: an exponent of all ones is an Inf or a NaN
        host = (np.asarray(a.view(mx.uint16)) & 0x7F80) != 0x7F80 if a.dtype == mx.bfloat16 \
            else np.isfinite(np.asarray(a))
        if not host.all():
            return False
    return True


def non_finite_error(traceable: Traceable, flat: Flat, backend: str | None) -> GraphError:
    """The ``GraphError`` for a call whose outputs held NaN or Inf: the values trace of the same
    call (``extensions.inspect_values``) names the node where they started."""
    graph = inspect_values(traceable, flat, backend)
    if graph is None:
        return GraphError(Failure("<outputs>", Status.NON_FINITE, "the outputs held NaN or Inf (no value "
                                  "inspector is installed to name the node where they started)", ()))
    roots = [f for f in graph.failures() if f.status == Status.NON_FINITE]
    if roots:
        error = GraphError(roots[0])
    else:
        outputs = tuple(graph.nodes("output"))
        error = GraphError(Failure("<outputs>", Status.NON_FINITE,
                                   "the outputs held NaN or Inf, but running the graph node by node "
                                   "made none (see .graph: values_note says which nodes were not "
                                   "reached)", outputs))
    error.graph = graph
    return error
