"""check_finite: a compiled graph or wrapped model names the node where a NaN/Inf started."""

from __future__ import annotations

import mlx.core as mx
import planted_bugs as pb
import pytest
from mlx_lm.models.cache import make_prompt_cache

import graphkern as gk
from graphkern.compiling import FiniteCheckedGraph


def _assert_names_the_planted_kernel(exc: gk.GraphError) -> None:
    assert exc.status == gk.Status.NON_FINITE and exc.node == "nan_sqrt"
    text = str(exc)
    assert "kernel 'nan_sqrt'" in text and pb.NAN_SCOPE in text and "NaN" in text
    assert exc.graph is not None and exc.graph.failures()[0].node == "nan_sqrt"
    assert exc.affected_outputs == ("output_0",)


def test_compile_with_check_finite_names_the_planted_kernel() -> None:
    cf = gk.compile(pb.nan_llama(), check_finite=True)
    assert isinstance(cf, FiniteCheckedGraph) and cf.check_finite
    for _ in range(2):  # the first call traces, the second is a steady call
        with pytest.raises(gk.GraphError) as info:
            cf(pb.TOKENS)
        _assert_names_the_planted_kernel(info.value)
    assert cf.call_with_status(pb.TOKENS) == (None, gk.Status.NON_FINITE)
    assert cf.graph.ok  # the trace itself found nothing: only values show the bug


def test_wrap_with_check_finite_names_the_planted_kernel() -> None:
    wrapped = gk.wrap(pb.nan_llama(), check_finite=True)
    with pytest.raises(gk.GraphError) as info:
        wrapped(pb.TOKENS)
    _assert_names_the_planted_kernel(info.value)
    assert wrapped.call_with_status(pb.TOKENS)[1] == gk.Status.NON_FINITE


def test_check_finite_is_off_by_default_and_changes_nothing_when_all_is_finite() -> None:
    model = pb.llama()
    plain, checked = gk.compile(model), gk.compile(model, check_finite=True)
    assert type(plain) is gk.CompiledGraph and not plain.check_finite
    for _ in range(3):
        assert mx.array_equal(plain(pb.TOKENS), checked(pb.TOKENS)).item()
    nan = gk.compile(pb.nan_llama())
    assert mx.isnan(nan(pb.TOKENS)).all().item()  # unchecked: NaNs are returned, as MLX does


def test_a_cache_is_left_as_it_was_and_a_poisoned_input_is_named() -> None:
    model = pb.llama()
    wrapped = gk.wrap(model, check_finite=True)
    cache = make_prompt_cache(model)
    wrapped(pb.TOKENS[:1], cache=cache)                 # prefill: compiled
    wrapped(mx.array([[1]]), cache=cache)               # first decode step: compiled
    wrapped(mx.array([[2]]), cache=cache)               # a new offset: eager
    assert wrapped.calls == {"compiled": 2, "eager": 1}
    offset = cache[0].offset
    keys = mx.array(cache[0].keys)
    model.model.embed_tokens.weight[5] = mx.full((64,), float("inf"))  # token 5's embedding
    for token in (5, 5):  # eager at a new offset, then the same offset again
        with pytest.raises(gk.GraphError) as info:
            wrapped(mx.array([[token]]), cache=cache)
        root = info.value.graph.node(info.value.node)
        assert info.value.node == "model.embed_tokens.weight" and root["kind"] == "input"
        assert "an input of the call" in str(info.value)
        assert cache[0].offset == offset and mx.array_equal(cache[0].keys, keys).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
def test_the_check_is_the_same_on_the_host_and_on_the_device(dtype: mx.Dtype) -> None:
    from graphkern.compiling.finite import _compiled_finite_flag, all_finite

    for value in (1.0, float("nan"), float("inf"), float("-inf"), 6e4):
        arrays = [mx.array([0.5, value]).astype(dtype), mx.array([1, 2])]
        expected = value in (1.0, 6e4)  # 6e4 fits in float16 (max 65504)
        assert all_finite(arrays) == bool(_compiled_finite_flag(arrays[0]).item()) == expected
    assert all_finite({"ints": mx.array([1, 2])}) and all_finite(mx.zeros((0,)))
