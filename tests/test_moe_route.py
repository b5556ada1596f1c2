"""The mixture-of-experts router kernel, ``moe_route``, and the sparse blocks patched onto it
(Mixtral's and Qwen 3 MoE's): the choice and weights by hand, its errors, and patched models
against stock in prompts, decoding and training."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
import inspect  # noqa: E402

from mlx_lm.models import qwen3_moe  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from model_comparisons import ATOL, NEEDS_STOCK_GRADIENTS, RTOL, assert_same_gradients, same_values  # noqa: E402

import graphkern.kernels as gkk  # noqa: E402
from graphkern.launching.backends import active_backend  # noqa: E402
from graphkern.models import patch, unpatch  # noqa: E402
from graphkern.models.layers import KernelSparseMoE, moe  # noqa: E402
from graphkern.models.tiny import TINY_CONFIGS, random_model  # noqa: E402
from graphkern.nodes import KernelError  # noqa: E402

QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
    "num_experts_per_tok": 3, "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "rms_norm_eps": 1e-5, "vocab_size": 128, "rope_theta": 1e6, "tie_word_embeddings": False,
    "max_position_embeddings": 512, "norm_topk_prob": True,
}
CONFIGS = {
    "mixtral": TINY_CONFIGS["mixtral"],
    "qwen3_moe": QWEN3_MOE,
    "qwen3_moe_unnormalized": {**QWEN3_MOE, "norm_topk_prob": False},
}
SHORT = mx.array([[3, 17, 42, 5, 99, 1, 7, 64], [8, 8, 120, 33, 2, 0, 71, 9]])
# 2 x 40 tokens choose 160 or more experts: mlx-lm's experts sort them (its other path)
LONG = mx.random.randint(0, 128, (2, 40), key=mx.random.key(5))


def test_mixtral_order_top_k_then_softmax_by_hand() -> None:
    gates = mx.array([[0.0, 2.0, 1.0, 2.0], [-1.0, 5.0, 5.0 + math.log(3.0), 0.0]])
    inds, scores = gkk.moe_route(gates, 2)
    assert inds.dtype == mx.uint32 and scores.dtype == mx.float32
    assert inds.tolist() == [[1, 3], [2, 1]]  # highest first; a tie goes to the lower index
    assert mx.allclose(scores, mx.array([[0.5, 0.5], [0.75, 0.25]])).item()


def test_qwen_order_softmax_then_top_k_and_normalized_by_hand() -> None:
    gates = mx.log(mx.array([[0.1, 0.4, 0.2, 0.3]]))
    inds, scores = gkk.moe_route(gates, 2, softmax_first=True)
    assert inds.tolist() == [[1, 3]] and mx.allclose(scores, mx.array([[0.4, 0.3]])).item()
    inds, scores = gkk.moe_route(gates, 2, softmax_first=True, normalize=True)
    assert inds.tolist() == [[1, 3]] and mx.allclose(scores, mx.array([[4 / 7, 3 / 7]])).item()


def test_equal_infinite_and_nan_logits_choose_deterministically() -> None:
    inds, scores = gkk.moe_route(mx.zeros((3, 8)), 3)
    assert inds.tolist() == [[0, 1, 2]] * 3 and mx.allclose(scores, mx.full((3, 3), 1 / 3)).item()
    inds, scores = gkk.moe_route(mx.array([[-math.inf, -math.inf, 0.0, -math.inf]]), 2)
    assert inds.tolist() == [[2, 0]] and scores.tolist() == [[1.0, 0.0]]
    inds, scores = gkk.moe_route(mx.array([[0.0, math.nan, 3.0, 1.0]]), 2)
    assert inds.tolist() == [[1, 2]] and mx.isnan(scores).all().item()  # a broken router shows


@pytest.mark.parametrize(("call", "needle"), [
    (lambda: gkk.moe_route(mx.zeros((2, 8)), 9), "k must be an int from 1 to 8"),
    (lambda: gkk.moe_route(mx.zeros((2, 8)), 0), "got 0"),
    (lambda: gkk.moe_route(mx.zeros((2, 8)), True), "got True"),
    (lambda: gkk.moe_route(mx.zeros((2, 64)), 33), "at most 32"),
    (lambda: gkk.moe_route(mx.zeros((2, 2048)), 2), "2048 experts"),
    (lambda: gkk.moe_route(mx.zeros((2, 8)), 2, normalize=True), "needs softmax_first=True"),
    (lambda: gkk.moe_route(mx.zeros((2, 8), dtype=mx.int32), 2), "int32"),
    (lambda: gkk.moe_route([[1.0, 2.0]], 1), "must be an mx.array"),
])
def test_bad_arguments_raise_naming_moe_route(call: Callable[[], Any], needle: str) -> None:
    with pytest.raises(KernelError, match=needle) as info:
        call()
    assert info.value.operation == "moe_route"


def _decode(model: nn.Module) -> list[mx.array]:
    cache = make_prompt_cache(model)
    return [model(SHORT, cache=cache)] + [model(SHORT[:, i:i + 1], cache=cache) for i in range(3)]


def _loss(model: nn.Module) -> mx.array:
    return nn.losses.cross_entropy(model(SHORT[:, :-1]), SHORT[:, 1:], reduction="mean")


def _sparse_blocks(model: nn.Module) -> list[nn.Module]:
    return [getattr(layer, "block_sparse_moe", None) or layer.mlp for layer in model.layers]


def _record_routes(monkeypatch: pytest.MonkeyPatch, sort: bool) -> list[bool]:
    """Sorted expert pairs on this backend when ``sort``; the list fills with each patched expert
    product's ``sorted_indices``."""
    monkeypatch.setattr(moe, "SORTED_EXPERTS_BACKENDS", frozenset({active_backend()} if sort else ()))
    routes: list[bool] = []
    products = moe._switch_glu
    monkeypatch.setattr(moe, "_switch_glu", lambda *a, **kw: routes.append(kw.get("sorted_indices", False))
                        or products(*a, **kw))
    return routes


@pytest.mark.parametrize("sort", [False, True], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_patched_sparse_blocks_equal_stock_in_prompts_and_decoding(
        name: str, sort: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both routes of a few tokens' expert products: pairs in token order, and sorted by expert
    (the CUDA route) and put back."""
    routes = _record_routes(monkeypatch, sort)
    model = random_model(CONFIGS[name])
    model.eval()
    stock = [model(SHORT), model(LONG), *_decode(model)]
    report = patch(model)
    assert sum(p.kernel == "moe_route" for p in report) == 2
    assert all(isinstance(block, KernelSparseMoE) for block in _sparse_blocks(model))
    for ours, theirs in zip([model(SHORT), model(LONG), *_decode(model)], stock):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert set(routes) == {sort}  # SHORT and each decoding step: 2 tokens or more, under 64 pairs
    unpatch(model)
    assert not any(isinstance(block, KernelSparseMoE) for block in _sparse_blocks(model))


#: Whether the installed mlx-lm's Qwen 3 MoE block is 0.32's: it stops the gradient at the chosen
#: experts (0.30 and 0.31's cannot be differentiated at all), casts the weighted sum to the
#: experts' dtype, and can be sharded. Earlier ones are patched too; these tests need 0.32's.
QWEN3_MOE_032 = "sharding_group" in inspect.getsource(qwen3_moe.Qwen3MoeSparseMoeBlock.__call__)
needs_qwen3_moe_032 = pytest.mark.skipif(not QWEN3_MOE_032, reason="mlx-lm before 0.32: its Qwen 3 MoE "
                                         "block has no stop_gradient, cast or sharding")


@NEEDS_STOCK_GRADIENTS
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_patched_sparse_blocks_train_as_stock(name: str) -> None:
    if name.startswith("qwen3_moe") and not QWEN3_MOE_032:
        pytest.skip("mlx-lm before 0.32: its stock Qwen 3 MoE block cannot be differentiated")
    model = random_model(CONFIGS[name])
    stock_gradients = nn.value_and_grad(model, _loss)(model)
    patch(model)
    assert_same_gradients(stock_gradients, nn.value_and_grad(model, _loss)(model),
                          loss_atol=1e-6, atol=ATOL, rtol=RTOL)


class _HalfExperts(nn.Module):
    """Experts whose outputs are bfloat16 under a float32 router (any module taking ``(x, inds)``)."""

    def __call__(self, x: mx.array, inds: mx.array) -> mx.array:
        return (x[..., None, :] * (inds[..., None] + 1).astype(x.dtype)).astype(mx.bfloat16)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_bfloat16_experts_under_a_float32_router_give_the_stock_dtype(name: str) -> None:
    """Qwen's forward casts the weighted sum to the experts' dtype; Mixtral's keeps the promoted one."""
    if name == "qwen3_moe" and not QWEN3_MOE_032:
        pytest.skip("mlx-lm before 0.32: its Qwen 3 MoE block does not cast")
    model = random_model(CONFIGS[name])
    for block in _sparse_blocks(model):
        block.switch_mlp = _HalfExperts()
    model.eval()
    x = mx.random.normal((1, 3, 64), key=mx.random.key(2))
    stock = [block(x) for block in _sparse_blocks(model)]
    patch(model)
    for block, theirs in zip(_sparse_blocks(model), stock):
        ours = block(x)
        assert ours.dtype == theirs.dtype == (mx.bfloat16 if name == "qwen3_moe" else mx.float32)
        assert mx.array_equal(ours, theirs).item()


@pytest.mark.parametrize("sort", [False, True], ids=["unsorted", "sorted"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_quantized_experts_take_the_same_routes_as_stock(name: str, bits: int, sort: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Affine-quantized experts (``QuantizedSwitchLinear``) go through the patched products, in
    token order and sorted by expert, and equal stock's ``gather_qmm`` products."""
    routes = _record_routes(monkeypatch, sort)
    model = random_model(CONFIGS[name])
    nn.quantize(model, group_size=32, bits=bits)
    model.eval()
    stock = [model(SHORT), *_decode(model)]
    patch(model)
    assert all(isinstance(block, KernelSparseMoE) for block in _sparse_blocks(model))
    for ours, theirs in zip([model(SHORT), *_decode(model)], stock):
        assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    assert set(routes) == {sort}


def test_experts_the_products_do_not_read_keep_their_stock_call() -> None:
    """Experts in another quantization mode keep ``SwitchGLU``'s own call."""
    model = random_model(CONFIGS["mixtral"])
    nn.quantize(model, group_size=32, bits=8, mode="mxfp8")
    model.eval()
    stock = _decode(model)
    patch(model)
    called: list[bool] = []
    products = moe._switch_glu
    moe._switch_glu = lambda *a, **kw: called.append(True) or products(*a, **kw)  # type: ignore[assignment]
    try:
        for ours, theirs in zip(_decode(model), stock):
            assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    finally:
        moe._switch_glu = products
    assert not called


@needs_qwen3_moe_032
def test_sharded_qwen_blocks_run_stock_and_too_many_chosen_experts_are_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_model(QWEN3_MOE)
    model.layers[0].mlp.sharding_group = object()  # its forward sums across devices: left stock
    patch(model)
    assert [isinstance(block, KernelSparseMoE) for block in _sparse_blocks(model)] == [False, True]
    model = random_model(QWEN3_MOE)  # sharded after patching: the stock forward, summing across ranks
    model.eval()
    stock = model(SHORT)
    patch(model)
    for block in _sparse_blocks(model):
        block.sharding_group = mx.distributed.init()  # one process: all_sum is the identity
    with monkeypatch.context() as m:
        m.setattr(gkk, "moe_route", None)  # the stock forward runs: no router kernel is called
        assert same_values(model(SHORT), stock)
    model = random_model({**QWEN3_MOE, "num_experts": 64, "num_experts_per_tok": 40})
    with pytest.raises(KernelError, match="top_k is 40; moe_route takes 1 to 32"):
        patch(model)


@NEEDS_STOCK_GRADIENTS
def test_training_through_the_gpu_launch_path_equals_stock(opaque_gpu: list[str]) -> None:
    """On a GPU the router is a kernel inside ``mx.custom_function``: its expert indices must not
    carry a gradient into ``gather_mm`` (which has none for indices)."""
    model = random_model(TINY_CONFIGS["mixtral"])
    stock_gradients = nn.value_and_grad(model, _loss)(model)
    patch(model)
    assert_same_gradients(stock_gradients, nn.value_and_grad(model, _loss)(model),
                          loss_atol=1e-6, atol=ATOL, rtol=RTOL)
    assert opaque_gpu.count("gk_moe_route") == 2


@NEEDS_STOCK_GRADIENTS
def test_a_layer_shared_with_an_evaluating_model_trains_in_a_training_one(opaque_gpu: list[str]) -> None:
    """mlx-lm's SwitchGLU modules share one default SwiGLU, so another model's ``eval()`` sets it to
    evaluation: patched into a training model, its kernel must still launch with gradients."""
    random_model(TINY_CONFIGS["mixtral"]).eval()
    model = random_model(TINY_CONFIGS["mixtral"])
    assert model.training and not model.layers[0].block_sparse_moe.switch_mlp.activation.training
    stock_gradients = nn.value_and_grad(model, _loss)(model)
    patch(model)
    assert all(block.switch_mlp.activation.training for block in _sparse_blocks(model))
    assert_same_gradients(stock_gradients, nn.value_and_grad(model, _loss)(model),
                          loss_atol=1e-6, atol=ATOL, rtol=RTOL)
