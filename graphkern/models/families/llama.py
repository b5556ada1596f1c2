"""Llama and the families that share its blocks (Mistral, Qwen 3, Mixtral and the many mlx-lm
models written alike): a pre-norm block, an attention with separate query, key and value
projections (Qwen 3's with per-head norms), and a decoder loop whose blocks the stack links.
"""

from __future__ import annotations

from graphkern.models.layers import LLAMA_BLOCK, KernelDecoderStack, KernelSlidingDecoderStack
from graphkern.models.patterns import Forward
from graphkern.models.rules import (
    MASK,
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

__all__ = ["EMBED", "RULES", "attention_forward", "block_forward"]


def block_forward(ffn: str) -> Forward:
    return Forward(
        "def __call__(self, x, mask=None, cache=None):\n"
        "    r = self.self_attn(self.input_layernorm(x), mask, cache)\n"
        "    h = x + r\n"
        f"    r = self.{ffn}(self.post_attention_layernorm(h))\n"
        "    out = h + r\n"
        "    return out\n")


def attention_forward(heads: str, kv_heads: str, norms: bool) -> Forward:
    """mlx-lm's Llama attention forward (``norms``: Qwen 3's, with q_norm and k_norm)."""
    if norms:
        prologue = (f"    queries = self.q_norm(queries.reshape(B, L, self.{heads}, -1))"
                    ".transpose(0, 2, 1, 3)\n"
                    f"    keys = self.k_norm(keys.reshape(B, L, self.{kv_heads}, -1))"
                    ".transpose(0, 2, 1, 3)\n")
    else:
        prologue = (f"    queries = queries.reshape(B, L, self.{heads}, -1).transpose(0, 2, 1, 3)\n"
                    f"    keys = keys.reshape(B, L, self.{kv_heads}, -1).transpose(0, 2, 1, 3)\n")
    return Forward(
        "def __call__(self, x, mask=None, cache=None):\n"
        "    B, L, D = x.shape\n"
        "    queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)\n"
        f"{prologue}"
        f"    values = values.reshape(B, L, self.{kv_heads}, -1).transpose(0, 2, 1, 3)\n"
        + ROPE_AND_CACHE + SDPA_OUTPUT, SDPA)



EMBED = ("def __call__(self, inputs, cache=None, input_embeddings=None):\n"
          "    if input_embeddings is not None:\n"
          "        h = input_embeddings\n"
          "    else:\n"
          "        h = self.embed_tokens(inputs)\n"
          "    if cache is None:\n"
          "        cache = [None] * len(self.layers)\n")
#: mlx-lm's Qwen3Model and MixtralModel (and the models sharing their forward).
_STACK = Forward(EMBED + "    mask = create_attention_mask(h, cache[0])\n"
                 "    for layer, c in zip(self.layers, cache):\n"
                 "        h = layer(h, mask, c)\n"
                 "    return self.norm(h)\n", MASK)
#: mlx-lm's LlamaModel: a full-attention mask, and a sliding-window one where its config gives
#: sliding-window layers.
_SLIDING_STACK = Forward(
    EMBED + "    fa_mask = create_attention_mask(h, cache[self.fa_idx])\n"
    "    if self.swa_idx is not None:\n"
    "        swa_mask = create_attention_mask(h, cache[self.swa_idx], window_size=self.sliding_window)\n"
    "    for layer, cache in zip(self.layers, cache):\n"
    "        mask = swa_mask if layer.use_sliding else fa_mask\n"
    "        h = layer(h, mask, cache=cache)\n"
    "    return self.norm(h)\n", MASK)



def attention_rule(name: str, heads: str, kv_heads: str, norms: bool) -> Rule:
    return Rule(name, "rope_qk", build_attention(heads, kv_heads, norms),
                forwards=(attention_forward(heads, kv_heads, norms),), when=knows_rope_and_norms(norms))


RULES: list[Rule] = [
    stack_rule("decoder stack (Qwen 3, Mixtral): each residual add fused into the next RMSNorm",
               KernelDecoderStack, _STACK),
    stack_rule("decoder stack (Llama): each residual add fused into the next RMSNorm",
               KernelSlidingDecoderStack, _SLIDING_STACK),
    *(Rule(f"pre-norm block (residual add + RMSNorm before {ffn})", "add_rms_norm",
           build_residual_block(LLAMA_BLOCK._replace(ffn=ffn)), forwards=(block_forward(ffn),),
           when=lambda m: rms_norm_offset(m.get("post_attention_layernorm")) is not None)
      for ffn in ("mlp", "block_sparse_moe")),
    attention_rule("attention prologue (Llama): RoPE of q and k, laid out", "n_heads", "n_kv_heads", False),
    attention_rule("attention prologue (Qwen 3): q/k RMSNorm and RoPE, laid out", "n_heads", "n_kv_heads",
                   True),
    attention_rule("attention prologue (Mixtral): RoPE of q and k, laid out", "num_heads",
                   "num_key_value_heads", False),
]
