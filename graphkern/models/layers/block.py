"""The patched pre-norm transformer block: its residual adds fused into the norms after them, its
layout (:class:`BlockLayout`), and for a few decoding rows its norms and projections in one launch."""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from graphkern import kernels as gkk
from graphkern.kernels.ops.projections import projections_fit
from graphkern.kernels.ops.quantized_projections import quantized_projections_fit
from graphkern.kernels.ops.quantized_rope_projections import ROTATED_MAX_ROWS
from graphkern.models.layers.attention import SEPARATE_QKV, KernelAttention, merged_heads
from graphkern.models.layers.base import KernelLayer, run_segment
from graphkern.models.layers.feedforward import KernelGateUpMLP, KernelGeGLUMLP, KernelSwiGLUMLP
from graphkern.models.layers.norms import KernelAddRMSNorm, KernelRMSNorm
from graphkern.models.layers.rope import Rotary
from graphkern.models.layers.weights import (
    Quantized,
    every_bias,
    few_rows_product,
    halves,
    plain_weights,
    projection_biases,
    quantized_note,
    quantized_row_ranges,
    quantized_weights,
    rotated_projection_biases,
    row_ranges,
    with_biases,
)
from graphkern.models.routes import fused_rows
from graphkern.models.segments import Views, decoding


def _fuses(norm: nn.Module, residual: mx.array | None, x: mx.array, route: str,
           group_size: int | None = None) -> bool:
    """Whether ``norm`` (with the residual add before it) can run inside a projection kernel on x
    (a quantized one, for weights of ``group_size``) for a block on ``route``."""
    if not isinstance(norm, KernelAddRMSNorm if residual is not None else KernelRMSNorm):
        return False
    if not fused_rows(route, x.size // x.shape[-1], quantized=group_size is not None):
        return False
    if norm["weight"].dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return False
    return projections_fit(x) if group_size is None else quantized_projections_fit(x, group_size)


#: The residual a block is called without: a stock call, not a link of a fused chain.
_ALONE: Any = object()


class BlockLayout(NamedTuple):
    """Which children of a pre-norm block play which part, by mlx-lm's names: the feed-forward, the
    norm before it, and the norms some families put on the attention's and the feed-forward's
    outputs before their residual adds (Gemma 2's; None: no such norm)."""

    ffn: str = "mlp"
    pre_ffn_norm: str = "post_attention_layernorm"
    post_attention_norm: str | None = None
    post_ffn_norm: str | None = None


#: Llama's block layout (Mistral, Qwen 2/3, Phi-3 and most others share it).
LLAMA_BLOCK = BlockLayout()


class KernelResidualBlock(KernelLayer):
    """A pre-norm transformer block whose residual adds run fused with the RMSNorm after them.

    Replaces ``h = x + post1(attn(norm1(x))); out = h + post2(ffn(norm2(h)))`` (``post1`` and
    ``post2`` where the :class:`BlockLayout` names them, else nothing). ``norm2`` becomes a
    :class:`KernelAddRMSNorm` (in this block only; the original block keeps its norms) that gives
    ``(h, norm2(h))`` from one kernel, and so does ``norm1`` when ``input_norm`` is given. Called as
    the stock block, it returns ``out``. Called by a :class:`KernelDecoderStack` with
    ``residual=`` (the previous block's feed-forward output, not yet added; None for the first
    block), it adds that residual inside ``norm1``'s kernel and returns ``(h, post2(ffn(norm2(h))))``,
    leaving its own last add to the next norm.
    """

    kernel = "add_rms_norm"
    #: The kernels a block can also decode with, when ``patch`` selects them: the plain ones for
    #: ``nn.Linear`` projections, the quantized ones for ``nn.QuantizedLinear`` ones.
    DECODING_KERNELS = frozenset({"norm_projections", "norm_swiglu", "norm_geglu",
                                  "quantized_norm_projections", "quantized_norm_rope_projections",
                                  "quantized_norm_swiglu", "quantized_norm_geglu", "quantized_matvec"})

    def __init__(self, original: nn.Module, layout: BlockLayout, norm: KernelAddRMSNorm,
                 input_norm: KernelAddRMSNorm | None = None):
        super().__init__(original)
        object.__setattr__(self, "layout", layout)  # a tuple would go in the module's dict
        self._gk_ffn = layout.ffn
        self._gk_decoding = self.DECODING_KERNELS
        # segment name -> (the fused child, the row ranges its segment takes): segment_views
        object.__setattr__(self, "_gk_views", {})
        self[layout.pre_ffn_norm] = norm
        if input_norm is not None:
            self.input_layernorm = input_norm

    def _post_norm(self, name: str | None, x: mx.array) -> mx.array:
        """``x`` through the block's norm ``name`` (a layout's post-norm), or as it is for None."""
        return x if name is None else self[name](x)  # type: ignore[no-any-return]

    def select(self, kernels: frozenset[str]) -> None:
        self._gk_decoding = self.DECODING_KERNELS & kernels

    def segment_reads(self, name: str) -> tuple[tuple[str, ...], ...] | None:
        if name == "enter":
            attention = self["self_attn"]
            projections = None
            if isinstance(attention, KernelAttention):
                projections = attention.segment_reads("project")
            if projections is None:
                return ("input_layernorm",), ("self_attn",)
            return (("input_layernorm",), *(("self_attn", *path) for path in projections))
        if name == "leave":
            layout = self.layout
            norms = (layout.pre_ffn_norm, layout.post_attention_norm, layout.post_ffn_norm)
            return (("self_attn", "o_proj"), *((n,) for n in norms if n is not None), (self._gk_ffn,))
        return None

    def segment_views(self, name: str) -> Views:
        """The fused weights segment ``name`` takes in row ranges (``graphkern.models.segments``
        hands them in, made once): a quantized fused ``qkv_proj``'s query, key and value rows
        (the rotated prologue reads them apart) for ``"enter"``, a fused ``gate_up_proj``'s gate
        and up rows for ``"leave"``."""
        attention = self["self_attn"]
        if name == "enter":
            parent = ("self_attn", "qkv_proj")
            child = attention.get("qkv_proj") if isinstance(attention, KernelAttention) else None
        elif name == "leave":
            ffn = self[self._gk_ffn]
            parent = (self._gk_ffn, "gate_up_proj")
            child = ffn.get("gate_up_proj") if isinstance(ffn, KernelGateUpMLP) else None
        else:
            return ()
        known = self._gk_views.get(name)
        if known is not None and known[0] is child:
            return known[1]
        parts: tuple[str, ...] = ()
        if isinstance(child, nn.QuantizedLinear):
            parts = ("weight", "scales", "biases")
        elif isinstance(child, nn.Linear) and name == "leave":  # plain kernels take a whole qkv_proj
            parts = ("weight",)
        views: Views = ()
        if parts and child is not None:
            rows = child["weight"].shape[0]
            sizes = attention.qkv_sizes(rows) if name == "enter" else halves(rows)
            views = tuple(((*parent, part), sizes) for part in parts if part in child)
        self._gk_views[name] = (child, views)
        return views

    @property
    def chains(self) -> bool:
        """Whether this block can take a residual from the block before it (its input norm is fused)."""
        return isinstance(self.get("input_layernorm"), KernelAddRMSNorm)

    def forward(self, x: mx.array, mask: Any = None, cache: Any = None, residual: Any = _ALONE) -> Any:
        attention = self.self_attn
        decodes = isinstance(attention, KernelAttention) and decoding(x)
        position = attention.position(x, cache) if decodes else None
        if position is not None:  # decoding: the two segments, compiled unless a trace records them
            alone, segments = residual is _ALONE, self.segments()
            x, queries, keys, values = run_segment(segments, "enter", self.enter, x,
                                                   None if alone else residual, *position)
            attended = attention.attend(queries, keys, values, mask, cache)
            return run_segment(segments, "leave", self.leave, x, attended, alone)
        alone = residual is _ALONE
        x, normed = self._input_norm(x, None if alone else residual)
        return self._after_attention(x, self.self_attn(normed, mask, cache), alone)

    def _input_norm(self, x: mx.array, residual: mx.array | None) -> tuple[mx.array, mx.array]:
        """``(x + residual, norm(x + residual))``, or ``(x, norm(x))`` without a residual."""
        if residual is None:
            return x, self.input_layernorm(x)
        return self.input_layernorm(x, residual)  # type: ignore[no-any-return]

    def _after_attention(self, x: mx.array, r: mx.array, alone: bool) -> Any:
        """The attention's output ``r`` through its post-norm (if any), the residual add fused into
        the second norm, the feed-forward, and the block's last add when called ``alone`` (else left
        to the next norm)."""
        return self._feed_forward(x, self._post_norm(self.layout.post_attention_norm, r), alone)

    def _feed_forward(self, x: mx.array, r: mx.array, alone: bool) -> Any:
        """:meth:`_after_attention` from the residual ``r`` after the attention's post-norm."""
        layout = self.layout
        h, normed = self[layout.pre_ffn_norm](x, r)
        out = self._post_norm(layout.post_ffn_norm, self[self._gk_ffn](normed))
        return h + out if alone else (h, out)

    def enter(self, x: mx.array, residual: mx.array | None, offset: mx.array,
              rotary: Rotary) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The first segment, up to the cache update: the input norm (with the pending residual
        add) and the attention's projections: ``(x + residual, queries, keys, values)``. For a few
        rows, norm and plain projections are one ``norm_projections`` launch."""
        attention = self.self_attn
        norm = self.input_layernorm
        names = attention.projections
        biases = projection_biases(attention, names)
        outputs = None
        added = None  # the biases a kernel added
        if "norm_projections" in self._gk_decoding:
            weights = plain_weights(attention, names, x, biased=True)
            if weights is not None and _fuses(norm, residual, x, self._gk_call_route):
                added = every_bias(biases)
                outputs = gkk.norm_projections(x, norm.scale(), weights, norm.eps, residual, added)
        if outputs is None and "quantized_norm_projections" in self._gk_decoding:
            quantized = quantized_weights(attention, names, x, biased=True)
            if quantized is not None and _fuses(norm, residual, x, self._gk_call_route, quantized.group_size):
                rotated_biases = rotated_projection_biases(biases, len(quantized.weights))
                if ("quantized_norm_rope_projections" in self._gk_decoding and not attention._gk_norms
                        and rotated_biases is not False and x.size // x.shape[-1] <= ROTATED_MAX_ROWS):
                    return self._rotated_quantized(x, residual, quantized, offset, rotary, rotated_biases)
                outputs = gkk.quantized_norm_projections(
                    x, norm.scale(), quantized.weights, norm.eps, residual, group_size=quantized.group_size,
                    bits=quantized.bits)
        if outputs is not None:
            if residual is not None:
                x = outputs[0]
            products = list(outputs[-len(names):])
            if added is None:
                products = with_biases(products, biases)
            queries, keys, values = attention.split(products)
            return (x, *attention.rotate(queries, keys, values, offset, rotary))
        x, normed = self._input_norm(x, residual)
        return (x, *attention.project(normed, offset, rotary))

    def _rotated_quantized(self, x: mx.array, residual: mx.array | None, quantized: Quantized,
                           offset: mx.array, rotary: Rotary,
                           biases: list[mx.array] | None) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """:meth:`enter` in one ``quantized_norm_rope_projections`` launch: the input norm, the
        quantized query, key and value products (plus their ``biases``: Qwen 2's) and the RoPE (an
        attention without head norms). A fused ``qkv_proj`` goes in as its query, key and value row
        ranges."""
        norm = self.input_layernorm
        attention = self.self_attn
        heads, kv_heads = attention.head_counts()
        weights = quantized.weights
        if len(weights) == 1:
            weights = quantized_row_ranges(weights[0], attention.qkv_sizes(weights[0].weight.shape[0]))
        outputs = gkk.quantized_norm_rope_projections(
            x, norm.scale(), weights, heads, kv_heads, rotary.dims, norm.eps, residual,
            group_size=quantized.group_size, bits=quantized.bits, traditional=rotary.traditional,
            base=rotary.base, scale=rotary.scale, offset=offset, freqs=rotary.freqs,
            input_scale=rotary.input_scale, biases=biases)
        queries, keys, values = outputs[-3:]
        return (outputs[0] if residual is not None else x, queries, keys, attention.value_heads(values))

    def leave(self, x: mx.array, attended: mx.array, alone: bool) -> Any:
        """The second segment, after attention: ``o_proj`` (and the attention's post-norm, if any),
        the residual add fused into the norm, the feed-forward (and its post-norm); its own last add
        made here when called ``alone``, else left to the next. For a few rows, a gated
        feed-forward's norm, gate and up are one launch (:meth:`_gated_products`)."""
        layout = self.layout
        projected = self._product(self.self_attn, "o_proj", merged_heads(attended))
        r = self._post_norm(layout.post_attention_norm, projected)
        ffn = self[self._gk_ffn]
        found = self._gated_products(x, r, ffn)
        if found is None:
            return self._feed_forward(x, r, alone)
        h, gated = found
        out = self._post_norm(layout.post_ffn_norm, self._product(ffn, "down_proj", gated))
        return h + out if alone else (h, out)

    def _product(self, module: nn.Module, name: str, x: mx.array) -> mx.array:
        """``module``'s projection ``name`` of ``x``: one ``quantized_matvec`` launch where that
        kernel is selected and reads the projection's weights at this call's rows (an
        ``nn.QuantizedLinear`` without a bias, a few rows), else the projection's own call. Stock
        MLX's product of one row reads 4-bit weights more slowly than the library's kernels do."""
        if "quantized_matvec" in self._gk_decoding:
            quantized = quantized_weights(module, (name,), x)
            if quantized is not None:
                found = few_rows_product(self._gk_call_route, x, quantized.weights[0], quantized.group_size,
                                         quantized.bits)
                if found is not None:
                    return found
        return module[name](x)  # type: ignore[no-any-return]

    def _gated_products(self, x: mx.array, r: mx.array, ffn: nn.Module) -> tuple[mx.array, mx.array] | None:
        """``(x + r, act(gate(n)) * up(n))`` with ``n`` the feed-forward's norm of ``x + r``, from one
        launch: ``norm_swiglu`` for a SwiGLU feed-forward, ``norm_geglu`` for a GeGLU one (its GELU
        exact or tanh, as the layer's), or their quantized forms; None where no selected kernel
        takes this call (another feed-forward, other weights, too many rows)."""
        norm = self[self.layout.pre_ffn_norm]
        fused = isinstance(ffn, KernelGateUpMLP)
        options: dict[str, Any] = {}
        if fused or isinstance(ffn, KernelSwiGLUMLP):
            plain, quantized_kernel = "norm_swiglu", "quantized_norm_swiglu"
        elif isinstance(ffn, KernelGeGLUMLP):
            plain, quantized_kernel = "norm_geglu", "quantized_norm_geglu"
            options["approx"] = ffn._gk_approx
        else:
            return None
        names = ("gate_up_proj",) if fused else ("gate_proj", "up_proj")
        if plain in self._gk_decoding:
            weights = plain_weights(ffn, names, x)
            if weights is not None and _fuses(norm, r, x, self._gk_call_route):
                gate, up = row_ranges(weights[0], halves(weights[0].shape[0])) if fused else weights
                return getattr(gkk, plain)(x, norm.scale(), gate, up, norm.eps,  # type: ignore[no-any-return]
                                           residual=r, **options)
        if quantized_kernel in self._gk_decoding:
            quantized = quantized_weights(ffn, names, x)
            if fused and quantized is not None:
                fused_weight = quantized.weights[0]
                quantized = quantized._replace(
                    weights=quantized_row_ranges(fused_weight, halves(fused_weight.weight.shape[0])))
            if quantized is not None and _fuses(norm, r, x, self._gk_call_route, quantized.group_size):
                gate_q, up_q = quantized.weights
                return getattr(gkk, quantized_kernel)(  # type: ignore[no-any-return]
                    x, norm.scale(), gate_q, up_q, norm.eps, residual=r, group_size=quantized.group_size,
                    bits=quantized.bits, **options)
        return None

    def note(self) -> str:
        """What ``patch`` reports of this block: quantized projections whose quantization the
        fused decoding kernels do not read, which keep their stock products."""
        notes = [quantized_note(self.self_attn, getattr(self.self_attn, "projections", SEPARATE_QKV), True),
                 quantized_note(self[self._gk_ffn], ("gate_proj", "up_proj", "gate_up_proj"))]
        return "; ".join(n for n in notes if n)

    def failed_output(self, x: mx.array, mask: Any = None, cache: Any = None, residual: Any = _ALONE) -> Any:
        """What a trace puts in place of a failed call (graphkern.trace): zeros of its outputs."""
        return mx.zeros_like(x) if residual is _ALONE else (mx.zeros_like(x), mx.zeros_like(x))
