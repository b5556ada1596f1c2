"""Gemma and Gemma 2. Gemma's blocks are Llama's (``families.llama`` takes them) with a GeGLU
feed-forward and norms of ``1 + weight``. Gemma 2's have four norms a block (after the attention
and the feed-forward too) and soft-capped attention scores. Both scale the embedding by the square
root of the hidden size, and their stacks are linked: each block's last residual add runs inside
the next block's input norm.

Its blocks decode as Llama's do, one compiled call a block: the residual add after the attention's
post-norm runs inside the feed-forward's norm, and the one after the feed-forward's post-norm inside
the next block's input norm (``add_rms_norm``); its norms' ``1 + weight`` is the kernels' scale. For a
few rows, that norm, the GeGLU's gate and up products and its GELU (exact for Gemma, tanh for Gemma
2) are one ``norm_geglu`` launch (``quantized_norm_geglu`` for quantized weights), between the
post-norms.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from graphkern.models.layers import BlockLayout, KernelAttention, KernelDecoderStack, KernelGeGLUMLP
from graphkern.models.patterns import Forward
from graphkern.models.rules import (
    ROPE_AND_CACHE,
    Rule,
    build_attention,
    build_gated_mlp,
    build_residual_block,
    knows_rope_and_norms,
    mlp_forward,
    rms_norm_offset,
    stack_rule,
)

__all__ = ["ATTENTION", "BLOCK", "GEMMA2_BLOCK", "GEMMA_MODEL", "MODEL", "RULES", "KernelGemma2DecoderStack",
           "KernelScaledDecoderStack", "KernelSoftcapAttention"]

_MX = {"mx": "mlx.core"}

#: Gemma 2's block: post-norms on the attention's and the feed-forward's outputs.
GEMMA2_BLOCK = BlockLayout(ffn="mlp", pre_ffn_norm="pre_feedforward_layernorm",
                           post_attention_norm="post_attention_layernorm",
                           post_ffn_norm="post_feedforward_layernorm")

BLOCK = Forward(
    "def __call__(self, x, mask=None, cache=None):\n"
    "    r = self.self_attn(self.input_layernorm(x), mask, cache)\n"
    "    h = x + self.post_attention_layernorm(r)\n"
    "    r = self.mlp(self.pre_feedforward_layernorm(h))\n"
    "    out = h + self.post_feedforward_layernorm(r)\n"
    "    return out\n")

ATTENTION = Forward(
    "def __call__(self, x, mask=None, cache=None):\n"
    "    B, L, D = x.shape\n"
    "    queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)\n"
    "    queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)\n"
    "    keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)\n"
    "    values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)\n"
    + ROPE_AND_CACHE
    + "    queries = queries * self.scale\n"
    "    if self.repeats > 1:\n"
    "        queries = queries.reshape(B, self.n_kv_heads, self.repeats, L, self.head_dim)\n"
    "        keys = mx.expand_dims(keys, 2)\n"
    "        values = mx.expand_dims(values, 2)\n"
    "    scores = queries @ keys.swapaxes(-1, -2)\n"
    "    scores = mx.tanh(scores / self.attn_logit_softcapping)\n"
    "    scores *= self.attn_logit_softcapping\n"
    "    if mask is not None:\n"
    "        if mask.dtype == mx.bool_:\n"
    "            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))\n"
    "        else:\n"
    "            scores = scores + mask\n"
    "    scores = mx.softmax(scores, precise=True, axis=-1)\n"
    "    output = scores @ values\n"
    "    if self.repeats > 1:\n"
    "        output = output.reshape(B, self.n_heads, L, self.head_dim)\n"
    "    output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)\n"
    "    return self.o_proj(output)\n", _MX)

def _scaled_model(mask_arguments: str) -> Forward:
    """``GemmaModel.__call__``: the embedding scaled by the square root of the hidden size, one mask
    made with ``mask_arguments``."""
    return Forward(
        "def __call__(self, inputs, cache=None):\n"
        "    h = self.embed_tokens(inputs)\n"
        "    h = h * (self.args.hidden_size**0.5)\n"
        "    if cache is None:\n"
        "        cache = [None] * len(self.layers)\n"
        f"    mask = create_attention_mask({mask_arguments})\n"
        "    for layer, c in zip(self.layers, cache):\n"
        "        h = layer(h, mask, c)\n"
        "    return self.norm(h)\n", {"create_attention_mask": "mlx_lm.models.base:create_attention_mask"})


#: Gemma's model; Gemma 2's, whose mask is an array.
GEMMA_MODEL = _scaled_model("h, cache[0]")
MODEL = _scaled_model("h, cache[0], return_array=True")


class KernelSoftcapAttention(KernelAttention):
    """Gemma 2's attention: its prologue on ``rope_qk`` as Llama's; its scores soft-capped,
    ``cap * tanh(scores / cap)``, before the mask and a float32 softmax, as the stock layer makes
    them (``attn_logit_softcapping`` read at each call)."""

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, mask: Any, cache: Any) -> mx.array:
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        B, heads, L, D = queries.shape
        kv_heads = keys.shape[1]
        repeats = heads // kv_heads
        queries = queries * self.scale
        if repeats > 1:
            queries = queries.reshape(B, kv_heads, repeats, L, D)
            keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
        cap = self.attn_logit_softcapping
        scores = mx.tanh((queries @ keys.swapaxes(-1, -2)) / cap) * cap
        if mask is not None:
            if mask.dtype == mx.bool_:
                scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
            else:
                scores = scores + mask
        output = mx.softmax(scores, precise=True, axis=-1) @ values
        return output.reshape(B, heads, L, D) if repeats > 1 else output


class KernelScaledDecoderStack(KernelDecoderStack):
    """Gemma's ``GemmaModel``: a :class:`KernelDecoderStack` whose embedding is scaled by
    ``sqrt(hidden_size)`` (in the embedding's dtype, as stock)."""

    def _embed(self, inputs: mx.array, cache: Any, input_embeddings: mx.array | None) -> tuple[mx.array, Any]:
        h, cache = super()._embed(inputs, cache, input_embeddings)
        return h * (self.args.hidden_size**0.5), cache


class KernelGemma2DecoderStack(KernelScaledDecoderStack):
    """Gemma 2's ``GemmaModel``: Gemma's, its masks arrays."""

    def _masks(self, h: mx.array, cache: Any) -> Any:
        mask = self._gk_create_mask(h, cache[0], return_array=True)
        return lambda layer: mask


RULES: list[Rule] = [
    stack_rule("decoder stack (Gemma 2): each residual add fused into the next RMSNorm",
               KernelGemma2DecoderStack, MODEL),
    stack_rule("decoder stack (Gemma): each residual add fused into the next RMSNorm",
               KernelScaledDecoderStack, GEMMA_MODEL),
    Rule("pre-norm block with post-norms (Gemma 2): residual adds fused into the next RMSNorm",
         "add_rms_norm", build_residual_block(GEMMA2_BLOCK), forwards=(BLOCK,),
         when=lambda m: rms_norm_offset(m.get("pre_feedforward_layernorm")) is not None),
    Rule("attention prologue (Gemma 2): RoPE of q and k, laid out; soft-capped scores", "rope_qk",
         build_attention("n_heads", "n_kv_heads", False, kind=KernelSoftcapAttention),
         forwards=(ATTENTION,), when=knows_rope_and_norms(False)),
    Rule("GeGLU MLP (Gemma)", "gelu", build_gated_mlp(KernelGeGLUMLP), forwards=(
        mlp_forward("nn.gelu(self.gate_proj(x)) * self.up_proj(x)"),)),
    Rule("GeGLU MLP, tanh GELU (Gemma 2)", "gelu", build_gated_mlp(lambda m: KernelGeGLUMLP(m, approx=True)),
         forwards=(mlp_forward("nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x)"),)),
]
