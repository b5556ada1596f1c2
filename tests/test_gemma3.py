"""Gemma 3 (mlx-lm's ``gemma3_text``) on its fused blocks: sliding-window and global layers, each with
its RoPE and its mask, decode through compiled segments as stock does, past the window (its
``RotatingKVCache`` wrapping), and float16, where the stock block clips its residual adds, stays on
the stock adds."""

from __future__ import annotations

import warnings
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache  # noqa: E402
from model_comparisons import ATOL, RTOL, greedy_logits  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.models import MODEL_TOLERANCES  # noqa: E402
from graphkern.models.families.gemma3 import KernelClippedResidualBlock, KernelGemma3DecoderStack  # noqa: E402
from graphkern.models.layers import KernelAttention, KernelDecoderStack, KernelResidualBlock  # noqa: E402
from graphkern.models.prefill import PIPELINE_TOKENS  # noqa: E402
from graphkern.models.tiny import TINY_CONFIGS, tiny_model  # noqa: E402

#: Longer than the tiny config's window of 4: the sliding layer's mask and cache both cut.
PROMPT = mx.array([[3, 17, 42, 5, 99, 1, 7, 64]])
WINDOW = TINY_CONFIGS["gemma3"]["sliding_window"]


def _pair(dtype: mx.Dtype = mx.float32) -> tuple[nn.Module, nn.Module]:
    stock, patched = tiny_model("gemma3", dtype), tiny_model("gemma3", dtype)
    stock.eval()
    patched.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", gk.PatchWarning)  # every Gemma 3 layer a rule knows
        gk.patch(patched)
    return stock, patched


def _decode(model: nn.Module, prompt: mx.array = PROMPT, steps: int = 8,
            follow: list[mx.array] | None = None) -> list[mx.array]:
    return greedy_logits(model, steps, prompt, follow)


def _agree(patched: nn.Module, stock: nn.Module, dtype: mx.Dtype, prompt: mx.array = PROMPT,
           steps: int = 8) -> bool:
    """Whether the patched model's logits are within ``_close`` of stock's at each greedy step, both
    fed stock's tokens (in 16-bit a near tie may part their own choices)."""
    theirs = _decode(stock, prompt, steps)
    return _close(_decode(patched, prompt, steps, theirs), theirs, dtype)


def _close(ours: list[mx.array], theirs: list[mx.array], dtype: mx.Dtype) -> bool:
    atol, rtol = (ATOL, RTOL) if dtype == mx.float32 else MODEL_TOLERANCES[dtype]
    return all(mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=atol, rtol=rtol).item()
               for a, b in zip(ours, theirs))


def test_the_patch_report_names_the_gemma3_rules() -> None:
    model = tiny_model("gemma3")
    with warnings.catch_warnings():
        warnings.simplefilter("error", gk.PatchWarning)
        report = gk.patch(model)
    assert report.unmatched == []
    rules = {p.path: p.rule for p in report}
    assert rules["model"].startswith("decoder stack (Gemma 3)")
    for i in range(2):
        assert rules[f"model.layers.{i}"].startswith("pre-norm block with post-norms (Gemma 3)")
        assert rules[f"model.layers.{i}.self_attn"].startswith("attention prologue (Gemma 3)")
        assert rules[f"model.layers.{i}.mlp"] == "GeGLU MLP, tanh GELU (Gemma 2)"
    assert isinstance(model.model, KernelGemma3DecoderStack)
    assert all(isinstance(layer, KernelClippedResidualBlock) and layer.chains for layer in model.layers)
    # each kind of layer keeps its own RoPE: the local base, or the global base with its linear scaling
    sliding, full = (layer.self_attn.rope.rotary(1, 0) for layer in model.layers)
    assert (sliding.base, sliding.scale) == (1e4, 1.0) and (full.base, full.scale) == (1e6, 0.125)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_decoding_past_the_window_through_segments_equals_stock(dtype: mx.Dtype,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    stock, patched = _pair(dtype)
    masks: list[tuple[str, Any]] = []
    attend = KernelAttention.attend

    def spy(self: KernelAttention, queries: mx.array, keys: mx.array, values: mx.array, mask: Any,
            cache: Any) -> mx.array:
        masks.append((type(cache).__name__, mask if mask is None or isinstance(mask, str) else mask.shape))
        return attend(self, queries, keys, values, mask, cache)

    monkeypatch.setattr(KernelAttention, "attend", spy)
    assert _agree(patched, stock, dtype)
    # the prompt: the sliding layer's window mask, the global layer's causal one; then none
    assert masks[:4] == [("RotatingKVCache", (8, 8)), ("KVCache", "causal"), ("RotatingKVCache", None),
                         ("KVCache", None)]
    # one compiled call a block: the first block's enter, the link, the last block's leave
    first, last = patched.model.layers
    assert first.segments().traced() == ["enter"] and last.segments().traced() == ["leave"]
    assert patched.model.segments().traced() == [("link", 0)]
    cache = make_prompt_cache(patched)
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache]
    if dtype == mx.float32:
        tokens = [t for t, _ in generate_step(PROMPT[0], patched, max_tokens=12, prompt_cache=cache)]
        assert tokens == [t for t, _ in generate_step(PROMPT[0], stock, max_tokens=12)]
        assert cache[0].offset > WINDOW and cache[0].keys.shape[2] == WINDOW  # wrapped


def test_a_long_prompt_runs_the_pipelined_blocks_as_stock() -> None:
    """A prompt of PIPELINE_TOKENS runs the blocks with each one started as it is built."""
    stock, patched = _pair()
    prompt = (mx.arange(PIPELINE_TOKENS + 3) % 128).reshape(1, -1)
    assert _close(_decode(patched, prompt, 3), _decode(stock, prompt, 3), mx.float32)


def test_input_embeddings_are_scaled_as_stock_scales_them() -> None:
    stock, patched = _pair()
    embeddings = mx.random.normal((1, 5, 64), key=mx.random.key(0))
    ours = patched(PROMPT[:, :5], input_embeddings=mx.array(embeddings))  # both scale it in place
    assert mx.allclose(ours, stock(PROMPT[:, :5], input_embeddings=mx.array(embeddings)),
                       atol=ATOL, rtol=RTOL).item()


def test_a_float16_model_keeps_its_blocks_stock() -> None:
    """clip_residual adds float16 in float32 and clips: not the kernels' add, so those blocks stay."""
    stock, patched = _pair(mx.float16)
    assert isinstance(patched.model, KernelGemma3DecoderStack)
    assert not any(isinstance(layer, KernelResidualBlock) for layer in patched.model.layers)
    assert all(isinstance(layer.self_attn, KernelAttention) for layer in patched.model.layers)
    assert _close(_decode(patched, steps=3), _decode(stock, steps=3), mx.float16)


def _overflowing(model: nn.Module) -> nn.Module:
    """``model`` in float16, its first block's feed-forward post-norm scaled past float16's range."""
    model.set_dtype(mx.float16)
    norm = model.model.layers[0].post_feedforward_layernorm
    norm.weight = mx.full(norm.weight.shape, 3e4, mx.float16)
    return model


def test_fused_blocks_called_in_float16_take_the_stock_clipped_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model patched in float32 and cast to float16 after: its fused blocks and stack run the
    stock block's adds, which clip where plain float16 adds overflow."""
    stock, patched = _pair()
    stock, patched = _overflowing(stock), _overflowing(patched)
    assert isinstance(patched.model.layers[0], KernelClippedResidualBlock)
    expected = _decode(stock, steps=3)
    assert all(mx.isfinite(logits).all().item() for logits in expected)
    assert _close(_decode(patched, steps=3), expected, mx.float16)
    # the fused adds, allowed in float16, are not the stock ones there
    monkeypatch.setattr(KernelClippedResidualBlock, "forward", KernelResidualBlock.forward)
    monkeypatch.setattr(KernelGemma3DecoderStack, "_blocks", KernelDecoderStack._blocks)
    assert not all(mx.isfinite(logits).all().item() for logits in _decode(patched, steps=3))
