"""Eager ``gk.apply`` overhead over calling the kernel's backend directly.

Target: <= 2 us a call. On a CPU the backend is the kernel's reference; on a GPU it is
the bare ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` object graphkern caches (see
benchmarks/gpu_core.py for the CUDA figures). Graph building only: nothing is evaluated, so the
figure is graphkern's own Python cost.

Without a GPU it also times graphkern's CUDA launch path against a stand-in for MLX's kernel object
(a Python function that returns its first input): the default launch, differentiable through an
``mx.custom_function``, and the plain one inside ``gk.without_vjp()``.
Run: python benchmarks/apply_overhead.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any
from unittest import mock

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from _timing import header, interleaved  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.launching import mlx_kernels

KERNEL = gk.Kernel(
    "scale_add",
    input_names=["x", "y"],
    output_names=["out"],
    metal="uint i = thread_position_in_grid.x; out[i] = x[i] * T(2) + y[i];",
    cuda="auto i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[0]) out[i] = x[i] * T(2) + y[i];",
    reference=lambda x, y: [x * 2 + y],
)


def main() -> None:
    print(header("eager apply overhead"))
    x, y = mx.ones((1024,)), mx.ones((1024,))
    spec = [gk.OutputSpec(x.shape, x.dtype)]
    template = [("T", mx.float32)]
    backend = gk.active_backend()
    if backend == "reference":
        reference = KERNEL.reference
        assert reference is not None
        direct = lambda: reference(x, y)  # noqa: E731
    else:
        obj = gk.kernel_cache.get(backend, KERNEL)
        direct = lambda: obj(inputs=[x, y], output_shapes=[x.shape], output_dtypes=[x.dtype],  # noqa: E731
                             grid=(1024, 1, 1), threadgroup=(256, 1, 1), template=template)
    bound = gk.bind(KERNEL, spec, grid=(1024, 1, 1), threadgroup=(256, 1, 1), template=template)
    times = interleaved({
        "direct": direct,
        "gk.apply": lambda: gk.apply(KERNEL, [x, y], spec, grid=(1024, 1, 1),
                                     threadgroup=(256, 1, 1), template=template),
        "gk.bind": lambda: bound(x, y),
        "gk.apply_in_graph": lambda: gk.apply_in_graph(KERNEL, [x, y], spec, grid=(1024, 1, 1),
                                                       threadgroup=(256, 1, 1), template=template),
    }, rounds=15, number=20_000)
    print(f"backend {backend}")
    for name, seconds in times.items():
        print(f"{name:>18}: {seconds * 1e6:7.2f} us/call")
    for name in ("gk.apply", "gk.bind", "gk.apply_in_graph"):
        print(f"{name} overhead: {(times[name] - times['direct']) * 1e6:.2f} us/call (target <= 2)")
    if backend == "reference":
        cuda_path_with_a_stand_in(x, y, spec, template)
    library_layer()


def library_layer() -> None:
    """A library layer call (``gkk.rms_norm``: its launch plan, then ``gk.apply``) against
    ``mx.fast.rms_norm``, one decoding step's row; and the plan alone."""
    import graphkern.kernels as gkk
    from graphkern.kernels.ops.rms_norm import plan_rms_norm

    x, w = mx.ones((1, 4096)), mx.ones((4096,))
    times = interleaved({
        "mx.fast.rms_norm": lambda: mx.fast.rms_norm(x, w, 1e-5),
        "gkk.rms_norm": lambda: gkk.rms_norm(x, w, 1e-5),
        "its plan": lambda: plan_rms_norm(x, w, 1e-5),
    }, rounds=15, number=20_000)
    print("library layer, one row of 4096 (graph building only)")
    for name, seconds in times.items():
        print(f"{name:>18}: {seconds * 1e6:7.2f} us/call")


def cuda_path_with_a_stand_in(x: mx.array, y: mx.array, spec: list[gk.OutputSpec], template: Any) -> None:
    def stand_in(*, inputs: Any, output_shapes: Any, output_dtypes: Any, grid: Any, threadgroup: Any,
                 template: Any, init_value: Any = None) -> list[mx.array]:
        return [inputs[0]]

    kernel = gk.Kernel("scale_add_stand_in", ["x", "y"], ["out"], cuda=KERNEL.cuda,
                       reference=KERNEL.reference)
    kw: dict[str, Any] = dict(grid=(1024, 1, 1), threadgroup=(256, 1, 1), template=template, backend="cuda")

    def plain() -> Any:
        with gk.without_vjp():
            return gk.apply(kernel, [x, y], spec, **kw)

    with mock.patch.object(mlx_kernels, "build_mlx_kernel", lambda backend, k: stand_in):
        times = interleaved({
            "direct": lambda: stand_in(inputs=[x, y], output_shapes=[x.shape], output_dtypes=[x.dtype],
                                       grid=(1024, 1, 1), threadgroup=(256, 1, 1), template=template),
            "gk.apply": lambda: gk.apply(kernel, [x, y], spec, **kw),
            "in without_vjp": plain,
        }, rounds=15, number=20_000)
    print("cuda launch path, MLX's kernel object replaced by a stand-in (graphkern's Python cost only)")
    for name in ("gk.apply", "in without_vjp"):
        print(f"{name:>18}: {(times[name] - times['direct']) * 1e6:7.2f} us/call over the stand-in")


if __name__ == "__main__":
    main()
