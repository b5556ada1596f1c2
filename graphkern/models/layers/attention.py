"""The patched attention: its prologue (projections, head norms, RoPE) on one ``rope_qk`` launch,
split into the segments a decoding block compiles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern import kernels as gkk
from graphkern.kernels.ops.rope import int_offset_array
from graphkern.models.layers.base import KernelLayer, run_segment
from graphkern.models.layers.rope import KernelRoPE, Rotary
from graphkern.models.segments import decoding

#: An attention's query, key and value projections: three children, or one fused child whose
#: output holds the queries, then the keys, then the values (Phi-3's ``qkv_proj``).
SEPARATE_QKV = ("q_proj", "k_proj", "v_proj")
FUSED_QKV = ("qkv_proj",)
#: What attention's output segment reads (``KernelLayer.segment_reads``).
_OUTPUT = (("o_proj",),)


def merged_heads(attended: mx.array) -> mx.array:
    """Attention's output ``(B, heads, L, D)`` with its heads side by side: ``(B, L, heads * D)``,
    what ``o_proj`` takes."""
    B, _, L, _ = attended.shape
    return attended.transpose(0, 2, 1, 3).reshape(B, L, -1)


class KernelAttention(KernelLayer):
    """mlx-lm's Llama-style attention (Llama, Mistral, Qwen 2/3, Mixtral...) with its prologue on one
    ``rope_qk`` kernel: queries and keys go from ``q_proj``/``k_proj`` straight to attention's
    ``(B, H, L, D)`` layout, normalized per head (Qwen 3's ``q_norm``/``k_norm``; Gemma 3's, whose
    scale is ``norm_offset + weight``) and rotated; the rest of the forward is the stock one.
    ``heads`` and ``kv_heads`` name the head-count attributes (``n_heads`` or ``num_heads``...),
    read at each call; ``rope`` (a :class:`KernelRoPE` in this
    layer only) says how the stock RoPE rotates; ``sdpa`` is the model file's
    ``scaled_dot_product_attention``; ``projections`` names the query, key and value children
    (:data:`SEPARATE_QKV`, or :data:`FUSED_QKV` for one product split in three).
    """

    kernel = "rope_qk"

    def __init__(self, original: nn.Module, heads: str, kv_heads: str, rope: KernelRoPE, norms: bool,
                 sdpa: Callable[..., mx.array], projections: tuple[str, ...] = SEPARATE_QKV,
                 norm_offset: float = 0.0):
        super().__init__(original)
        # tuples would go in the module's dict
        object.__setattr__(self, "_gk_heads", (heads, kv_heads))
        object.__setattr__(self, "projections", projections)
        self.rope = rope
        self._gk_norms = norms
        self._gk_norm_offset = norm_offset
        self._gk_sdpa = sdpa

    def position(self, x: mx.array, cache: Any, rotary: Rotary | None = None) -> tuple[Any, Rotary] | None:
        """(the offset, how to rotate) for a call on ``x`` with ``cache``, or None when the stock
        layer's RoPE runs it. An int offset comes as the int32 array the kernels take. ``rotary``:
        the rotation, where the caller knows it (``KernelRoPE.fixed_rotary``)."""
        offset = cache.offset if cache is not None else 0
        if rotary is None:
            rotary = self["rope"].rotary(x.shape[1], offset)  # an item: see KernelDecoderStack._linked_blocks
            if rotary is None:
                return None
        return (int_offset_array(offset) if offset.__class__ is int else offset), rotary

    def segment_reads(self, name: str) -> tuple[tuple[str, ...], ...] | None:
        if name == "project":
            norms = ("q_norm", "k_norm") if self._gk_norms else ()
            return tuple((child,) for child in (*self.projections, *norms))
        return _OUTPUT if name == "output" else None

    def project(self, x: mx.array, offset: Any, rotary: Rotary) -> tuple[mx.array, mx.array, mx.array]:
        """Queries and keys (normalized per head, rotated) and values, each ``(B, heads, L, D)``."""
        products = [self[name](x) for name in self.projections]
        return self.rotate(*self.split(products), offset, rotary)

    def split(self, products: list[mx.array]) -> tuple[mx.array, mx.array, mx.array]:
        """The projections' outputs as ``(queries, keys, values)``, each ``(B, L, features)``: a
        fused product is split where the heads say."""
        if len(products) == 3:
            return products[0], products[1], products[2]
        fused = products[0]
        q, k, _ = self.qkv_sizes(fused.shape[-1])
        queries, keys, values = mx.split(fused, [q, q + k], axis=-1)
        return queries, keys, values

    def qkv_sizes(self, features: int) -> tuple[int, int, int]:
        """How the ``features`` of a fused product (the rows of its weight) divide into queries,
        keys and values: ``heads`` and ``kv_heads`` heads of one size, then the values."""
        heads, kv_heads = self.head_counts()
        d = features // (heads + 2 * kv_heads)
        return heads * d, kv_heads * d, features - (heads + kv_heads) * d

    def rotate(self, queries: mx.array, keys: mx.array, values: mx.array, offset: Any,
               rotary: Rotary) -> tuple[mx.array, mx.array, mx.array]:
        """The projections ``(B, L, features)`` in attention's layout, queries and keys normalized
        per head and rotated (one ``rope_qk`` launch)."""
        heads, kv_heads = self.head_counts()
        q_weight = k_weight = None
        eps = 1e-5
        if self._gk_norms:
            q_weight, k_weight, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
            if self._gk_norm_offset:  # as the stock norm makes its scale, in the weight's dtype
                q_weight, k_weight = q_weight + self._gk_norm_offset, k_weight + self._gk_norm_offset
        queries, keys = gkk.rope_qk(queries, keys, heads, kv_heads, rotary.dims,
                                    traditional=rotary.traditional, base=rotary.base, scale=rotary.scale,
                                    offset=offset, freqs=rotary.freqs, input_scale=rotary.input_scale,
                                    q_weight=q_weight, k_weight=k_weight, eps=eps)
        return queries, keys, self.value_heads(values)

    def head_counts(self) -> tuple[int, int]:
        """(query heads, key and value heads), read at each call."""
        return getattr(self, self._gk_heads[0]), getattr(self, self._gk_heads[1])

    def value_heads(self, values: mx.array) -> mx.array:
        """The value projection ``(B, L, kv_heads * D)`` in attention's ``(B, kv_heads, L, D)`` layout."""
        B, L, _ = values.shape
        return values.reshape(B, L, self.head_counts()[1], -1).transpose(0, 2, 1, 3)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, mask: Any, cache: Any) -> mx.array:
        """The cache update and attention, as the stock layer makes them: ``(B, heads, L, D)``."""
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        return self._gk_sdpa(queries, keys, values, cache=cache, scale=self.scale, mask=mask)

    def output(self, attended: mx.array) -> mx.array:
        """``o_proj`` of the heads put back side by side: ``(B, L, hidden)``."""
        return self.o_proj(merged_heads(attended))  # type: ignore[no-any-return]

    def forward(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        position = self.position(x, cache)
        if position is None:  # the stock layer's RoPE runs this call: the stock forward, on our items
            return self.stock(x, mask, cache)
        if not decoding(x):
            return self.output(self.attend(*self.project(x, *position), mask, cache))
        segments = self.segments()  # decoding: compiled unless a trace records the launches
        queries, keys, values = run_segment(segments, "project", self.project, x, *position)
        return run_segment(segments, "output", self.output,  # type: ignore[no-any-return]
                           self.attend(queries, keys, values, mask, cache))
