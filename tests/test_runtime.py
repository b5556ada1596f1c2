import dataclasses
import threading

import mlx.core as mx
import pytest
from kernels_fixture import SCALE_ADD, SPLIT, scale_add

import graphkern as gk
from graphkern.launching import backends, launch_paths, mlx_kernels, validation

X = mx.arange(8, dtype=mx.float32)
Y = mx.ones((8,))
SPEC = [gk.OutputSpec((8,), mx.float32)]


def launch(**overrides):
    args = dict(kernel=SCALE_ADD, inputs=[X, Y], output_specs=SPEC, grid=(8, 1, 1),
                threadgroup=(8, 1, 1), template=[("T", mx.float32)])
    args.update(overrides)
    kernel, inputs, specs = args.pop("kernel"), args.pop("inputs"), args.pop("output_specs")
    return kernel, inputs, specs, args


def assert_mlx_still_works():
    assert (mx.arange(3) * 2).tolist() == [0, 2, 4]
    out = gk.apply(*launch()[:3], **launch()[3])
    assert out[0].tolist() == (X * 2 + Y).tolist()


def test_apply_runs_the_reference_on_cpu():
    out = gk.apply(SCALE_ADD, [X, Y], SPEC, grid=(8, 1, 1), threadgroup=(8, 1, 1),
                   template=[gk.TemplateArg.dtype("T", mx.float32)])
    assert out[0].tolist() == (X * 2 + Y).tolist()


def test_two_outputs_and_template_tuples():
    x = mx.array([-1.0, 2.0, -3.0])
    pos, neg = gk.apply(SPLIT, [x], [(x.shape, x.dtype)] * 2, grid=(3, 1, 1), threadgroup=(3, 1, 1),
                        template=[("T", mx.float32)])
    assert pos.tolist() == [0, 2, 0] and neg.tolist() == [-1, 0, -3]


@pytest.mark.parametrize(
    "overrides, status, fragment",
    [
        ({"grid": (0, 1, 1)}, gk.Status.INVALID_LAUNCH, "grid entries must be positive"),
        ({"grid": (8, -1, 1)}, gk.Status.INVALID_LAUNCH, "grid entries must be positive"),
        ({"threadgroup": (0, 1, 1)}, gk.Status.INVALID_LAUNCH, "threadgroup entries must be positive"),
        ({"threadgroup": (1024, 2, 1)}, gk.Status.INVALID_LAUNCH, "the limit is 1024"),
        ({"grid": (2**31, 1, 1)}, gk.Status.INVALID_LAUNCH, "int32"),
        ({"grid": (8, 1)}, gk.Status.INVALID_LAUNCH, "tuple of 3 ints"),
        ({"grid": (8.0, 1, 1)}, gk.Status.INVALID_LAUNCH, "must be ints"),
        ({"grid": (True, 1, 1)}, gk.Status.INVALID_LAUNCH, "must be ints"),
        ({"output_specs": [gk.OutputSpec((-1,), mx.float32)]}, gk.Status.INVALID_OUTPUT_SPEC, "negative"),
        ({"output_specs": [gk.OutputSpec((8,), "float32")]}, gk.Status.INVALID_OUTPUT_SPEC, "mlx dtype"),
        ({"output_specs": []}, gk.Status.INVALID_OUTPUT_SPEC, "1 outputs"),
        ({"output_specs": [gk.OutputSpec((8.5,), mx.float32)]}, gk.Status.INVALID_OUTPUT_SPEC,
         "tuple of ints"),
        ({"inputs": [X]}, gk.Status.INVALID_INPUT, "takes 2 inputs"),
        ({"inputs": [X, "y"]}, gk.Status.INVALID_INPUT, "got str"),
        ({"inputs": X}, gk.Status.INVALID_INPUT, "must be a list"),
        ({"template": [("T", 1.5)]}, gk.Status.INVALID_TEMPLATE, "dtype, int or bool"),
        ({"template": [("T", mx.float32), ("T", 3)]}, gk.Status.INVALID_TEMPLATE, "repeated: ['T']"),
        ({"template": [("not valid", 3)]}, gk.Status.INVALID_TEMPLATE, "valid identifier"),
        ({"template": [("N", 2**40)]}, gk.Status.INVALID_TEMPLATE, "int32"),
        ({"template": ["T"]}, gk.Status.INVALID_TEMPLATE, "TemplateArg or (name, value)"),
        ({"init_value": "zero"}, gk.Status.INVALID_OUTPUT_SPEC, "init_value"),
        ({"kernel": "scale_add"}, gk.Status.INVALID_KERNEL, "expected a graphkern Kernel"),
    ],
)
def test_invalid_launches_raise_from_apply_and_become_status_in_graph(overrides, status, fragment):
    kernel, inputs, specs, kw = launch(**overrides)
    with pytest.raises(gk.KernelError) as info:
        gk.apply(kernel, inputs, specs, **kw)
    assert info.value.status == status
    assert fragment in info.value.description
    assert info.value.operation == "apply a graphkern kernel"
    assert_mlx_still_works()

    result = gk.apply_in_graph(kernel, inputs, specs, **kw)
    assert not result.ok and result.status == status and fragment in str(result.error)
    assert all(isinstance(o, mx.array) for o in result.outputs)
    with pytest.raises(gk.KernelError):
        result.unwrap()
    assert_mlx_still_works()


def test_placeholders_have_declared_specs():
    result = gk.apply_in_graph(SPLIT, [X], [gk.OutputSpec((2, 4), mx.float16)] * 2,
                               grid=(8, 1, 1), threadgroup=(0, 1, 1))
    assert [o.shape for o in result.outputs] == [(2, 4), (2, 4)]
    assert all(o.dtype == mx.float16 for o in result.outputs)


def test_scalar_inputs_are_accepted():
    k = gk.Kernel("axpy", ["a", "x"], ["out"], reference=lambda a, x: [a * x])
    out = gk.apply(k, [3.0, X], SPEC, grid=(8, 1, 1), threadgroup=(8, 1, 1))
    assert out[0].tolist() == (X * 3).tolist()


def test_reference_gets_template_values_it_asks_for():
    k = gk.Kernel("shift", ["x"], ["out"], reference=lambda x, *, N: [x + N])
    out = gk.apply(k, [X], SPEC, grid=(8, 1, 1), threadgroup=(8, 1, 1), template=[("N", 5)])
    assert out[0].tolist() == (X + 5).tolist()


@pytest.mark.parametrize(
    "reference, fragment",
    [
        (lambda x: 1 / 0, "ZeroDivisionError"),
        (lambda x: [x, x], "returned 2 outputs but 1 were declared"),
        (lambda x: [x[:2]], "has shape (2,) but (8,) was declared"),
        (lambda x: "nope", "must return a list of mlx arrays"),
    ],
)
def test_bad_references_give_reference_error(reference, fragment):
    k = gk.Kernel("bad_ref", ["x"], ["out"], reference=reference)
    result = gk.apply_in_graph(k, [X], SPEC, grid=(8, 1, 1), threadgroup=(8, 1, 1))
    assert result.status == gk.Status.REFERENCE_ERROR
    assert fragment in result.error.description
    assert result.error.operation == "run the reference of kernel 'bad_ref'"
    assert_mlx_still_works()


def test_reference_output_is_cast_to_the_declared_dtype():
    k = gk.Kernel("up", ["x"], ["out"], reference=lambda x: [x.astype(mx.float32)])
    x16 = X.astype(mx.float16)
    out = gk.apply(k, [x16], [gk.OutputSpec((8,), mx.float16)], grid=(8, 1, 1), threadgroup=(8, 1, 1))
    assert out[0].dtype == mx.float16


def test_kernel_without_any_backend_is_unavailable():
    k = gk.Kernel("nothing", ["x"], ["out"], cuda="out[0] = x[0];")
    result = gk.apply_in_graph(k, [X], SPEC, grid=(1, 1, 1), threadgroup=(1, 1, 1))
    assert result.status == gk.Status.BACKEND_UNAVAILABLE
    assert "no reference" in result.error.description


def test_backend_choice_and_override(monkeypatch):
    assert gk.active_backend() == "reference"  # this CPU machine
    monkeypatch.setenv("GRAPHKERN_BACKEND", "metal")
    assert gk.active_backend() == "metal"
    assert backends.resolve_backend(SCALE_ADD) == "metal"
    assert backends.resolve_backend(gk.Kernel("r", ["x"], ["o"], reference=lambda x: [x])) == "reference"
    monkeypatch.setenv("GRAPHKERN_BACKEND", "tpu")
    with pytest.raises(gk.KernelError, match="GRAPHKERN_BACKEND='tpu'"):
        gk.active_backend()


def test_metal_kernel_without_metal_runtime_fails_cleanly(monkeypatch):
    monkeypatch.setenv("GRAPHKERN_BACKEND", "metal")
    result = scale_add(X, Y)
    assert result.status == gk.Status.BACKEND_UNAVAILABLE
    assert "No Metal back-end" in result.error.description
    monkeypatch.delenv("GRAPHKERN_BACKEND")
    assert_mlx_still_works()


def test_cuda_limits_checked_before_mlx(monkeypatch):
    monkeypatch.setenv("GRAPHKERN_BACKEND", "cuda")
    result = gk.apply_in_graph(SCALE_ADD, [X, Y], SPEC, grid=(8, 1, 1), threadgroup=(1, 1, 128))
    assert result.status == gk.Status.INVALID_LAUNCH and "CUDA allows at most 64" in result.error.description
    result = gk.apply_in_graph(SCALE_ADD, [X, Y], SPEC, grid=(8, 70000, 1), threadgroup=(8, 1, 1))
    assert result.status == gk.Status.INVALID_LAUNCH and "65535" in result.error.description


def test_cache_builds_once_per_source_and_separates_same_name(monkeypatch):
    monkeypatch.setenv("GRAPHKERN_BACKEND", "metal")  # building metal_kernel objects works on Linux
    cache = mlx_kernels.KernelCache()
    a = gk.Kernel("same", ["x"], ["out"], metal="out[0] = x[0];")
    a_again = gk.Kernel("same", ["x"], ["out"], metal="out[0] = x[0];")
    b = gk.Kernel("same", ["x"], ["out"], metal="out[0] = x[0] + 1;")
    first = cache.get("metal", a)
    assert cache.get("metal", a_again) is first
    assert cache.get("metal", b) is not first
    assert cache.stats() == {"hits": 1, "misses": 2, "size": 2}
    assert backends.generated_name(a) != backends.generated_name(b)


def test_cache_is_thread_safe(monkeypatch):
    monkeypatch.setenv("GRAPHKERN_BACKEND", "metal")
    cache = mlx_kernels.KernelCache()
    kernels = [gk.Kernel(f"k{i}", ["x"], ["out"], metal=f"out[0] = x[0] + {i};") for i in range(4)]
    barrier = threading.Barrier(8)

    def work():
        barrier.wait()
        for _ in range(200):
            for k in kernels:
                cache.get("metal", k)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.stats() == {"hits": 8 * 200 * 4 - 4, "misses": 4, "size": 4}


def test_launch_raises_outside_a_trace_and_records_inside():
    with pytest.raises(gk.KernelError):
        gk.launch(SCALE_ADD, [X, Y], SPEC, grid=(8, 1, 1), threadgroup=(0, 1, 1))

    def fn(x, y):
        return gk.launch(SCALE_ADD, [x, y], SPEC, grid=(8, 1, 1), threadgroup=(0, 1, 1))[0] + 1

    g = gk.trace(fn, X, Y)
    assert g.status == gk.Status.INVALID_LAUNCH


def test_differentiable_launches_build_their_custom_function_once():
    k = gk.Kernel("tripled", ["x", "s"], ["out"], reference=lambda x, s: [x * 3 * s],
                  vjp=lambda primals, cots, outs: [cots[0] * 3 * primals[1], None])

    def run(x, s=1.0):
        return gk.apply(k, [x, s], SPEC, grid=(8, 1, 1), threadgroup=(8, 1, 1))[0]

    launch, _ = validation.validate(k, [X, 1.0], SPEC, (8, 1, 1), (8, 1, 1))
    assert run(X).tolist() == (X * 3).tolist() and run(X * 2).tolist() == (X * 6).tolist()
    assert len(launch_paths.thread_forms(launch)) == 1  # reused across calls with the same scalars
    assert mx.grad(lambda x: run(x, 2.0).sum())(X).tolist() == [6.0] * 8  # the user's vjp
    assert len(launch_paths.thread_forms(launch)) == 2  # a new scalar value gets its own


def test_scalar_inputs_and_template_names_are_checked_like_c_identifiers():
    k = gk.Kernel("axpy2", ["a", "x"], ["out"], reference=lambda a, x: [a * x])
    big = gk.apply_in_graph(k, [2**70, X], SPEC, grid=(8, 1, 1), threadgroup=(8, 1, 1))
    assert big.status == gk.Status.INVALID_INPUT and "does not fit in int64" in big.error.description
    for name in ("for", "ñ"):
        bad = gk.apply_in_graph(k, [2, X], SPEC, grid=(8, 1, 1), threadgroup=(8, 1, 1),
                                template=[(name, 1)])
        assert bad.status == gk.Status.INVALID_TEMPLATE
    assert_mlx_still_works()


def test_same_metal_source_with_different_cuda_sources_are_separate_mlx_kernels(monkeypatch):
    monkeypatch.setenv("GRAPHKERN_BACKEND", "metal")
    cache = mlx_kernels.KernelCache()
    a = gk.Kernel("twin", ["x"], ["out"], metal="out[0] = x[0];", cuda="out[0] = x[0];")
    b = gk.Kernel("twin", ["x"], ["out"], metal="out[0] = x[0];", cuda="out[0] = 2 * x[0];")
    assert cache.get("metal", a) is not cache.get("metal", b)  # each carries its own hashed name


def test_kernels_differing_only_in_shared_memory_get_their_own_mlx_names():
    # MLX's CUDA backend caches a custom kernel's module by name and source and allows more than
    # 48 KB of shared memory on its function only when the module is first loaded: a second kernel
    # with the same name and source but more shared memory would launch against the first limit.
    small = gk.Kernel("rows", ["x"], ["out"], cuda="out[0] = x[0];", shared_memory=16 * 1024)
    large = dataclasses.replace(small, shared_memory=64 * 1024)
    assert backends.mlx_kernel_name(small) != backends.mlx_kernel_name(large)
    assert mlx_kernels.KernelCache.key("cuda", small) != mlx_kernels.KernelCache.key("cuda", large)
