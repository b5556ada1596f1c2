"""Gemma 3 (mlx-lm's ``gemma3_text``, also the language model of ``gemma3``). Its blocks are laid out
as Gemma 2's (four norms of ``1 + weight``: after the attention and the feed-forward too; the tanh
GeGLU feed-forward Gemma 2's rule takes), with per-head ``q_norm``/``k_norm`` (``1 + weight``)
before the RoPE and no soft-capping. Its layers alternate sliding-window and global attention
(every ``sliding_window_pattern``-th is global), each kind with its own RoPE (the attention's own
``rope``: ``rope_local_base_freq`` for sliding layers, ``rope_theta`` and its scaling for global
ones) and its own mask; its embedding is scaled by ``sqrt(hidden_size)`` rounded to bfloat16.

Its blocks decode as Gemma 2's do, one compiled call a block: the residual add after the
attention's post-norm runs inside the feed-forward's norm, the one after the feed-forward's
post-norm inside the next block's input norm (``add_rms_norm``), the q/k norms inside the
RoPE kernel (``rope_qk``), and for a few rows the feed-forward's norm, gate and up products and tanh
GELU inside one ``norm_geglu`` launch (``quantized_norm_geglu`` for quantized weights). Its residual
adds are ``clip_residual``'s: a plain add, except in float16, where the sum is made in float32 and
clipped to float16's range. The kernels add in the dtype, so a block of float16 weights stays stock
(the block rule's condition), and a float16 call of a fused block or stack runs the stock block
(its adds), block by block.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern.models.families.gemma import GEMMA2_BLOCK
from graphkern.models.layers import KernelDecoderStack, KernelResidualBlock
from graphkern.models.patterns import Forward
from graphkern.models.rules import (
    MASK,
    MX,
    ROPE_AND_CACHE,
    SDPA,
    SDPA_OUTPUT,
    Rule,
    build_attention,
    build_residual_block,
    knows_rope_and_norms,
    rms_norm_offset,
    stack_rule,
)

__all__ = ["ATTENTION", "BLOCK", "MODEL", "RULES", "KernelClippedResidualBlock", "KernelGemma3DecoderStack"]

_CLIP = {"clip_residual": "mlx_lm.models.gemma3_text:clip_residual"}
#: The block's four norms, as Gemma 2's layout names them.
_NORMS = ("input_layernorm", GEMMA2_BLOCK.post_attention_norm, GEMMA2_BLOCK.pre_ffn_norm,
          GEMMA2_BLOCK.post_ffn_norm)

BLOCK = Forward(
    "def __call__(self, x, mask=None, cache=None):\n"
    "    r = self.self_attn(self.input_layernorm(x), mask, cache)\n"
    "    h = clip_residual(x, self.post_attention_layernorm(r))\n"
    "    r = self.mlp(self.pre_feedforward_layernorm(h))\n"
    "    out = clip_residual(h, self.post_feedforward_layernorm(r))\n"
    "    return out\n", _CLIP)

ATTENTION = Forward(
    "def __call__(self, x, mask=None, cache=None):\n"
    "    B, L, _ = x.shape\n"
    "    queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)\n"
    "    queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)\n"
    "    keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)\n"
    "    values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)\n"
    "    queries = self.q_norm(queries)\n"
    "    keys = self.k_norm(keys)\n"
    + ROPE_AND_CACHE + SDPA_OUTPUT, SDPA)

MODEL = Forward(
    "def __call__(self, inputs, cache=None, input_embeddings=None):\n"
    "    if input_embeddings is not None:\n"
    "        h = input_embeddings\n"
    "    else:\n"
    "        h = self.embed_tokens(inputs)\n"
    "    h *= mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)\n"
    "    if cache is None:\n"
    "        cache = [None] * len(self.layers)\n"
    "    global_mask = create_attention_mask(h, cache[self.sliding_window_pattern - 1])\n"
    "    if self.sliding_window_pattern > 1:\n"
    "        sliding_window_mask = create_attention_mask(h, cache[0], window_size=self.window_size)\n"
    "    else:\n"
    "        sliding_window_mask = None\n"
    "    for i, (layer, c) in enumerate(zip(self.layers, cache)):\n"
    "        is_global = i % self.sliding_window_pattern == self.sliding_window_pattern - 1\n"
    "        mask = global_mask if is_global else sliding_window_mask\n"
    "        h = layer(h, mask, c)\n"
    "    return self.norm(h)\n", {**MASK, **MX})


class KernelClippedResidualBlock(KernelResidualBlock):
    """Gemma 3's block: a :class:`KernelResidualBlock` of Gemma 2's layout whose float16 calls run
    the stock block, whose ``clip_residual`` adds in float32 and clips (the fused adds round in
    the dtype). A stack hands it no residual in float16 (:class:`KernelGemma3DecoderStack`)."""

    def forward(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        if x.dtype == mx.float16 and "residual" not in kwargs:
            return self.stock_call(x, *args, **kwargs)
        return super().forward(x, *args, **kwargs)


class KernelGemma3DecoderStack(KernelDecoderStack):
    """Gemma 3's ``Gemma3Model``: a :class:`KernelDecoderStack` whose embedding is scaled by
    ``sqrt(hidden_size)`` rounded to bfloat16, then to the embedding's dtype (as stock, in place),
    and whose blocks take the global mask (every ``sliding_window_pattern``-th block, by index, as
    the stock loop picks) or the sliding-window one. A float16 call runs its blocks one by one,
    each with its own residual adds (``clip_residual``'s)."""

    def _embed(self, inputs: mx.array, cache: Any, input_embeddings: mx.array | None) -> tuple[mx.array, Any]:
        h, cache = super()._embed(inputs, cache, input_embeddings)
        h *= mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        return h, cache

    def _masks(self, h: mx.array, cache: Any) -> Any:
        pattern = self.sliding_window_pattern
        global_mask = self._gk_create_mask(h, cache[pattern - 1])
        sliding = self._gk_create_mask(h, cache[0], window_size=self.window_size) if pattern > 1 else None
        is_global = {id(layer): i % pattern == pattern - 1 for i, layer in enumerate(self["layers"])}
        return lambda layer: global_mask if is_global[id(layer)] else sliding

    def _blocks(self, h: mx.array, cache: Any, mask_of: Any, pipelined: bool) -> mx.array:
        if h.dtype != mx.float16:
            return super()._blocks(h, cache, mask_of, pipelined)
        for layer, c in zip(self.layers, cache):  # clip_residual's float32 adds: the stock loop
            h = layer(h, mask_of(layer), c)
        return self.norm(h)  # type: ignore[no-any-return]


def _fusable_block(module: nn.Module) -> bool:
    """Gemma 3's block with norms a rule knows, none in float16 (where its adds clip)."""
    norms = [module.get(key) for key in _NORMS]
    if not all(rms_norm_offset(norm) is not None for norm in norms):
        return False
    weights = [getattr(norm, "weight", None) for norm in norms]
    return not any(isinstance(w, mx.array) and w.dtype == mx.float16 for w in weights)


RULES: list[Rule] = [
    stack_rule("decoder stack (Gemma 3): global and sliding-window masks by layer, each residual add "
               "fused into the next RMSNorm", KernelGemma3DecoderStack, MODEL),
    Rule("pre-norm block with post-norms (Gemma 3): residual adds fused into the next RMSNorm",
         "add_rms_norm", build_residual_block(GEMMA2_BLOCK, KernelClippedResidualBlock), forwards=(BLOCK,),
         when=_fusable_block),
    Rule("attention prologue (Gemma 3): q/k RMSNorm (1 + weight) and RoPE, laid out", "rope_qk",
         build_attention("n_heads", "n_kv_heads", True, norm_offset=1.0), forwards=(ATTENTION,),
         when=knows_rope_and_norms(True, norm_offset=1.0)),
]
