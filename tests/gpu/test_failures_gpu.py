"""Real evaluation-time failures on the CUDA backend, and launches that must never reach MLX.

A CUDA body that NVRTC rejects only fails when MLX evaluates the graph: the compiled graph must
blame the right kernel node (COMPILE_ERROR, carrying NVRTC's log), mark everything downstream
UPSTREAM_FAILED, leave independent nodes OK, and leave MLX usable for the next, valid call. A
zero threadgroup would make MLX's CUDA backend divide by zero on the host: graphkern refuses it
before MLX sees it (INVALID_LAUNCH).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import mlx.core as mx
import networkx as nx
import numpy as np
import pytest

import graphkern as gk
from graphkern.launching import backends, mlx_kernels

pytestmark = pytest.mark.gpu

CUDA = mx.cuda.is_available()
ELEM = "int64_t elem = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;\n"

SCALE_ADD = gk.Kernel(
    "fail_scale_add", ["x", "y"], ["out"],
    cuda=ELEM + "if (elem < x_shape[0]) out[elem] = x[elem] * T(2) + y[elem];",
    reference=lambda x, y: [x * 2 + y],
)
PLUS_ONE = gk.Kernel(
    "fail_plus_one", ["x"], ["out"],
    cuda=ELEM + "if (elem < x_shape[0]) out[elem] = x[elem] + T(1);",
    reference=lambda x: [x + 1],
)
BROKEN_BODY = gk.Kernel(
    "broken_body", ["x"], ["out"],
    cuda=ELEM + "if (elem < x_shape[0]) out[elem] = x[elem] + gk_not_declared_anywhere;",
    reference=lambda x: [x + 1],
)
BROKEN_HEADER = gk.Kernel(
    "broken_header", ["x"], ["out"],
    header="__device__ float gk_helper(float v) { return v + ; }",
    cuda=ELEM + "if (elem < x_shape[0]) out[elem] = gk_helper(x[elem]);",
    reference=lambda x: [x + 1],
)
LAUNCH_TARGET = gk.Kernel(
    "launch_target", ["x"], ["out"],
    cuda=ELEM + "if (elem < x_shape[0]) out[elem] = x[elem] * T(3);",
    reference=lambda x: [x * 3],
)
# what NVRTC's log must mention for each broken kernel
LOG_MARK = {"broken_body": "gk_not_declared_anywhere", "broken_header": "expected an expression"}


def _launch(kernel: gk.Kernel, inputs: list[mx.array], **kw: Any) -> gk.KernelResult:
    x = inputs[0]
    kw.setdefault("grid", (x.size, 1, 1))
    kw.setdefault("threadgroup", (256, 1, 1))
    kw.setdefault("template", [("T", x.dtype)])
    return gk.apply_in_graph(kernel, inputs, [gk.OutputSpec(x.shape, x.dtype)], **kw)


def _graph_with(bad: gk.Kernel, **bad_launch: Any) -> Any:
    def fn(x: mx.array, y: mx.array) -> tuple[mx.array, mx.array]:
        a = _launch(SCALE_ADD, [x, y]).outputs[0]   # upstream of the failure: stays OK
        b = _launch(bad, [a], **bad_launch).outputs[0]  # the failing node
        c = mx.exp(b)                                # downstream op
        d = _launch(PLUS_ONE, [c]).outputs[0]        # downstream kernel
        e = a * 3                                    # independent branch: stays OK
        return d, e
    return fn


def _xy() -> tuple[mx.array, mx.array]:
    mx.random.seed(5)
    return mx.random.normal(shape=(4096,)), mx.random.normal(shape=(4096,))


def _assert_mlx_usable() -> None:
    """A valid kernel, eagerly and compiled, and plain MLX work after a failure."""
    x, y = _xy()
    [out] = gk.apply(SCALE_ADD, [x, y], [gk.OutputSpec(x.shape, x.dtype)], grid=(x.size, 1, 1),
                     threadgroup=(256, 1, 1), template=[("T", x.dtype)])
    np.testing.assert_allclose(np.array(out), np.array(x * 2 + y), rtol=1e-6)
    cf = gk.compile(lambda x, y: _launch(PLUS_ONE, [_launch(SCALE_ADD, [x, y]).outputs[0]]).outputs[0])
    np.testing.assert_allclose(np.array(cf(x, y)), np.array(x * 2 + y + 1), rtol=1e-6)
    assert mx.allclose(mx.sum(mx.ones((128, 128)) @ mx.ones((128, 1))), mx.array(128.0 * 128))


@pytest.mark.parametrize("bad", [BROKEN_BODY, BROKEN_HEADER], ids=lambda k: k.name)
def test_nvrtc_error_is_a_compile_error_on_its_node(cuda_only: None, bad: gk.Kernel) -> None:
    x, y = _xy()
    fn = _graph_with(bad)
    assert gk.trace(fn, x, y).ok  # the source is only compiled when MLX evaluates it

    cf = gk.compile(fn)
    with pytest.raises(gk.GraphError) as info:
        cf(x, y)
    err = info.value
    g = cf.graph
    summary = g.summary()
    assert err.status == gk.Status.COMPILE_ERROR, summary
    node = g.node(err.node)
    assert node["kernel"] == bad.name, summary
    message = node["message"]
    # NVRTC's log: MLX's "Failed to compile kernel: <module>.cu(LINE): error: ..."
    assert "error" in message and LOG_MARK[bad.name] in message, message
    assert backends.generated_name(bad) in message
    assert g.status == gk.Status.COMPILE_ERROR and [f.node for f in g.failures()] == [err.node]

    below = nx.descendants(g.nx, err.node)
    assert below, summary
    for n in below:
        assert g.node(n)["status"] == gk.Status.UPSTREAM_FAILED, summary
        assert g.node(n)["root_cause"] == err.node
    kernels_below = [n for n in below if g.node(n)["kind"] == "kernel"]
    assert [g.node(n)["kernel"] for n in kernels_below] == ["fail_plus_one"], summary
    upstream = [n for n in g.kernels() if g.node(n)["kernel"] == "fail_scale_add"]
    assert [g.node(n)["status"] for n in upstream] == [gk.Status.OK]
    outputs = sorted(g.nodes("output"), key=lambda n: int(n.rsplit("_", 1)[1]))  # output_<index>
    assert [g.node(n)["status"] for n in outputs] == [gk.Status.UPSTREAM_FAILED, gk.Status.OK]
    assert err.affected_outputs == (outputs[0],)

    assert cf.call_with_status(x, y) == (None, gk.Status.COMPILE_ERROR)  # refused, not re-run
    _assert_mlx_usable()


def test_steady_calls_schedule_and_blame_the_kernel_a_failure_names(
        cuda_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """After its first call a compiled graph schedules its outputs (``mx.async_eval``), right once
    evaluated; a failure raised while scheduling (injected here, carrying a generated kernel name
    as NVRTC's errors do) marks that kernel's node, and the graph is refused afterwards."""
    x, y = _xy()
    cf = gk.compile(lambda x, y: _launch(PLUS_ONE, [_launch(SCALE_ADD, [x, y]).outputs[0]]).outputs[0])
    want = np.array(x * 2 + y + 1)
    for _ in range(3):
        np.testing.assert_allclose(np.array(cf(x, y)), want, rtol=1e-6)
    g = cf.graph
    assert g is not None
    [plus_one] = [n for n in g.kernels() if g.node(n)["kernel"] == "fail_plus_one"]
    name = g.node(plus_one)["generated_name"]  # MLX's name for the launch, as NVRTC's log has it

    def failing(arrays: list[mx.array]) -> None:
        raise RuntimeError(f"[custom_kernel] Failed to compile kernel {name}: error: injected")

    monkeypatch.setattr(mx, "async_eval", failing)
    with pytest.raises(gk.GraphError) as info:
        cf(x, y)
    monkeypatch.undo()
    assert info.value.status == gk.Status.COMPILE_ERROR and info.value.node == plus_one
    assert cf.call_with_status(x, y) == (None, gk.Status.COMPILE_ERROR)  # refused, not re-run
    _assert_mlx_usable()


def test_nvrtc_error_eagerly(cuda_only: None) -> None:
    """Eagerly, MLX raises at evaluation; the message names graphkern's kernel and maps to
    COMPILE_ERROR."""
    x, _ = _xy()
    [out] = gk.apply(BROKEN_BODY, [x], [gk.OutputSpec(x.shape, x.dtype)], grid=(x.size, 1, 1),
                     threadgroup=(256, 1, 1))
    with pytest.raises(RuntimeError) as info:
        mx.eval(out)
    message = str(info.value)
    assert backends.generated_name(BROKEN_BODY) in message and "gk_not_declared_anywhere" in message
    assert mlx_kernels.status_of_mlx_error(message) == gk.Status.COMPILE_ERROR
    _assert_mlx_usable()


BAD_LAUNCHES = [
    dict(threadgroup=(0, 1, 1)),
    dict(threadgroup=(256, 0, 1)),
    dict(threadgroup=(256, 1, 0)),
    dict(grid=(0, 1, 1)),
    dict(threadgroup=(-32, 1, 1)),
    dict(threadgroup=(2048, 1, 1)),
    dict(grid=(4096, 1, 1), threadgroup=(1, 1, 128)),
]


@pytest.mark.parametrize("bad_launch", BAD_LAUNCHES, ids=lambda d: repr(d).replace(" ", ""))
def test_bad_launch_never_reaches_mlx(monkeypatch: pytest.MonkeyPatch, bad_launch: dict[str, Any]) -> None:
    monkeypatch.setenv("GRAPHKERN_BACKEND", "cuda")
    reached: list[Any] = []
    real_get = mlx_kernels.kernel_cache.get

    def guarded_get(backend: str, kernel: gk.Kernel) -> Any:
        if kernel is LAUNCH_TARGET:
            reached.append(kernel.name)
        return real_get(backend, kernel)

    monkeypatch.setattr(mlx_kernels.kernel_cache, "get", guarded_get)
    x, y = _xy()
    spec = [gk.OutputSpec(x.shape, x.dtype)]
    kw = dict(dict(grid=(x.size, 1, 1), threadgroup=(256, 1, 1)), **bad_launch)
    with pytest.raises(gk.KernelError) as info:
        gk.apply(LAUNCH_TARGET, [x], spec, template=[("T", x.dtype)], **kw)
    assert info.value.status == gk.Status.INVALID_LAUNCH

    res = gk.apply_in_graph(LAUNCH_TARGET, [x], spec, template=[("T", x.dtype)], **kw)
    assert res.status == gk.Status.INVALID_LAUNCH and not res.ok
    assert [tuple(o.shape) for o in res.outputs] == [x.shape]  # placeholders of the spec

    if CUDA:  # tracing builds the other kernels' MLX objects, so only on a CUDA backend
        fn = _graph_with(LAUNCH_TARGET, **bad_launch)
        g = gk.trace(fn, x, y)
        assert g.status == gk.Status.INVALID_LAUNCH
        [root] = [f.node for f in g.failures()]
        assert all(g.node(n)["status"] == gk.Status.UPSTREAM_FAILED for n in nx.descendants(g.nx, root))
        cf = gk.compile(fn)
        assert cf.call_with_status(x, y) == (None, gk.Status.INVALID_LAUNCH)
    assert reached == []
    monkeypatch.undo()
    if CUDA:
        _assert_mlx_usable()


def test_zero_threadgroup_never_reaches_mlx_kernel_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stronger than the status: with threadgroup 0 graphkern never even asks its cache for the
    MLX kernel object, so nothing of MLX is called."""
    monkeypatch.setenv("GRAPHKERN_BACKEND", "cuda")
    touched: list[str] = []
    monkeypatch.setattr(mlx_kernels.kernel_cache, "get",
                        lambda backend, kernel: touched.append(kernel.name) or pytest.fail("reached"))
    x = mx.ones((64,))
    for call in (gk.apply, gk.apply_in_graph):
        try:
            call(LAUNCH_TARGET, [x], [gk.OutputSpec(x.shape, x.dtype)], grid=(64, 1, 1),
                 threadgroup=(0, 1, 1), template=[("T", x.dtype)])
        except gk.KernelError as exc:
            assert exc.status == gk.Status.INVALID_LAUNCH
    assert touched == []


def test_bare_mlx_with_zero_threadgroup_dies(cuda_only: None) -> None:
    """Why graphkern checks: the same launch handed to MLX directly kills the process (the CUDA
    backend divides by the threadgroup on the host). Run in a child process."""
    code = textwrap.dedent("""
        import mlx.core as mx
        k = mx.fast.cuda_kernel(name="tg0", input_names=["x"], output_names=["out"],
                                source="out[0] = x[0];")
        x = mx.ones((4,))
        out = k(inputs=[x], output_shapes=[(4,)], output_dtypes=[mx.float32],
                grid=(4, 1, 1), threadgroup=(0, 1, 1))
        mx.eval(out)
        print("MLX_RAN_IT", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    print(f"bare MLX, threadgroup 0: returncode {proc.returncode}; "
          f"stderr tail: {proc.stderr.strip()[-300:]!r}")
    assert proc.returncode != 0 and "MLX_RAN_IT" not in proc.stdout
