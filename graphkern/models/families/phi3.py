"""Phi-3 and 3.5: Llama's blocks with one fused ``qkv_proj`` (split after the product, through
``norm_projections`` when decoding) and one fused ``gate_up_proj`` (its halves through
``norm_swiglu``), and a decoder loop without input embeddings.
"""

from __future__ import annotations

from graphkern.models.layers import FUSED_QKV, KernelDecoderStack
from graphkern.models.patterns import Forward
from graphkern.models.rules import (
    MASK,
    MX,
    ROPE_AND_CACHE,
    SDPA,
    SDPA_OUTPUT,
    SWIGLU,
    Rule,
    build_attention,
    build_gate_up_mlp,
    knows_rope_and_norms,
    stack_rule,
)

__all__ = ["RULES"]

#: mlx-lm's Phi-3 attention: one fused ``qkv_proj`` split into queries, keys and values.
_FUSED_ATTENTION = Forward(
    "def __call__(self, x, mask=None, cache=None):\n"
    "    B, L, D = x.shape\n"
    "    qkv = self.qkv_proj(x)\n"
    "    query_pos = self.n_heads * self.head_dim\n"
    "    queries, keys, values = mx.split(qkv, [query_pos, query_pos + self.n_kv_heads * self.head_dim], "
    "axis=-1)\n"
    "    queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)\n"
    "    keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)\n"
    "    values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)\n"
    + ROPE_AND_CACHE + SDPA_OUTPUT, {**MX, **SDPA})
#: mlx-lm's Phi3Model: as Qwen3Model's, without input embeddings.
_PLAIN_STACK = Forward("def __call__(self, inputs, cache=None):\n"
                       "    h = self.embed_tokens(inputs)\n"
                       "    if cache is None:\n"
                       "        cache = [None] * len(self.layers)\n"
                       "    mask = create_attention_mask(h, cache[0])\n"
                       "    for layer, c in zip(self.layers, cache):\n"
                       "        h = layer(h, mask, c)\n"
                       "    return self.norm(h)\n", MASK)

RULES: list[Rule] = [
    stack_rule("decoder stack (Phi-3): each residual add fused into the next RMSNorm", KernelDecoderStack,
               _PLAIN_STACK),
    Rule("attention prologue (Phi-3): one qkv_proj split, RoPE of q and k, laid out", "rope_qk",
         build_attention("n_heads", "n_kv_heads", False, FUSED_QKV), forwards=(_FUSED_ATTENTION,),
         when=knows_rope_and_norms(False)),
    Rule("SwiGLU MLP with a fused gate_up_proj (Phi-3)", "swiglu", build_gate_up_mlp, forwards=(Forward(
        "def __call__(self, x):\n    x = self.gate_up_proj(x)\n    gate, x = mx.split(x, 2, axis=-1)\n"
        "    return self.down_proj(swiglu(gate, x))", {**MX, "swiglu": SWIGLU}),)),
]
