"""Small kernels shared by the core tests."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

import graphkern as gk

SCALE_ADD = gk.Kernel(
    "scale_add",
    input_names=["x", "y"],
    output_names=["out"],
    metal="uint i = thread_position_in_grid.x; out[i] = x[i] * T(2) + y[i];",
    cuda="auto i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[0]) out[i] = x[i] * T(2) + y[i];",
    reference=lambda x, y: [x * 2 + y],
)

SPLIT = gk.Kernel(
    "split_sign",
    input_names=["x"],
    output_names=["pos", "neg"],
    metal="uint i = thread_position_in_grid.x; pos[i] = max(x[i], T(0)); neg[i] = min(x[i], T(0));",
    cuda="auto i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[0]) "
         "{ pos[i] = x[i] > T(0) ? x[i] : T(0); neg[i] = x[i] < T(0) ? x[i] : T(0); }",
    reference=lambda x: [mx.maximum(x, 0), mx.minimum(x, 0)],
)


def scale_add(x: mx.array, y: mx.array, threadgroup: tuple[int, int, int] = (256, 1, 1)) -> gk.KernelResult:
    return gk.apply_in_graph(SCALE_ADD, [x, y], [gk.OutputSpec(x.shape, x.dtype)],
                             grid=(x.size, 1, 1), threadgroup=threadgroup,
                             template=[("T", x.dtype)])


def split_sign(x: mx.array) -> gk.KernelResult:
    spec = gk.OutputSpec(x.shape, x.dtype)
    return gk.apply_in_graph(SPLIT, [x], [spec, spec], grid=(x.size, 1, 1),
                             threadgroup=(256, 1, 1), template=[("T", x.dtype)])


def misaligned(a: Any) -> Any:
    """Arrays in ``a`` (an array, or tuples and lists of them, nested) with the same values, but
    starting one element past an aligned address, as a slice of a larger array does; anything else
    as it is."""
    if isinstance(a, (tuple, list)):
        items = [misaligned(item) for item in a]
        return type(a)(*items) if hasattr(a, "_fields") else type(a)(items)  # a NamedTuple: by field
    if not isinstance(a, mx.array) or a.ndim == 0:
        return a
    flat = mx.concatenate([mx.zeros((1,), a.dtype), a.reshape(-1)])
    return flat[1:].reshape(a.shape)
