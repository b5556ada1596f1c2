import mlx.core as mx
import pytest

import graphkern as gk
from graphkern.nodes import dtype_from_name, dtype_name


def make(**overrides):
    args = dict(name="k", input_names=["x"], output_names=["out"], reference=lambda x: [x])
    args.update(overrides)
    return gk.Kernel(**args)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"input_names": []}, "at least one input and one output"),
        ({"output_names": []}, "at least one input and one output"),
        ({"input_names": ["x", "x"]}, "repeated: ['x']"),
        ({"input_names": ["x"], "output_names": ["x"]}, "repeated: ['x']"),
        ({"input_names": ["1x"]}, "not a valid identifier"),
        ({"input_names": ["a b"]}, "not a valid identifier"),
        ({"input_names": ["for"]}, "not a valid identifier"),
        ({"name": "bad\x00name"}, "NUL"),
        ({"name": ""}, "not a valid identifier"),
        ({"metal": "out[0] = 1;\x00"}, "metal source contains an interior NUL byte"),
        ({"cuda": "\x00"}, "cuda source contains an interior NUL byte"),
        ({"header": "\x00"}, "header contains an interior NUL byte"),
        ({"input_names": "x"}, "must be a list of strings"),
        ({"reference": 3}, "reference must be callable"),
        ({"shared_memory": -1}, "shared_memory must be >= 0"),
        ({"metal": 5}, "metal source must be a string"),
    ],
)
def test_invalid_kernels_name_the_operation_and_problem(overrides, fragment):
    with pytest.raises(gk.KernelError) as info:
        make(**overrides)
    assert info.value.operation == "create a graphkern kernel"
    assert fragment in info.value.description
    assert info.value.status == gk.Status.INVALID_KERNEL


def test_valid_kernel_reports_its_backends_and_hash_changes_with_source():
    a = make(metal="out[0] = x[0];")
    b = make(metal="out[0] = x[0] + 1;")
    assert a.has_source("metal") and not a.has_source("cuda") and a.has_source("reference")
    assert a.source_hash != b.source_hash
    assert a.source_hash == make(metal="out[0] = x[0];").source_hash
    assert "metal" in repr(a)


def test_template_args_know_their_kind():
    assert gk.TemplateArg.dtype("T", mx.float16).kind == "dtype"
    assert gk.TemplateArg.int("N", 3).kind == "int"
    assert gk.TemplateArg.bool("B", True).kind == "bool"
    assert gk.TemplateArg("X", 1.5).kind == "invalid"
    assert gk.TemplateArg.dtype("T", mx.float16).describe() == "T=float16"


def test_status_codes_are_documented_int_enum():
    assert gk.Status.OK == 0 and gk.Status.OK.ok
    assert len({int(s) for s in gk.Status}) == len(gk.Status)
    assert not gk.Status.UPSTREAM_FAILED.ok


def test_kernel_error_pickles_and_reads_like_the_seed():
    import pickle

    err = gk.KernelError("apply", "bad grid", gk.Status.INVALID_LAUNCH)
    back = pickle.loads(pickle.dumps(err))
    assert (back.operation, back.description, back.status) == ("apply", "bad grid", gk.Status.INVALID_LAUNCH)
    assert str(back) == "apply: bad grid"


def test_kernel_result_unwrap():
    ok = gk.KernelResult([mx.ones(2)])
    assert ok.ok and ok.unwrap()[0].tolist() == [1, 1] and len(ok) == 1
    bad = gk.KernelResult([mx.zeros(2)], gk.Status.INVALID_INPUT,
                          gk.KernelError("apply", "wrong inputs", gk.Status.INVALID_INPUT))
    with pytest.raises(gk.KernelError, match="wrong inputs"):
        bad.unwrap()


def test_dtype_names_round_trip():
    for dt in (mx.float32, mx.float16, mx.bfloat16, mx.int32, mx.bool_, mx.uint8):
        assert dtype_from_name(dtype_name(dt)) == dt
