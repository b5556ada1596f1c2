"""Library kernels are declared once (graphkern.kernels.declaration) and keep one checked launch
per argument signature, in the library's one launch cache (graphkern.kernels.base.LAUNCHES)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import pytest

import graphkern as gk
import graphkern.kernels as gkk
from graphkern.debugging import kernel_checks
from graphkern.kernels import registry
from graphkern.kernels.base import LAUNCHES, Case, LibraryLaunches, Plan, signature_constant
from graphkern.kernels.declaration import LibraryKernel, declare, signature
from graphkern.kernels.ops.add_rms_norm import plan_add_rms_norm
from graphkern.kernels.ops.rms_norm import plan_rms_norm
from graphkern.launching import backends


def _rms(x: mx.array, w: mx.array | None, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, w, eps)


def _kept(op: LibraryKernel) -> list[tuple[object, ...]]:
    """The signatures ``op`` has in the launch cache."""
    return [key for key in LAUNCHES if key[0] is op]


def test_calls_of_one_signature_reuse_one_plan_with_their_own_values(opaque_gpu: list[str]) -> None:
    gk.clear_caches()
    builds = plan_rms_norm.plan_builds
    w = mx.random.normal((16,))
    for i in range(4):
        x = mx.random.normal((3, 16), key=mx.random.key(i))
        assert mx.allclose(gkk.rms_norm(x, w, 1e-5), _rms(x, w, 1e-5), atol=1e-6).item()
    assert plan_rms_norm.plan_builds == builds + 1  # planned (and checked) once, then looked up
    assert len(_kept(plan_rms_norm)) == 1
    # the replayed form is traced once; the later calls replay it on their own inputs
    assert opaque_gpu.count("gk_rms_norm") == 1
    # another eps, no weight, another shape, another dtype: four more signatures, each right
    x = mx.random.normal((3, 16))
    assert mx.allclose(gkk.rms_norm(x, w, 0.5), _rms(x, w, 0.5), atol=1e-6).item()
    assert mx.allclose(gkk.rms_norm(x, None, 1e-5), _rms(x, None, 1e-5), atol=1e-6).item()
    x5 = mx.random.normal((5, 16))
    assert mx.allclose(gkk.rms_norm(x5, w, 1e-5), _rms(x5, w, 1e-5), atol=1e-6).item()
    x16, w16 = x.astype(mx.float16), w.astype(mx.float16)
    assert mx.allclose(gkk.rms_norm(x16, w16, 1e-5), _rms(x16, w16, 1e-5), atol=1e-2).item()
    assert plan_rms_norm.plan_builds == builds + 5 and len(_kept(plan_rms_norm)) == 5
    for _ in range(3):  # each of them again: no plan built
        gkk.rms_norm(x, w, 0.5), gkk.rms_norm(x, None, 1e-5), gkk.rms_norm(x5, w, 1e-5)
    assert plan_rms_norm.plan_builds == builds + 5


def test_signatures_tell_apart_what_plans_tell_apart() -> None:
    x = mx.ones((2, 8))
    keys = [signature(values) for values in (
        (x, 1e-5), (x.astype(mx.float16), 1e-5), (mx.ones((3, 8)), 1e-5), (x, 0.0), (x, -0.0), (x, 1),
        (x, True), (x, None), (x, [x]), (x, (x,)), (x, [x, x]), (x, "a"))]
    assert len(set(keys)) == len(keys)
    assert signature((mx.zeros((2, 8)), 1e-5)) == signature((x, 1e-5))  # values are not part of it
    with pytest.raises(TypeError):
        signature((x, object()))


def test_the_same_array_twice_then_two_arrays(opaque_gpu: list[str]) -> None:
    a, b, w = mx.ones((2, 8)), mx.arange(16, dtype=mx.float32).reshape(2, 8), mx.ones((8,))
    h, _ = gkk.add_rms_norm(a, a, w)
    assert h.tolist() == (a + a).tolist()
    h, y = gkk.add_rms_norm(a, b, w)  # same signature: the second input is b now, not a again
    assert h.tolist() == (a + b).tolist()
    assert mx.allclose(y, _rms(a + b, w, 1e-5), atol=1e-6).item()
    h, _ = gkk.add_rms_norm(b, b, w)  # kept from (a, b): each input from its own argument
    assert h.tolist() == (b + b).tolist()
    assert len(_kept(plan_add_rms_norm)) >= 1


def test_a_bad_argument_is_refused_on_every_call_never_kept(opaque_gpu: list[str]) -> None:
    x = mx.ones((2, 8))
    gkk.rms_norm(x, mx.ones((8,)), 1e-5)  # a good signature, kept
    builds, kept = plan_rms_norm.plan_builds, len(_kept(plan_rms_norm))
    for _ in range(2):
        with pytest.raises(gk.KernelError, match="eps must be a finite number") as err:
            gkk.rms_norm(x, mx.ones((8,)), float("nan"))
        assert err.value.operation == "rms_norm" and err.value.status == gk.Status.INVALID_INPUT
        with pytest.raises(gk.KernelError, match=r"weight has shape \(4,\)"):
            gkk.rms_norm(x, mx.ones((4,)))
        with pytest.raises(gk.KernelError, match="x must be an mx.array, got list"):
            gkk.rms_norm([[1.0, 2.0]])  # type: ignore[arg-type]
        with pytest.raises(gk.KernelError, match="dtype int32"):
            gkk.rms_norm(mx.ones((2, 8), mx.int32))
    assert plan_rms_norm.plan_builds == builds + 8  # each bad call checked again
    assert len(_kept(plan_rms_norm)) == kept


def test_traces_and_backends_take_their_own_way(opaque_gpu: list[str]) -> None:
    norm = nn.RMSNorm(8)
    x = mx.random.normal((2, 8))
    gkk.rms_norm(x, norm.weight)  # an eager launch, kept
    graph = gk.trace(lambda v: gkk.rms_norm(v, norm.weight), x)
    assert [graph.node(k)["kernel"] for k in graph.kernels()] == ["gk_rms_norm"]  # a node, traced
    with backends.using_backend("reference"):  # another backend: its own launch
        assert mx.allclose(gkk.rms_norm(x, norm.weight), norm(x), atol=1e-6).item()
    assert {key[2] for key in _kept(plan_rms_norm)} >= {"cuda", "reference"}


_TWICE = gk.Kernel("gk_twice_for_a_test", ["x", "t"], ["out"], reference=lambda x, t: [x * 2 + t])


@pytest.fixture
def declared() -> Iterator[LibraryKernel]:
    """A tiny kernel declared here, as a module of graphkern.kernels.ops declares one; removed after."""
    made = []

    def table(dtype: mx.Dtype) -> mx.array:
        made.append(signature_constant(mx.zeros((1,), dtype)))
        return made[-1]

    def inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array) -> Case:
        return Case((mx.random.normal(tuple(shape), key=key).astype(dtype),))

    @declare(_TWICE, stock=lambda x, bias=False: x * 2, shapes=((4, 8), (3,)), description="x * 2 (a test)",
             make_inputs=inputs)
    def plan_twice(x: mx.array, bias: bool = False) -> Plan:
        if not isinstance(x, mx.array):
            raise gk.KernelError("twice", f"x must be an mx.array, got {type(x).__name__}",
                                 gk.Status.INVALID_INPUT)
        constant = made[0] if made and made[0].dtype == x.dtype else table(x.dtype)
        spec = gk.OutputSpec(x.shape, x.dtype)
        return Plan(_TWICE, (x, constant), (spec,), (max(x.size, 1), 1, 1), (1, 1, 1))

    @plan_twice.layer
    def twice_for_a_test(x: mx.array, bias: bool = False) -> mx.array:
        return plan_twice.launch(x, bias)[0]

    try:
        yield plan_twice
    finally:
        registry.forget("twice_for_a_test")


def test_adding_a_kernel_is_one_declaration(declared: LibraryKernel) -> None:
    entry = gkk.LIBRARY["twice_for_a_test"]
    assert entry.kernel is _TWICE and entry.plan is declared and entry.fn is gkk.twice_for_a_test
    assert gkk.TWICE_FOR_A_TEST is _TWICE  # exported with the layer function
    x = mx.arange(6, dtype=mx.float32)
    assert gkk.twice_for_a_test(x).tolist() == (x * 2).tolist()
    assert gkk.twice_for_a_test(x + 1).tolist() == ((x + 1) * 2).tolist()
    assert declared.plan_builds == 1 and len(_kept(declared)) == 1  # its key derived, its plan kept
    size = gk.cache_stats()["layer launches"]["size"]
    gkk.twice_for_a_test(x, True)
    assert gk.cache_stats()["layer launches"]["size"] == size + 1 and declared.plan_builds == 2
    gk.clear_caches()
    assert gk.cache_stats()["layer launches"]["size"] == 0 and not _kept(declared)
    assert gkk.twice_for_a_test(x).tolist() == (x * 2).tolist() and declared.plan_builds == 3
    assert kernel_checks.check("twice_for_a_test").ok  # check() takes it like any library kernel
    with pytest.raises(gk.KernelError, match="is taken"):
        declared.variant("rms_norm")


def test_a_plan_input_made_from_the_call_is_never_taken_as_a_constant() -> None:
    kernel = gk.Kernel("gk_doubled_input_for_a_test", ["x"], ["out"], reference=lambda x: [x + 1])

    @declare(kernel, stock=lambda x: x * 2 + 1, shapes=((3,),), description="a test",
             make_inputs=lambda shape, dtype, key: Case((mx.ones(tuple(shape), dtype),)))
    def plan_doubled(x: mx.array) -> Plan:
        # the plan takes x * 2, which depends on x's values: it must be made anew every call
        return Plan(kernel, (x * 2,), (gk.OutputSpec(x.shape, x.dtype),), (x.size, 1, 1), (x.size, 1, 1))

    assert plan_doubled.launch(mx.ones((3,)))[0].tolist() == [3.0] * 3
    assert plan_doubled.launch(mx.zeros((3,)))[0].tolist() == [1.0] * 3
    assert plan_doubled.plan_builds == 2 and not _kept(plan_doubled)


def test_the_launch_cache_keeps_its_bound_and_the_signatures_in_use() -> None:
    cache = LibraryLaunches(maxsize=8, group=None)
    for i in range(8):
        cache.put(i, str(i))
    for i in range(8, 200):
        assert cache.get(0) == "0"  # used before every new signature: never the one to go
        cache.put(i, str(i))
        assert len(cache) <= 8
    assert 0 in cache and len(cache) == 8 and cache.stats()["hits"] == 192
    assert LAUNCHES.maxsize == LibraryLaunches.MAX_ENTRIES


def test_a_launch_takes_the_plan_arguments_by_position_or_keyword_and_decodes_as_one_signature() -> None:
    from graphkern.kernels.ops.rope import plan_rope

    x = mx.random.normal((1, 4, 1, 64), key=mx.random.key(0))
    gk.clear_caches()
    builds = plan_rope.plan_builds
    for offset in range(30, 40):  # an int offset travels as an array: one signature for them all
        stock = mx.fast.rope(x, 64, traditional=False, base=1e4, scale=1.0, offset=offset)
        assert mx.allclose(gkk.rope(x, 64, offset=offset), stock, atol=1e-5).item()
    assert plan_rope.plan_builds == builds + 1
    by_keyword = plan_rope.launch(x, 64, traditional=False, base=1e4, scale=1.0, offset=3, freqs=None,
                                  input_scale=1.0)[0]
    by_position = plan_rope.launch(x, 64, False, 1e4, 1.0, 3, None, 1.0)[0]
    assert mx.array_equal(by_keyword, by_position).item()
    with pytest.raises(TypeError, match="takes 8 arguments"):
        plan_rope.launch(x, 64, False, 1e4, 1.0, 3, None, 1.0, "one too many")
    with pytest.raises(gk.KernelError, match=r"offset must be in \[-2\*\*30, 2\*\*30\)"):
        gkk.rope(x, 64, offset=2**31)  # out of range: refused as before, never kept


def test_a_kept_signature_never_lets_a_bad_argument_past_its_checks() -> None:
    """Every argument is in the signature: after a good call, a residual of another shape or type
    is planned, and refused, as on a first call (the projections' own keys once held only whether
    a residual was given, so a (1,) array or a float passed unchecked)."""
    x, w, rows = mx.ones((1, 64)), mx.ones((64,)), mx.ones((8, 64))
    quantized = mx.quantize(rows, group_size=64, bits=4)
    calls = [lambda r: gkk.norm_projections(x, w, [rows], residual=r),
             lambda r: gkk.norm_swiglu(x, w, rows, rows, residual=r),
             lambda r: gkk.norm_geglu(x, w, rows, rows, residual=r, approx=True),
             lambda r: gkk.quantized_norm_projections(x, w, [quantized], residual=r),
             lambda r: gkk.quantized_norm_swiglu(x, w, quantized, quantized, residual=r),
             lambda r: gkk.quantized_norm_geglu(x, w, quantized, quantized, residual=r)]
    for call in calls:
        call(mx.ones((1, 64)))  # kept
        for bad, needle in ((mx.array([1.0]), r"residual is \(1,\) float32"),
                            (2.0, "residual must be an mx.array, got float")):
            with pytest.raises(gk.KernelError, match=needle):
                call(bad)
