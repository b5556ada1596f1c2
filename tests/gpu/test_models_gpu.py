"""Patched mlx-lm models on the GPU: CUDA library kernels inside compiled forward passes.

Runs where ``mx.cuda.is_available()`` (the ``gpu`` marker skips elsewhere); with GRAPHKERN_GPU_DRYRUN=1
on a CPU machine the kernels run their references and the CUDA-only assertions are skipped. Needs
mlx-lm (``pip install 'graphkern[models]'``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from graphkern.models import MODEL_TOLERANCES, check_model, patch, unpatch, wrap  # noqa: E402
from graphkern.models.tiny import TINY_CONFIGS, tiny_model  # noqa: E402

pytestmark = pytest.mark.gpu

CUDA = mx.cuda.is_available()
TOKENS = mx.array([[3, 17, 42, 5, 99, 1, 7, 64, 12, 8, 2, 77], [8, 8, 120, 33, 2, 0, 71, 9, 1, 1, 4, 5]])


def _kernel_backends(graph) -> set[str]:
    return {graph.node(k)["backend"] for k in graph.kernels()}


def test_patched_tiny_llama_compiled_on_the_gpu_matches_the_stock_model() -> None:
    model = tiny_model("llama")
    report = check_model(model, TOKENS, dtypes=[mx.float32, mx.float16, mx.bfloat16])
    print(report)
    assert report.ok, str(report)
    if CUDA:
        assert report.backends == ["cuda"]
    stock = model(TOKENS)
    patch(model)
    wrapped = wrap(model)
    out = wrapped(TOKENS)
    atol, rtol = MODEL_TOLERANCES[mx.float32]
    assert mx.allclose(out, stock, atol=atol, rtol=rtol).item()
    assert len(wrapped.graph.kernels()) == 11
    if CUDA:
        assert _kernel_backends(wrapped.graph) == {"cuda"}
        assert all(wrapped.graph.node(k)["generated_name"] for k in wrapped.graph.kernels())


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_every_architecture_patched_and_compiled_on_the_gpu(arch: str) -> None:
    # Mixtral is checked in float32 only: its router picks the top-k experts, and in bfloat16 a
    # near-tie flips on a last-bit difference, so patched and stock logits legitimately differ by
    # whole experts (0.29 abs on the H200); MLX's CPU backend also lacks bfloat16 GatherMM.
    dtypes = [mx.float32] if arch == "mixtral" else [mx.float32, mx.bfloat16]
    report = check_model(tiny_model(arch), TOKENS, dtypes=dtypes)
    print(report)
    assert report.ok, str(report)


def test_kv_cache_decode_with_cuda_kernels() -> None:
    model = tiny_model("qwen3")
    patch(model)
    wrapped = wrap(model)
    eager_cache, graph_cache = make_prompt_cache(model), make_prompt_cache(model)
    prompt = TOKENS[:1]
    expected, got = model(prompt, cache=eager_cache), wrapped(prompt, cache=graph_cache)
    for _ in range(4):
        assert mx.allclose(expected, got, atol=1e-4, rtol=1e-4).item()
        token = mx.argmax(expected[:, -1:], axis=-1)
        expected, got = model(token, cache=eager_cache), wrapped(token, cache=graph_cache)
    assert graph_cache[0].offset == eager_cache[0].offset == prompt.shape[1] + 4
    assert wrapped.calls == {"compiled": 2, "eager": 3}  # prefill, first step; then eager launches
    if CUDA:
        assert _kernel_backends(wrapped.graph) == {"cuda"}


def test_value_and_grad_through_cuda_kernels_matches_the_stock_model() -> None:
    def loss(model: nn.Module) -> mx.array:
        return nn.losses.cross_entropy(model(TOKENS[:, :-1]), TOKENS[:, 1:], reduction="mean")

    model = tiny_model("llama")
    loss_stock, grads_stock = nn.value_and_grad(model, loss)(model)
    patch(model)
    loss_patched, grads_patched = nn.value_and_grad(model, loss)(model)
    unpatch(model)
    assert abs(loss_stock.item() - loss_patched.item()) < 1e-4
    stock, patched = dict(tree_flatten(grads_stock)), dict(tree_flatten(grads_patched))
    assert stock.keys() == patched.keys()
    for key in stock:
        assert mx.allclose(stock[key], patched[key], atol=1e-4, rtol=1e-3).item(), key
