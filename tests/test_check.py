"""gk.check on CPU: report contents, tolerances, failure detection and the no-GPU note; NaN and Inf
outputs fail gk.check and check_model, and gk.compare names them."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given
from hypothesis import strategies as st

import graphkern as gk
from graphkern.debugging.kernel_checks import TOLERANCES, CheckReport, check, strided
from graphkern.debugging.tolerance import within, worst_errors
from graphkern.kernels import LIBRARY, RMS_NORM, Case
from graphkern.launching.backends import active_backend
from graphkern.models import check_model
from graphkern.nodes import KernelError


def test_check_covers_dtypes_shapes_and_layouts() -> None:
    report = check("rms_norm", shapes=[(4, 64), (2, 3, 100)], seed=1)
    assert isinstance(report, CheckReport) and report.ok and bool(report)
    assert len(report.cases) == 2 * 3 * 2
    assert {c.dtype for c in report.cases} == {"float32", "float16", "bfloat16"}
    assert {c.layout for c in report.cases} == {"contiguous", "strided"}
    assert {c.shape for c in report.cases} == {(4, 64), (2, 3, 100)}
    for case in report.cases:
        assert (case.atol, case.rtol) == TOLERANCES[getattr(mx, case.dtype)]
        assert case.max_abs_err == 0.0 and case.max_rel_err == 0.0 and case.passed


def test_on_cpu_the_report_says_the_reference_ran() -> None:
    assert active_backend() == "reference"
    report = check("softmax", shapes=[(3, 10)], dtypes=[mx.float32])
    assert report.backends == ["reference"]
    text = str(report)
    assert "backend 'reference'" in text and "not GPU numerics" in text
    columns = ("kernel", "shape", "dtype", "backend", "max abs err", "max rel err", "tolerance", "passed")
    assert all(column in text for column in columns)


def test_check_by_kernel_object_kernel_name_or_everything() -> None:
    assert {c.kernel for c in check(RMS_NORM, shapes=[(2, 8)], dtypes=[mx.float32]).cases} == {"rms_norm"}
    by_kernel_name = check("gk_gelu", shapes=[(2, 8)], dtypes=[mx.float16], strided_inputs=False)
    assert [c.kernel for c in by_kernel_name.cases] == ["gelu", "gelu_approx"]
    everything = check(None, shapes=[(2, 16)], dtypes=[mx.bfloat16], strided_inputs=False)
    assert {c.kernel for c in everything.cases} == set(LIBRARY)
    assert {c.shape for c in everything.cases if c.kernel.startswith("rope")} == {(1, 2, 16)}  # padded to 3-D


def test_unknown_targets_and_dtypes_are_refused() -> None:
    with pytest.raises(KernelError, match="not in graphkern.kernels.LIBRARY"):
        check("no_such_kernel")
    with pytest.raises(KernelError, match="unsupported dtype"):
        check("rms_norm", dtypes=[mx.int32])
    with pytest.raises(TypeError):
        check(42)  # type: ignore[arg-type]


def test_a_wrong_kernel_fails_with_its_worst_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import graphkern.debugging.kernel_checks as check_module

    real_apply = check_module.apply_plan
    calls: list[str | None] = []

    def native_is_off_by_one_percent(plan, backend=None):  # type: ignore[no-untyped-def]
        calls.append(backend)  # each case runs the native backend first, then the reference
        outs = real_apply(plan, "reference")
        return outs if len(calls) % 2 == 0 else [o * 1.01 for o in outs]

    monkeypatch.setattr(check_module, "apply_plan", native_is_off_by_one_percent)
    report = check("rms_norm", shapes=[(4, 64)], dtypes=[mx.float32, mx.bfloat16], strided_inputs=False)
    assert not report.ok
    f32, bf16 = report.cases
    assert not f32.passed and 0.009 < f32.max_rel_err < 0.011 and f32.max_abs_err > 1e-3
    assert bf16.passed  # 1% is within bfloat16's tolerance
    assert report.failures == [f32] and "NO" in str(report)


def test_a_kernel_error_becomes_a_failed_case(monkeypatch: pytest.MonkeyPatch) -> None:
    import graphkern.debugging.kernel_checks as check_module

    def broken(plan, backend=None):  # type: ignore[no-untyped-def]
        raise KernelError("launch the cuda kernel 'gk_rms_norm'", "Failed to compile kernel: x.cu(3): error")

    monkeypatch.setattr(check_module, "apply_plan", broken)
    report = check("rms_norm", shapes=[(2, 8)], dtypes=[mx.float32], strided_inputs=False)
    assert not report.ok
    assert report.cases[0].error is not None and "Failed to compile" in report.cases[0].error


def test_one_tolerance_rule_for_check_check_model_compare_and_inspect() -> None:
    """[1, inf] against itself agrees (it failed the kernel checks' rule and passed inspect's);
    an Inf against -Inf or a number, and NaN against a number, are beyond; arguments by keyword."""
    same = mx.array([1.0, float("inf")])
    assert within(same, same, rtol=0.0, atol=0.0) and worst_errors([same], [same], rtol=0.0, atol=0.0)[2]
    for other in ([1.0, -float("inf")], [1.0, 3.0], [float("nan"), float("inf")]):
        assert not within(mx.array(other), same, rtol=1.0, atol=1.0)
    assert worst_errors([mx.zeros(2)], [mx.zeros(2)], rtol=0.0, atol=0.0) == (0.0, 0.0, True)  # no 0/0
    with pytest.raises(TypeError):
        within(same, same, 1e-3, 1e-5)  # type: ignore[misc]
    scale = mx.array([1.0, float("inf")])
    assert gk.compare(lambda x: x * scale, lambda x: x * scale, mx.ones(2)).ok  # gk.compare: the same rule


def test_compare_uses_allclose_semantics_and_matching_nans() -> None:
    ref = [mx.array([1.0, 100.0, 0.0, float("nan")])]
    assert worst_errors([mx.array([1.0, 100.05, 5e-6, float("nan")])], ref, rtol=1e-3, atol=1e-5)[2]
    assert not worst_errors([mx.array([1.0, 100.2, 0.0, float("nan")])], ref, rtol=1e-3, atol=1e-5)[2]
    assert not worst_errors([mx.array([1.0, 100.0, 0.0, 1.0])], ref, rtol=1e-3, atol=1e-5)[2]  # NaN lost
    assert not worst_errors([mx.zeros((2,))], [mx.zeros((3,))], rtol=1.0, atol=1.0)[2]


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), dtype=st.sampled_from(list(TOLERANCES)))
def test_strided_views_keep_values(shape: list[int], dtype: mx.Dtype) -> None:
    a = mx.random.normal(tuple(shape)).astype(dtype)
    s = strided(a)
    assert s.shape == a.shape and s.dtype == a.dtype and mx.array_equal(s, a).item()


@given(seed=st.integers(0, 2**20), n=st.integers(1, 64))
def test_check_is_deterministic_for_a_seed(seed: int, n: int) -> None:
    entry = LIBRARY["layer_norm"]
    a = entry.make_inputs((2, n), mx.float32, mx.random.key(seed))
    b = entry.make_inputs((2, n), mx.float32, mx.random.key(seed))
    assert all(mx.array_equal(x, y).item() for x, y in zip(a.args, b.args) if isinstance(x, mx.array))
    assert isinstance(a, Case)


# ----------------------------------------------------------------------------- NaN and Inf fail checks


def _nan_model() -> nn.Module:
    """A model whose every logit is NaN (a poisoned weight), stock and patched alike."""
    model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8))
    model.layers[0].weight = model.layers[0].weight * float("nan")
    return model


def test_check_model_fails_a_model_whose_logits_are_nan() -> None:
    """NaN logits equal NaN logits under the tolerance rule; a check of a model still fails them,
    naming which outputs hold how many non-finite values."""
    report = check_model(_nan_model(), mx.ones((2, 8)), dtypes=[mx.float32])
    assert not report.ok and len(report.failures) == 2
    for case in report.cases:
        assert case.error == ("non-finite values: stock output 0: 16 NaN and 0 Inf of 16 values; "
                              "patched output 0: 16 NaN and 0 Inf of 16 values")
        assert math.isnan(case.max_abs_err) and math.isnan(case.max_rel_err)
    text = str(report)
    assert "0/2 cases passed" in text and "0.00e+00" not in text and "stock output 0: 16 NaN" in text


def test_checked_errors_fail_any_non_finite_output_and_name_it() -> None:
    from graphkern.debugging.tolerance import checked_errors, non_finite

    finite = mx.ones((2, 3))
    assert checked_errors([finite], [finite], rtol=0.0, atol=0.0) == (0.0, 0.0, True, None)
    inf = mx.array([[1.0, float("inf"), 1.0], [1.0, 1.0, 1.0]])
    max_abs, _, passed, why = checked_errors([finite, inf], [finite, inf], rtol=1.0, atol=1.0,
                                             sides=("patched", "stock"))
    assert not passed and math.isnan(max_abs)
    assert why == ("non-finite values: stock output 1: 0 NaN and 1 Inf of 6 values; "
                   "patched output 1: 0 NaN and 1 Inf of 6 values")
    assert non_finite([mx.array([1, 2])], "stock") == []  # integers are always finite


def test_a_kernel_agreeing_with_its_reference_on_nan_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import graphkern.debugging.kernel_checks as check_module

    real_apply = check_module.apply_plan

    def both_nan(plan, backend=None):  # type: ignore[no-untyped-def]
        return [o * float("nan") for o in real_apply(plan, "reference")]

    monkeypatch.setattr(check_module, "apply_plan", both_nan)
    report = check("rms_norm", shapes=[(2, 8)], dtypes=[mx.float32], strided_inputs=False)
    [case] = report.cases
    assert not report.ok and not case.passed and math.isnan(case.max_abs_err)
    assert case.error == ("non-finite values: reference output 0: 16 NaN and 0 Inf of 16 values; "
                          "kernel output 0: 16 NaN and 0 Inf of 16 values")


def test_compare_names_outputs_that_are_nan_on_both_sides() -> None:
    """NaN in both is no divergence of b from a (``ok``), but the report names the outputs."""
    c = gk.compare(lambda x: mx.log(x - 5), lambda x: mx.log(x - 5) * 1.0, mx.ones((4,)))
    assert c.ok and c.first_divergence is None
    assert c.non_finite_outputs == ["a output_0: 4 NaN and 0 Inf", "b output_0: 4 NaN and 0 Inf"]
    assert "non-finite outputs: a output_0: 4 NaN and 0 Inf; b output_0: 4 NaN and 0 Inf" in str(c)
    assert c.to_dict()["non_finite_outputs"] == c.non_finite_outputs
    assert gk.compare(lambda x: x * 2, lambda x: x + x, mx.ones((4,))).non_finite_outputs == []
