"""SwiGLU's gating: ``silu(gate) * up`` in one pass (float32 inside), the MLP of Llama-style models."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from graphkern.kernels.base import Case, Plan, check_dtype
from graphkern.kernels.declaration import declare
from graphkern.kernels.elementwise import cuda_map_body, metal_map_body, plan_elementwise
from graphkern.kernels.headers import dual_header
from graphkern.nodes import Kernel, KernelError, Status, dtype_name

__all__ = ["SWIGLU", "plan_swiglu", "swiglu", "swiglu_reference"]

_EXPR = "gate * (1.0f / (1.0f + {exp}(-gate))) * up"


def swiglu_reference(gate: mx.array, up: mx.array) -> list[mx.array]:
    """Pure-MLX ``silu(gate) * up`` in float32, cast back to the inputs' dtype."""
    g = gate.astype(mx.float32)
    return [(g * mx.sigmoid(g) * up.astype(mx.float32)).astype(gate.dtype)]


SWIGLU = Kernel(
    "gk_swiglu",
    input_names=["gate", "up"],
    output_names=["out"],
    metal=metal_map_body(["gate", "up"], _EXPR.format(exp="metal::precise::exp")),
    cuda=(_BODY := cuda_map_body(["gate", "up"], _EXPR.format(exp="expf"))),
    header=dual_header("", "", body=_BODY),
    reference=swiglu_reference,
)


def _make_inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array) -> Case:
    kg, ku = mx.random.split(key)
    return Case(((2.0 * mx.random.normal(tuple(shape), key=kg)).astype(dtype),
                 mx.random.normal(tuple(shape), key=ku).astype(dtype)))


@declare(SWIGLU, stock=lambda gate, up: nn.silu(gate) * up, make_inputs=_make_inputs,
         shapes=((4, 64), (2, 3, 100), (7, 1001), (3, 4096)),
         description="silu(gate) * up (nn.silu(gate) * up)")
def plan_swiglu(gate: mx.array, up: mx.array) -> Plan:
    """The launch :func:`swiglu` makes (validated)."""
    op = "swiglu"
    check_dtype(op, gate, "gate")
    check_dtype(op, up, "up")
    if gate.shape != up.shape:
        raise KernelError(op, f"gate has shape {tuple(gate.shape)} but up has {tuple(up.shape)}",
                          Status.INVALID_INPUT)
    if gate.dtype != up.dtype:
        raise KernelError(op, f"dtype mismatch: gate is {dtype_name(gate.dtype)} but up is "
                          f"{dtype_name(up.dtype)}", Status.INVALID_INPUT)
    # float32 in blocks of 1024, as MLX's compiled kernels launch (faster than 128 for float32 once
    # loads are whole vectors; 16-bit rows stay at 128: benchmarks/RESULTS_kernels.md)
    return plan_elementwise(op, SWIGLU, [gate, up], block=1024 if gate.dtype.size == 4 else 128)


@plan_swiglu.layer
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up``, like ``nn.silu(gate) * up`` in a Llama MLP, in one kernel.

    >>> [round(v, 4) for v in swiglu(mx.array([1.0, -2.0]), mx.array([2.0, 3.0])).tolist()]
    [1.4621, -0.7152]
    """
    return plan_swiglu.launch(gate, up)[0]
