"""Which way a patched layer runs a call: through its library kernel, or as the stock layer it
replaced.

A kernel pays where it removes launches: inside a fused block's compiled segments, one launch does
a norm and three projections. A layer on its own (a norm, a RoPE, an activation or an MLP whose
kernel fuses nothing the stock op does not) launches once either way, and its launch plan costs
the host more than ``mx.fast``'s. So each patched layer has a route:

- ``"auto"`` (the default): on a GPU backend, a standalone layer runs the stock forward unless a
  graphkern trace is recording (so graphs and pictures still show its kernel) or a compiled
  segment is being traced (where a norm's kernel takes the residual add before it; an activation
  still runs stock there, which ``mx.compile`` fuses); fused blocks, attention prologues, stacks
  and mixture-of-experts routers always run their kernels. On the CPU (``reference`` backend) the
  kernels run their pure-MLX references, and every layer runs them.
  A fused block's norm-fed projection kernels take at most ``FUSED_MAX_ROWS`` token rows on a
  GPU (fewer for quantized weights than for plain ones); a call of more (batch decoding) runs the
  norm's kernel and the stock products, still in the block's compiled segments. A decoder stack
  of such blocks (no mixture of experts) runs a decoding call of more rows than its blocks' kernels
  take (:func:`stack_row_limit`) on the stock layers: with the products stock's, the norm
  kernels' launches cost the host more than stock's ops.
- ``"kernel"``: always the kernel, as a benchmark of the kernel or a test of it wants.
- ``"stock"``: always the stock forward, on the patched layer's own arrays; a decoder stack runs
  its stock layers (its fused blocks' too) for every call a graphkern trace does not record.

On a GPU the ``"auto"`` route of a decoder stack also chooses, for each shape of decoding call,
between its kernels and its stock layers by timing both (``graphkern.models.route_timing``).

``patch(model, route=...)`` sets it for every layer it builds, ``set_route(model, route)`` later.

>>> takes_stock("stock"), takes_stock("kernel")
(True, False)
"""

from __future__ import annotations

from typing import Any

from graphkern.errors import ModelError
from graphkern.launching.backends import on_gpu_backend
from graphkern.launching.context import state
from graphkern.nodes import Status

__all__ = ["FUSED_MAX_ROWS", "ROUTES", "WIDE_HIDDEN", "check_route", "fused_rows", "stack_row_limit",
           "takes_stock"]

#: The routes a patched layer can take (see the module's docstring).
ROUTES = ("auto", "kernel", "stock")

#: On a GPU, the most token rows a fused block's norm-fed projection kernels take unless the route
#: is ``"kernel"``, by the kind of weights they read. Their warps keep a sum a row and read the
#: normalized rows from shared memory for every weight vector. For plain 16-bit weights that still
#: pays at the kernels' own limit of eight rows (batch decoding of 8 sequences measured faster with
#: them than with stock's products); the quantized kernels also dequantize each weight vector once a
#: row group, and past two rows stock's quantized products measured faster
#: (benchmarks/RESULTS_generate.md).
FUSED_MAX_ROWS = {"plain": 8, "quantized": 2}
#: A dense decoder stack of plain weights wider than this takes the plain kernels for at most
#: ``FUSED_MAX_ROWS["quantized"]`` rows: there the weights are large enough that reading them
#: through the kernels' many-row form costs the GPU more than the launches save the host
#: (batch decoding of 8 sequences at the widths of Phi-3 mini and Mistral 7B measured slower than
#: stock, at Llama 3.2 1B's and narrower faster: benchmarks/RESULTS_generate.md).
WIDE_HIDDEN = 2048


def check_route(operation: str, route: Any) -> str:
    """``route`` if it is one of :data:`ROUTES`, else ``ModelError`` naming ``operation``."""
    if route not in ROUTES:
        raise ModelError(operation, f"route is {route!r}; choose one of {list(ROUTES)}", Status.INVALID_INPUT)
    return route  # type: ignore[no-any-return]


def takes_stock(route: str, elementwise: bool = False) -> bool:
    """Whether a standalone layer with ``route`` runs this call as the stock layer; an
    ``elementwise`` one (an activation) does inside a compiled segment too, where ``mx.compile``
    fuses the stock ops into one launch and a kernel would be a launch of its own."""
    if route == "auto":
        return state.recorder is None and (elementwise or not state.segment_depth) and on_gpu_backend()
    return route == "stock"


def _row_limit(route: str, kind: str) -> int | None:
    """``FUSED_MAX_ROWS[kind]`` on ``route``, or None for no limit (the ``"kernel"`` route, or off
    a GPU)."""
    if route == "kernel" or not on_gpu_backend():
        return None
    return FUSED_MAX_ROWS[kind]


def fused_rows(route: str, rows: int, quantized: bool = False) -> bool:
    """Whether a fused block on ``route`` runs its norm-fed projection kernels (``quantized``: the
    ones for quantized weights) for a call of ``rows`` token rows (see :data:`FUSED_MAX_ROWS`); the
    kernels' own limits apply besides."""
    limit = _row_limit(route, "quantized" if quantized else "plain")
    return limit is None or rows <= limit


def stack_row_limit(route: str, quantized: bool, hidden: int) -> int | None:
    """The most token rows a dense decoder stack on ``route`` decodes through its blocks' fused
    kernels (``quantized``: their quantized forms; ``hidden``: the model's width), or None for no
    limit (the ``"kernel"`` route, or off a GPU). A decoding call of more runs the stock layers.

    >>> stack_row_limit("kernel", quantized=True, hidden=4096) is None
    True
    """
    return _row_limit(route, "quantized" if quantized or hidden > WIDE_HIDDEN else "plain")
