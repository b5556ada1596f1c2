"""Precompiled CUDA kernels: a ``Kernel`` carrying PTX or a cubin (``cuda_binary``) instead of CUDA
source runs through ``mx.fast.precompiled_cuda_kernel``, is cached and traced like a source
kernel, and matches its reference.

MLX calls a precompiled entry point by the kernel's own name with the inputs, then the outputs,
then the scalars; graphkern's template ints and bools are those scalars, in order. The PTX
fixture (fixtures/gk_axpb.ptx, from fixtures/gk_axpb.cu) needs no nvcc; where nvcc is installed
the .cu is also built here, to PTX and to a cubin for this GPU.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import graphkern as gk
from graphkern.launching import mlx_kernels

pytestmark = pytest.mark.gpu

CUDA = mx.cuda.is_available()
BACKEND = "cuda" if CUDA else "reference"
FIXTURES = Path(__file__).parent / "fixtures"
PTX = (FIXTURES / "gk_axpb.ptx").read_bytes()
TWO, THREE = b"0f40000000", b"0f40400000"  # the float constants 2.0 and 3.0 in PTX
N = 1000


def axpb_kernel(binary: bytes, scale: float = 2.0, name: str = "gk_axpb") -> gk.Kernel:
    return gk.Kernel(name, ["x"], ["out"], cuda_binary=binary,
                     reference=lambda x, b: [x * scale + b])


AXPB = axpb_kernel(PTX)


def _x(n: int = N) -> mx.array:
    mx.random.seed(11)
    return mx.random.normal(shape=(n,))


def _launch(kernel: gk.Kernel, x: mx.array, *, n: int | None = None, b: int = 3,
            init_value: float | None = None, in_graph: bool = False) -> Any:
    call: Callable[..., Any] = gk.apply_in_graph if in_graph else gk.apply
    return call(kernel, [x], [gk.OutputSpec(x.shape, x.dtype)], grid=(x.size, 1, 1),
                threadgroup=(256, 1, 1), template=[("n", x.size if n is None else n), ("b", b)],
                init_value=init_value)


def _close(got: mx.array, want: mx.array) -> None:
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)


def _check_node(g: gk.Graph, kernel: gk.Kernel) -> None:
    [name] = g.kernels()
    node = g.node(name)
    assert node["status"] == gk.Status.OK and node["backend"] == BACKEND
    assert node["kernel"] == kernel.name and node["source_hash"] == kernel.source_hash
    if CUDA:  # MLX's CustomKernel primitive folded into the node; precompiled: named as the entry
        assert node["generated_name"] == kernel.name
        assert not [n for n in g.nodes("op") if g.node(n)["op"] == "CustomKernel"]


def _run_all_ways(kernel: gk.Kernel, scale: float) -> None:
    x = _x()
    want = x * scale + 3
    _close(_launch(kernel, x)[0], want)
    res = _launch(kernel, x, in_graph=True)
    assert res.ok, res.error
    _close(res.outputs[0], want)

    def fn(x: mx.array) -> mx.array:
        return _launch(kernel, x, in_graph=True).outputs[0] - 1

    g = gk.trace(fn, x)
    assert g.status == gk.Status.OK
    _check_node(g, kernel)
    cf = gk.compile(fn)
    for _ in range(2):
        _close(cf(x), want - 1)
    _check_node(cf.graph, kernel)


def test_ptx_fixture_apply_trace_compile() -> None:
    _run_all_ways(AXPB, 2.0)


def test_ptx_scalars_and_init_value() -> None:
    """Template ints become the kernel's scalars in order (n, b); init_value fills the outputs
    first, so elements the kernel skips (i >= n) keep it."""
    x = _x()
    init = 7.0
    kernel = gk.Kernel("gk_axpb", ["x"], ["out"], cuda_binary=PTX,
                       reference=lambda x, n, b: [mx.where(mx.arange(x.size) < n, x * 2 + b, init)])
    for n, b in ((N, 3), (600, -5), (1, 0)):
        [got] = _launch(kernel, x, n=n, b=b, init_value=init)
        want = mx.where(mx.arange(N) < n, x * 2 + b, init)
        _close(got, want)
        [ref] = gk.apply(kernel, [x], [gk.OutputSpec(x.shape, x.dtype)], grid=(N, 1, 1),
                         threadgroup=(256, 1, 1), template=[("n", n), ("b", b)], backend="reference")
        _close(got, ref)


def test_precompiled_kernels_are_cached_by_binary() -> None:
    x = _x()
    kernel = axpb_kernel(PTX + b"\n// cached\n")  # a binary no other test uses
    before = gk.kernel_cache.stats()
    for b in (1, 2, 3):  # three launches of one binary (a repeated launch replays without a lookup)
        mx.eval(_launch(kernel, x, b=b))
    after = gk.kernel_cache.stats()
    if CUDA:
        assert after["misses"] - before["misses"] == 1
        assert after["hits"] - before["hits"] == 2
        assert mlx_kernels.KernelCache.key("cuda", kernel)[2] == kernel.cuda_binary


def test_same_name_different_binaries_each_run_their_own() -> None:
    """Two precompiled kernels named gk_axpb, one computing 2x+b and one 3x+b, in one batch."""
    three = PTX.replace(TWO, THREE)
    assert three != PTX
    k2, k3 = AXPB, axpb_kernel(three, 3.0)
    x = _x()
    [a] = _launch(k2, x)
    [b] = _launch(k3, x)
    mx.eval(a, b)
    _close(a, x * 2 + 3)
    _close(b, x * 3 + 3)
    cf = gk.compile(lambda x: [_launch(k, x, in_graph=True).outputs[0] for k in (k2, k3)])
    got = cf(x)
    _close(got[0], x * 2 + 3)
    _close(got[1], x * 3 + 3)


def test_dtype_templates_are_refused_for_binaries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHKERN_BACKEND", "cuda")
    x = _x()
    with pytest.raises(gk.KernelError) as info:
        gk.apply(AXPB, [x], [gk.OutputSpec(x.shape, x.dtype)], grid=(N, 1, 1),
                 threadgroup=(256, 1, 1), template=[("T", mx.float32)])
    assert info.value.status == gk.Status.INVALID_TEMPLATE


def test_bad_binary_fails_at_eval_on_its_node(cuda_only: None) -> None:
    """A binary the driver refuses fails when MLX loads it (at evaluation); the compiled graph
    blames the kernel's node, and MLX stays usable."""
    bad = gk.Kernel("gk_bad_binary", ["x"], ["out"], cuda_binary=b"this is neither PTX nor a cubin",
                    reference=lambda x: [x])
    x = _x()

    def fn(x: mx.array) -> mx.array:
        y = gk.apply_in_graph(bad, [x], [gk.OutputSpec(x.shape, x.dtype)], grid=(N, 1, 1),
                              threadgroup=(256, 1, 1)).outputs[0]
        return mx.exp(y)

    cf = gk.compile(fn)
    with pytest.raises(gk.GraphError) as info:
        cf(x)
    err = info.value
    node = cf.graph.node(err.node)
    assert node["kernel"] == "gk_bad_binary", cf.graph.summary()
    assert err.status == gk.Status.COMPILE_ERROR, err
    assert "gk_bad_binary" in node["message"]
    assert all(cf.graph.node(n)["status"] == gk.Status.UPSTREAM_FAILED
               for n in cf.graph.nx.successors(err.node))
    _close(_launch(AXPB, x)[0], x * 2 + 3)  # a valid call afterwards


@pytest.fixture(scope="module")
def nvcc_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The fixture's .cu built here with nvcc for this GPU: PTX and a cubin."""
    if not CUDA:
        pytest.skip("needs MLX's CUDA backend")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    out = tmp_path_factory.mktemp("nvcc")
    built = {}
    for kind in ("ptx", "cubin"):
        target = out / f"gk_axpb.{kind}"
        cmd = [nvcc, f"-{kind}", "-arch=native", str(FIXTURES / "gk_axpb.cu"), "-o", str(target)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
        built[kind] = target.read_bytes()
    return built


@pytest.mark.parametrize("kind", ["ptx", "cubin"])
def test_nvcc_built_binary(nvcc_builds: dict[str, bytes], kind: str) -> None:
    _run_all_ways(axpb_kernel(nvcc_builds[kind]), 2.0)
