"""``patch``: swap stock layers for kernel-backed ones; ``unpatch``: put the originals back.

Each :class:`Rule` recognises one kind of layer (by exact class, or by what its forward does: see
``patterns``), checks its parameters and builds the :class:`~graphkern.models.layers.KernelLayer`
that replaces it. ``patch`` checks every match before it changes anything: a layer whose parameters
the kernel cannot take (wrong rank, mismatched sizes or dtypes) raises ``KernelError`` and the
model is left as it was.

>>> import mlx.core as mx, mlx.nn as nn
>>> model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8), nn.GELU())
>>> [(p.path, p.kernel) for p in patch(model)]
[('layers.1', 'rms_norm'), ('layers.2', 'gelu')]
>>> unpatch(model)
['layers.1', 'layers.2']
>>> type(model.layers[1]).__name__
'RMSNorm'
"""

from __future__ import annotations

import contextvars
import functools
import math
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern.errors import ModelError, PatchWarning
from graphkern.kernels.base import FLOAT_DTYPES
from graphkern.kernels.ops.moe_route import MAX_EXPERTS, MAX_TOP_K
from graphkern.kernels.ops.rope_qk import MAX_HEAD_DIM
from graphkern.models.families import gemma
from graphkern.models.layers import (
    FUSED_QKV,
    LLAMA_BLOCK,
    SEPARATE_QKV,
    BlockLayout,
    KernelAddRMSNorm,
    KernelAttention,
    KernelDecoderStack,
    KernelDynamicRoPE,
    KernelFreqsRoPE,
    KernelGateUpMLP,
    KernelGeGLUMLP,
    KernelGELU,
    KernelLayer,
    KernelLayerNorm,
    KernelResidualBlock,
    KernelRMSNorm,
    KernelRoPE,
    KernelSlidingDecoderStack,
    KernelSoftmax,
    KernelSparseMoE,
    KernelSuScaledRoPE,
    KernelSwiGLU,
    KernelSwiGLUMLP,
    KernelYarnRoPE,
)
from graphkern.models.patterns import Forward, is_class, module_global
from graphkern.models.routes import check_route
from graphkern.nodes import KernelError, Status, dtype_name

__all__ = ["ROPE_RULES", "RULES", "PatchReport", "Patched", "Rule", "Unmatched", "kernel_names", "patch",
           "patched_layers", "set_route", "unpatch"]

PATCH = "patch a model with graphkern kernels"
_SWIGLU = "mlx_lm.models.activations:swiglu"
_BASE = "mlx_lm.models.base"
_ROPE_UTILS = "mlx_lm.models.rope_utils"


@dataclass(frozen=True)
class Rule:
    """How one kind of layer becomes kernel-backed.

    A module matches when its class is one of ``classes`` (exactly; a class or its
    ``"pkg.module:Name"``, looked up only for a class of that name) or its forward is one of
    ``forwards``, and ``when`` (if given) accepts it. ``build(module, path)`` checks the module's
    parameters (raising ``KernelError``) and returns the replacement.
    """

    name: str
    kernel: str
    build: Callable[[nn.Module, str], KernelLayer]
    classes: tuple[type | str, ...] = ()
    forwards: tuple[Forward, ...] = ()
    when: Callable[[nn.Module], bool] | None = None

    def matches(self, module: nn.Module) -> bool:
        return self.recognises(module) and (self.when is None or self.when(module))

    def recognises(self, module: nn.Module) -> bool:
        """Whether ``module``'s class or forward is this rule's (``when`` aside)."""
        cls = type(module)
        return any(cls is c if isinstance(c, type) else is_class(cls, c) for c in self.classes) or any(
            f.matches(cls) for f in self.forwards)


@dataclass(frozen=True)
class Patched:
    """One replaced layer: where, by which kernel and rule, and what it was; ``note`` says what of
    it stays stock (a block's projections quantized in a way the fused kernels do not read)."""

    path: str
    kernel: str
    rule: str
    original: str
    note: str = ""


@dataclass(frozen=True)
class Unmatched:
    """A layer that looks like one a kernel replaces (a norm, RoPE, MLP, attention or MoE block, by
    its class name) but that no selected rule matched: where, its class and why."""

    path: str
    original: str
    reason: str


class PatchReport(list[Patched]):
    """What ``patch`` did: the replaced layers (a list of :class:`Patched`) and, as ``unmatched``,
    the layers that look like targets but that no rule matched (:class:`Unmatched`)."""

    def __init__(self, patched: list[Patched], unmatched: list[Unmatched]) -> None:
        super().__init__(patched)
        self.unmatched = unmatched


# ----------------------------------------------------------------------------- parameter checks


def _refuse(path: str, description: str) -> KernelError:
    return ModelError(PATCH, f"{path or '<model>'}: {description}", Status.INVALID_INPUT)


def _float_dtype(dtype: mx.Dtype | None, what: str, path: str) -> None:
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise _refuse(path, f"{what} is {dtype_name(dtype)}; the kernels take float32, float16 "
                      "and bfloat16")


def _vector(module: nn.Module, key: str, path: str, size: int | None = None) -> mx.array:
    value = module.get(key) if isinstance(module, dict) else None
    if not isinstance(value, mx.array):
        raise _refuse(path, f"{key} must be an mx.array, got {type(value).__name__}")
    if value.ndim != 1 or (size is not None and value.shape[0] != size):
        expected = f"({size},)" if size is not None else "1-D"
        raise _refuse(path, f"{key} has shape {tuple(value.shape)}; expected {expected}")
    _float_dtype(value.dtype, key, path)
    return value


def _number(module: nn.Module, key: str, path: str, *, at_least: float | None = None,
            positive: bool = False) -> float:
    value = getattr(module, key, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            at_least is not None and value < at_least) or (positive and value <= 0):
        bound = " > 0" if positive else f" >= {at_least:g}" if at_least is not None else ""
        raise _refuse(path, f"{key} must be a finite number{bound}, got {value!r}")
    return float(value)


def _eps(module: nn.Module, path: str) -> None:
    _number(module, "eps", path, at_least=0)


def _child(module: nn.Module, key: str, path: str) -> nn.Module:
    child = module.get(key) if isinstance(module, dict) else None
    if not isinstance(child, nn.Module):
        raise _refuse(path, f"has no {key} layer")
    return child


def _linear(module: nn.Module, key: str, path: str) -> tuple[int, int, mx.Dtype | None]:
    """(input dims, output dims, output dtype) of a Linear or QuantizedLinear child; the dtype is
    None for a quantization whose scales are not floats (mxfp4...): its output takes its input's."""
    layer = _child(module, key, path)
    weight = layer.get("weight")
    if not isinstance(weight, mx.array) or weight.ndim != 2:
        raise _refuse(f"{path}.{key}", "expected a Linear layer with a 2-D weight")
    scales = layer.get("scales")
    if isinstance(scales, mx.array):  # quantized: packed weight, output in the scales' dtype
        bits = getattr(layer, "bits", 32)
        dtype = scales.dtype if mx.issubdtype(scales.dtype, mx.floating) else None
        return weight.shape[1] * 32 // bits, weight.shape[0], dtype
    return weight.shape[1], weight.shape[0], weight.dtype


def _same(path: str, what: str, a: tuple[str, Any], b: tuple[str, Any]) -> None:
    if a[1] != b[1] and a[1] is not None and b[1] is not None:  # None: not known from the weights
        show = (lambda v: dtype_name(v)) if isinstance(a[1], mx.Dtype) else repr
        raise _refuse(path, f"{what} mismatch: {a[0]} gives {show(a[1])} but {b[0]} gives {show(b[1])}")


# ----------------------------------------------------------------------------- builders


def _rms_norm(offset: float) -> Callable[[nn.Module, str], KernelLayer]:
    def build(module: nn.Module, path: str) -> KernelLayer:
        _vector(module, "weight", path)
        _eps(module, path)
        return KernelRMSNorm(module, offset)

    return build


def _layer_norm(module: nn.Module, path: str) -> KernelLayer:
    _eps(module, path)
    weight = _vector(module, "weight", path) if "weight" in module else None
    if "bias" in module:
        bias = _vector(module, "bias", path, weight.shape[0] if weight is not None else None)
        if weight is not None:
            _same(path, "dtype", ("weight", weight.dtype), ("bias", bias.dtype))
    return KernelLayerNorm(module)


def _rope(layer: type[KernelRoPE], dims_key: str = "dims", freqs: bool = False,
          numbers: tuple[str, ...] = ()) -> Callable[[nn.Module, str], KernelLayer]:
    """A RoPE layer (``layer`` stands in for it): even ``dims_key``, a ``_freqs`` table of dims / 2
    floats when ``freqs``, finite ``numbers`` (``base`` > 0 where it is one)."""

    def build(module: nn.Module, path: str) -> KernelLayer:
        dims = getattr(module, dims_key, None)
        if isinstance(dims, bool) or not isinstance(dims, int) or dims <= 0 or dims % 2:
            raise _refuse(path, f"RoPE {dims_key} must be a positive even int, got {dims!r}")
        if freqs:
            table = module.get("_freqs") if isinstance(module, dict) else None
            if not isinstance(table, mx.array) or table.shape != (dims // 2,):
                got = tuple(table.shape) if isinstance(table, mx.array) else type(table).__name__
                raise _refuse(path, f"RoPE frequencies (_freqs) must have shape ({dims // 2},), got {got}")
            if not mx.issubdtype(table.dtype, mx.floating):
                raise _refuse(path, f"RoPE frequencies (_freqs) are {dtype_name(table.dtype)}; "
                              "expected floats")
        for key in numbers:
            _number(module, key, path, positive=key in ("base", "mscale", "max_position_embeddings"))
        return layer(module)

    return build


def _rotary(module: nn.Module, path: str) -> KernelRoPE | None:
    """``module`` (an attention's RoPE) as a :class:`KernelRoPE`: itself when patched, else built by
    its rule (checked); None for a RoPE no rule knows."""
    if isinstance(module, KernelRoPE):
        return module
    rule = next((r for r in ROPE_RULES if r.matches(module)), None)
    if rule is None:
        return None
    return _one_per_module(module, KernelRoPE, lambda: rule.build(module, path))  # type: ignore[return-value]


def _head_dim(module: nn.Module, path: str, counts: list[int], heads: str, kv_heads: str,
              projections: tuple[str, ...]) -> tuple[int, mx.Dtype | None]:
    """(head dimension, output dtype) of an attention's query, key and value projections: three
    children, or one fused child giving ``heads + 2 * kv_heads`` heads' features."""
    if projections == FUSED_QKV:
        _, out, dtype = _linear(module, "qkv_proj", path)
        total = counts[0] + 2 * counts[1]
        if out % total:
            raise _refuse(path, f"qkv_proj gives {out} features, not a multiple of {heads} + 2 x {kv_heads}"
                          f" = {total} heads")
        _float_dtype(dtype, "qkv_proj's output", path)
        return out // total, dtype
    _, q_out, q_dtype = _linear(module, "q_proj", path)
    _, k_out, k_dtype = _linear(module, "k_proj", path)
    _linear(module, "v_proj", path)
    _same(path, "dtype", ("q_proj", q_dtype), ("k_proj", k_dtype))
    _float_dtype(q_dtype, "q_proj's output", path)
    if q_out % counts[0]:
        raise _refuse(path, f"q_proj gives {q_out} features, not a multiple of {heads}={counts[0]}")
    d = q_out // counts[0]
    _same(path, "key features", ("k_proj", k_out), (f"{kv_heads} x head dim", counts[1] * d))
    return d, q_dtype


def _attention(heads: str, kv_heads: str, norms: bool, projections: tuple[str, ...] = SEPARATE_QKV,
               kind: type[KernelAttention] = KernelAttention) -> Callable[[nn.Module, str], KernelLayer]:
    """An attention whose prologue (per-head norms, RoPE, layout) goes on ``rope_qk``, as a ``kind``."""

    def build(module: nn.Module, path: str) -> KernelLayer:
        counts = []
        for key in (heads, kv_heads):
            value = getattr(module, key, None)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise _refuse(path, f"{key} must be a positive int, got {value!r}")
            counts.append(value)
        d, q_dtype = _head_dim(module, path, counts, heads, kv_heads, projections)
        if d > MAX_HEAD_DIM:
            raise _refuse(path, f"head dimension {d} is over the rope_qk kernel's {MAX_HEAD_DIM}")
        rotary = _rotary(_child(module, "rope", path), f"{path}.rope")
        assert rotary is not None  # the rule's `when` checked it
        dims = getattr(rotary, "dims", getattr(rotary, "dim", 0))
        if dims > d:
            raise _refuse(f"{path}.rope", f"RoPE dims {dims} exceed the head dimension {d}")
        if norms:
            eps = []
            for key in ("q_norm", "k_norm"):
                norm = _child(module, key, path)
                weight = _vector(norm, "weight", f"{path}.{key}", d)
                _same(f"{path}.{key}", "dtype", ("weight", weight.dtype), ("q_proj", q_dtype))
                _eps(norm, f"{path}.{key}")
                eps.append(norm.eps)
            _same(path, "eps", ("q_norm", eps[0]), ("k_norm", eps[1]))
        sdpa = module_global(type(module), "scaled_dot_product_attention")
        return kind(module, heads, kv_heads, rotary, norms, sdpa, projections)

    return build


def _knows_rope_and_norms(norms: bool) -> Callable[[nn.Module], bool]:
    def when(module: nn.Module) -> bool:
        rope = module.get("rope") if isinstance(module, dict) else None
        if not isinstance(rope, nn.Module) or (
                not isinstance(rope, KernelRoPE) and not any(r.matches(rope) for r in ROPE_RULES)):
            return False
        return not norms or all(_rms_norm_offset(module.get(key)) == 0.0 for key in ("q_norm", "k_norm"))

    return when


def _gated(kind: Callable[[nn.Module], KernelLayer]) -> Callable[[nn.Module, str], KernelLayer]:
    """An MLP ``down(act(gate(x)) * up(x))``: gate and up agree, down takes their output."""

    def build(module: nn.Module, path: str) -> KernelLayer:
        _, gate_out, gate_dtype = _linear(module, "gate_proj", path)
        _, up_out, up_dtype = _linear(module, "up_proj", path)
        down_in, _, _ = _linear(module, "down_proj", path)
        _same(path, "output size", ("gate_proj", gate_out), ("up_proj", up_out))
        _same(path, "dtype", ("gate_proj", gate_dtype), ("up_proj", up_dtype))
        _same(path, "hidden size", ("gate_proj", gate_out), ("down_proj (input)", down_in))
        _float_dtype(gate_dtype, "gate_proj's output", path)
        return kind(module)

    return build


def _gate_up(module: nn.Module, path: str) -> KernelLayer:
    _, out, dtype = _linear(module, "gate_up_proj", path)
    down_in, _, _ = _linear(module, "down_proj", path)
    if out % 2:
        raise _refuse(path, f"gate_up_proj has {out} outputs; it must split into two halves")
    _same(path, "hidden size", ("gate_up_proj (half)", out // 2), ("down_proj (input)", down_in))
    _float_dtype(dtype, "gate_up_proj's output", path)
    return KernelGateUpMLP(module)


def _rms_norm_offset(norm: Any) -> float | None:
    """The weight offset of an RMSNorm a rule knows (0, or 1 for Gemma's; looked through an earlier
    patch), else None."""
    if isinstance(norm, KernelRMSNorm):
        return norm._gk_offset
    if not isinstance(norm, nn.Module):
        return None
    return next((offset for rule, offset in ((RMS_NORM, 0.0), (OFFSET_RMS_NORM, 1.0)) if rule.matches(norm)),
                None)


def _add_norm(block: nn.Module, key: str, path: str) -> KernelAddRMSNorm | None:
    """``block``'s RMSNorm ``key`` as a :class:`KernelAddRMSNorm` (checked), or None if no rule knows it."""
    norm = block.get(key) if isinstance(block, dict) else None
    offset = _rms_norm_offset(norm)
    if offset is None or not isinstance(norm, nn.Module):
        return None
    original = norm.original if isinstance(norm, KernelRMSNorm) else norm
    _vector(original, "weight", f"{path}.{key}")
    _eps(original, f"{path}.{key}")
    return _one_per_module(original, KernelAddRMSNorm,  # type: ignore[return-value]
                           lambda: KernelAddRMSNorm(original, offset))


def _residual_block(layout: BlockLayout) -> Callable[[nn.Module, str], KernelLayer]:
    def build(module: nn.Module, path: str) -> KernelLayer:
        norm = _add_norm(module, layout.pre_ffn_norm, path)
        assert norm is not None  # the rule's `when` checked it
        _child(module, layout.ffn, path)
        for post in (layout.post_attention_norm, layout.post_ffn_norm):
            if post is not None:
                _child(module, post, path)
        return KernelResidualBlock(module, layout, norm, _add_norm(module, "input_layernorm", path))

    return build


def _stack(kind: type[KernelDecoderStack]) -> Callable[[nn.Module, str], KernelLayer]:
    def build(module: nn.Module, path: str) -> KernelLayer:
        norm = _add_norm(module, "norm", path)
        assert norm is not None  # the rule's `when` checked it
        layers = module.get("layers") if isinstance(module, dict) else None
        if not isinstance(layers, list):
            raise _refuse(path, f"layers must be a list of blocks, got {type(layers).__name__}")
        return kind(module, norm, module_global(type(module), "create_attention_mask"))

    return build


def _sparse_moe(top_k: str, softmax_first: bool = False, normalize: str | None = None,
                cast: bool = False) -> Callable[[nn.Module, str], KernelLayer]:
    """A sparse mixture-of-experts block whose router the ``moe_route`` kernel can take."""

    def build(module: nn.Module, path: str) -> KernelLayer:
        _, experts, dtype = _linear(module, "gate", path)
        _float_dtype(dtype, "gate's output", path)
        k = getattr(module, top_k, None)
        if not 1 <= experts <= MAX_EXPERTS:
            raise _refuse(path, f"the router has {experts} experts; moe_route takes 1 to {MAX_EXPERTS}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(experts, MAX_TOP_K):
            raise _refuse(path, f"{top_k} is {k!r}; moe_route takes 1 to {min(experts, MAX_TOP_K)}")
        return KernelSparseMoE(module, top_k, softmax_first, normalize, cast)

    return build


_MX = {"mx": "mlx.core"}

_MIXTRAL_MOE = Forward(
    "def __call__(self, x: mx.array) -> mx.array:\n"
    "    gates = self.gate(x)\n"
    "    k = self.num_experts_per_tok\n"
    "    inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])\n"
    "    scores = mx.take_along_axis(gates, inds, axis=-1)\n"
    "    scores = mx.softmax(scores, axis=-1, precise=True)\n"
    "    y = self.switch_mlp(x, inds)\n"
    "    y = (y * scores[..., None]).sum(axis=-2)\n"
    "    return y\n", _MX)

_QWEN3_MOE = Forward(
    "def __call__(self, x: mx.array) -> mx.array:\n"
    "    if self.sharding_group is not None:\n"
    "        x = sum_gradients(self.sharding_group)(x)\n"
    "    gates = self.gate(x)\n"
    "    gates = mx.softmax(gates, axis=-1, precise=True)\n"
    "    k = self.top_k\n"
    "    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]\n"
    "    inds = mx.stop_gradient(inds)\n"
    "    scores = mx.take_along_axis(gates, inds, axis=-1)\n"
    "    if self.norm_topk_prob:\n"
    "        scores /= mx.sum(scores, axis=-1, keepdims=True)\n"
    "    y = self.switch_mlp(x, inds)\n"
    "    y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)\n"
    "    if self.sharding_group is not None:\n"
    "        y = mx.distributed.all_sum(y, group=self.sharding_group)\n"
    "    return y\n", _MX)


# ----------------------------------------------------------------------------- rules


def _mlp(call: str) -> Forward:
    return Forward(f"def __call__(self, x):\n    return self.down_proj({call})",
                   {"swiglu": _SWIGLU} if "swiglu" in call else {"nn": "mlx.nn"})


def _block(ffn: str) -> Forward:
    return Forward(
        "def __call__(self, x, mask=None, cache=None):\n"
        "    r = self.self_attn(self.input_layernorm(x), mask, cache)\n"
        "    h = x + r\n"
        f"    r = self.{ffn}(self.post_attention_layernorm(h))\n"
        "    out = h + r\n"
        "    return out\n")


def _attention_forward(heads: str, kv_heads: str, norms: bool) -> Forward:
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
        "    if cache is not None:\n"
        "        queries = self.rope(queries, offset=cache.offset)\n"
        "        keys = self.rope(keys, offset=cache.offset)\n"
        "        keys, values = cache.update_and_fetch(keys, values)\n"
        "    else:\n"
        "        queries = self.rope(queries)\n"
        "        keys = self.rope(keys)\n"
        "    output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, "
        "mask=mask)\n"
        "    output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)\n"
        "    return self.o_proj(output)\n",
        {"scaled_dot_product_attention": f"{_BASE}:scaled_dot_product_attention"})


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
    "    if cache is not None:\n"
    "        queries = self.rope(queries, offset=cache.offset)\n"
    "        keys = self.rope(keys, offset=cache.offset)\n"
    "        keys, values = cache.update_and_fetch(keys, values)\n"
    "    else:\n"
    "        queries = self.rope(queries)\n"
    "        keys = self.rope(keys)\n"
    "    output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, "
    "mask=mask)\n"
    "    output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)\n"
    "    return self.o_proj(output)\n",
    {**_MX, "scaled_dot_product_attention": f"{_BASE}:scaled_dot_product_attention"})

_EMBED = ("def __call__(self, inputs, cache=None, input_embeddings=None):\n"
          "    if input_embeddings is not None:\n"
          "        h = input_embeddings\n"
          "    else:\n"
          "        h = self.embed_tokens(inputs)\n"
          "    if cache is None:\n"
          "        cache = [None] * len(self.layers)\n")
_MASK = {"create_attention_mask": f"{_BASE}:create_attention_mask"}
#: mlx-lm's Qwen3Model and MixtralModel (and the models sharing their forward).
_STACK = Forward(_EMBED + "    mask = create_attention_mask(h, cache[0])\n"
                 "    for layer, c in zip(self.layers, cache):\n"
                 "        h = layer(h, mask, c)\n"
                 "    return self.norm(h)\n", _MASK)
#: mlx-lm's Phi3Model: as Qwen3Model's, without input embeddings.
_PLAIN_STACK = Forward("def __call__(self, inputs, cache=None):\n"
                       "    h = self.embed_tokens(inputs)\n"
                       "    if cache is None:\n"
                       "        cache = [None] * len(self.layers)\n"
                       "    mask = create_attention_mask(h, cache[0])\n"
                       "    for layer, c in zip(self.layers, cache):\n"
                       "        h = layer(h, mask, c)\n"
                       "    return self.norm(h)\n", _MASK)
#: mlx-lm's Qwen2Model (and the models sharing its forward): Qwen3Model's with pipeline
#: parallelism, linked only when the model runs whole on one process.
_PIPELINE_STACK = Forward(
    _EMBED.replace("    if cache is None:\n        cache = [None] * len(self.layers)\n", "")
    + "    pipeline_rank = self.pipeline_rank\n"
    "    pipeline_size = self.pipeline_size\n"
    "    if cache is None:\n"
    "        cache = [None] * len(self.pipeline_layers)\n"
    "    mask = create_attention_mask(h, cache[0])\n"
    "    if pipeline_rank < pipeline_size - 1:\n"
    "        h = mx.distributed.recv_like(h, pipeline_rank + 1)\n"
    "    for layer, c in zip(self.pipeline_layers, cache):\n"
    "        h = layer(h, mask, c)\n"
    "    if pipeline_rank != 0:\n"
    "        h = mx.distributed.send(h, (pipeline_rank - 1) % pipeline_size)\n"
    "        if cache[-1] is not None:\n"
    "            cache[-1].keys = mx.depends(cache[-1].keys, h)\n"
    "    if pipeline_size > 1:\n"
    "        h = mx.distributed.all_gather(h)[:h.shape[0]]\n"
    "    return self.norm(h)\n", {**_MASK, **_MX})
#: mlx-lm's LlamaModel: a full-attention mask, and a sliding-window one where its config gives
#: sliding-window layers.
_SLIDING_STACK = Forward(
    _EMBED + "    fa_mask = create_attention_mask(h, cache[self.fa_idx])\n"
    "    if self.swa_idx is not None:\n"
    "        swa_mask = create_attention_mask(h, cache[self.swa_idx], window_size=self.sliding_window)\n"
    "    for layer, cache in zip(self.layers, cache):\n"
    "        mask = swa_mask if layer.use_sliding else fa_mask\n"
    "        h = layer(h, mask, cache=cache)\n"
    "    return self.norm(h)\n", _MASK)


RMS_NORM = Rule("RMSNorm", "rms_norm", _rms_norm(0.0), classes=(nn.RMSNorm,), forwards=(
    Forward("def __call__(self, x):\n    return mx.fast.rms_norm(x, self.weight, self.eps)", _MX),
    Forward('def __call__(self, x):\n    return mx.fast.rms_norm(x, self["weight"], self.eps)', _MX)))
OFFSET_RMS_NORM = Rule("RMSNorm with weight + 1 (Gemma)", "rms_norm", _rms_norm(1.0), forwards=(
    Forward("def __call__(self, x):\n    return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)", _MX),))

#: Every RoPE layer mlx-lm ships, by exact class.
ROPE_RULES: list[Rule] = [
    Rule("RoPE", "rope", _rope(KernelRoPE, numbers=("base", "scale")), classes=(nn.RoPE,)),
    Rule("Llama 3 RoPE", "rope", _rope(KernelFreqsRoPE, freqs=True), classes=(f"{_ROPE_UTILS}:Llama3RoPE",)),
    Rule("proportional RoPE", "rope", _rope(KernelFreqsRoPE, freqs=True),
         classes=(f"{_ROPE_UTILS}:ProportionalRoPE",)),
    Rule("YaRN RoPE", "rope", _rope(KernelYarnRoPE, freqs=True, numbers=("mscale",)),
         classes=(f"{_ROPE_UTILS}:YarnRoPE",)),
    Rule("LongRoPE (SuScaledRoPE)", "rope", _rope(KernelSuScaledRoPE, "dim", freqs=True, numbers=("_scale",)),
         classes=(f"{_ROPE_UTILS}:SuScaledRoPE",)),
    Rule("dynamic NTK RoPE", "rope",
         _rope(KernelDynamicRoPE, numbers=("base", "factor", "max_position_embeddings")),
         classes=(f"{_ROPE_UTILS}:DynamicNTKScalingRoPE",)),
]


def _stack_rule(name: str, kind: type[KernelDecoderStack], forward: Forward) -> Rule:
    return Rule(name, "add_rms_norm", _stack(kind), forwards=(forward,),
                when=lambda m: _rms_norm_offset(m.get("norm")) is not None)


def _attention_rule(name: str, heads: str, kv_heads: str, norms: bool) -> Rule:
    return Rule(name, "rope_qk", _attention(heads, kv_heads, norms),
                forwards=(_attention_forward(heads, kv_heads, norms),), when=_knows_rope_and_norms(norms))


GEMMA2_ATTENTION = Rule(
    "attention prologue (Gemma 2): RoPE of q and k, laid out; soft-capped scores", "rope_qk",
    _attention("n_heads", "n_kv_heads", False, kind=gemma.KernelSoftcapAttention),
    forwards=(gemma.ATTENTION,), when=_knows_rope_and_norms(False))
FUSED_ATTENTION = Rule("attention prologue (Phi-3): one qkv_proj split, RoPE of q and k, laid out", "rope_qk",
                       _attention("n_heads", "n_kv_heads", False, FUSED_QKV), forwards=(_FUSED_ATTENTION,),
                       when=_knows_rope_and_norms(False))


#: Every rule, in the order they are tried (a block before the layers inside it).
RULES: list[Rule] = [
    _stack_rule("decoder stack (Qwen 3, Mixtral): each residual add fused into the next RMSNorm",
                KernelDecoderStack, _STACK),
    _stack_rule("decoder stack (Llama): each residual add fused into the next RMSNorm",
                KernelSlidingDecoderStack, _SLIDING_STACK),
    _stack_rule("decoder stack (Phi-3): each residual add fused into the next RMSNorm",
                KernelDecoderStack, _PLAIN_STACK),
    Rule("decoder stack (Qwen 2): each residual add fused into the next RMSNorm", "add_rms_norm",
         _stack(KernelDecoderStack), forwards=(_PIPELINE_STACK,),
         when=lambda m: _rms_norm_offset(m.get("norm")) is not None and getattr(m, "pipeline_size", 1) == 1
         and len(getattr(m, "pipeline_layers", ())) == len(m.get("layers", ()))),
    _stack_rule("decoder stack (Gemma 2): each residual add fused into the next RMSNorm",
                gemma.KernelScaledDecoderStack, gemma.MODEL),
    Rule("pre-norm block with post-norms (Gemma 2): residual adds fused into the next RMSNorm",
         "add_rms_norm", _residual_block(gemma.GEMMA2_BLOCK), forwards=(gemma.BLOCK,),
         when=lambda m: _rms_norm_offset(m.get("pre_feedforward_layernorm")) is not None),
    *(Rule(f"pre-norm block (residual add + RMSNorm before {ffn})", "add_rms_norm",
           _residual_block(LLAMA_BLOCK._replace(ffn=ffn)), forwards=(_block(ffn),),
           when=lambda m: _rms_norm_offset(m.get("post_attention_layernorm")) is not None)
      for ffn in ("mlp", "block_sparse_moe")),
    _attention_rule("attention prologue (Llama): RoPE of q and k, laid out", "n_heads", "n_kv_heads",
                    False),
    _attention_rule("attention prologue (Qwen 3): q/k RMSNorm and RoPE, laid out", "n_heads", "n_kv_heads",
                    True),
    _attention_rule("attention prologue (Mixtral): RoPE of q and k, laid out", "num_heads",
                    "num_key_value_heads", False),
    FUSED_ATTENTION,
    GEMMA2_ATTENTION,
    RMS_NORM,
    OFFSET_RMS_NORM,
    Rule("LayerNorm", "layer_norm", _layer_norm, classes=(nn.LayerNorm,)),
    *ROPE_RULES,
    Rule("SwiGLU MLP", "swiglu", _gated(KernelSwiGLUMLP), forwards=(
        _mlp("swiglu(self.gate_proj(x), self.up_proj(x))"),
        _mlp("nn.silu(self.gate_proj(x)) * self.up_proj(x)"))),
    Rule("SwiGLU MLP with a fused gate_up_proj (Phi-3)", "swiglu", _gate_up, forwards=(Forward(
        "def __call__(self, x):\n    x = self.gate_up_proj(x)\n    gate, x = mx.split(x, 2, axis=-1)\n"
        "    return self.down_proj(swiglu(gate, x))", {**_MX, "swiglu": _SWIGLU}),)),
    Rule("sparse mixture of experts (Mixtral): the router's top-k and softmax", "moe_route",
         _sparse_moe("num_experts_per_tok"), forwards=(_MIXTRAL_MOE,)),
    Rule("sparse mixture of experts (Qwen 3 MoE): the router's softmax and top-k", "moe_route",
         _sparse_moe("top_k", softmax_first=True, normalize="norm_topk_prob", cast=True),
         forwards=(_QWEN3_MOE,), when=lambda m: getattr(m, "sharding_group", None) is None),
    Rule("SwiGLU activation (mlx-lm switch layers)", "swiglu", lambda m, p: KernelSwiGLU(m), forwards=(
        Forward("def __call__(self, x, gate):\n    return swiglu(gate, x)", {"swiglu": _SWIGLU}),)),
    Rule("GeGLU MLP (Gemma)", "gelu", _gated(KernelGeGLUMLP), forwards=(
        _mlp("nn.gelu(self.gate_proj(x)) * self.up_proj(x)"),)),
    Rule("GeGLU MLP, tanh GELU (Gemma 2)", "gelu", _gated(lambda m: KernelGeGLUMLP(m, approx=True)),
         forwards=(_mlp("nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x)"),)),
    Rule("GELU", "gelu", lambda m, p: KernelGELU(m), classes=(nn.GELU,),
         when=lambda m: getattr(m, "_approx", None) in ("none", "precise", "tanh")),
    Rule("Softmax", "softmax", lambda m, p: KernelSoftmax(m), classes=(nn.Softmax,)),
]


def kernel_names() -> list[str]:
    """The kernel names ``patch(kernels=...)`` accepts: those of the rules, and those fused blocks
    also decode with (``norm_projections``, ``norm_swiglu`` and their quantized forms)."""
    return sorted({rule.kernel for rule in RULES} | KernelResidualBlock.DECODING_KERNELS)


# ----------------------------------------------------------------------------- walking


#: The replacements the ``patch`` call in progress built, by the id of the module each replaces.
_built: contextvars.ContextVar[dict[int, KernelLayer] | None] = contextvars.ContextVar(
    "graphkern_patch_built", default=None)


def _one_per_module(original: nn.Module, kind: type[KernelLayer],
                    build: Callable[[], KernelLayer]) -> KernelLayer:
    """The replacement of ``kind`` this ``patch`` call already built for ``original``, else
    ``build()``'s, remembered: a module held at several places (tied layers, one activation
    shared by several blocks) gets one replacement, put at every place, so it stays shared."""
    built = _built.get()
    found = built.get(id(original)) if built is not None else None
    if isinstance(found, kind):
        return found
    made = build()
    if built is not None:
        built[id(original)] = made
    return made


Slot = tuple[Any, Any, nn.Module, str]  # (container, key, child, path)


def _children(module: Any, path: str) -> Iterator[Slot]:
    """Every module directly inside ``module``, with the container and key that hold it."""
    items = module.items() if isinstance(module, dict) else enumerate(module)
    for key, value in list(items):
        child_path = f"{path}.{key}" if path else str(key)
        if isinstance(value, nn.Module):
            yield module, key, value, child_path
        elif isinstance(value, (list, dict)):
            yield from _children(value, child_path)


def _select(kernels: str | Sequence[str]) -> set[str]:
    known = kernel_names()
    if kernels == "all":
        return set(known)
    if isinstance(kernels, str) or not isinstance(kernels, Sequence):
        raise ModelError(PATCH, f'kernels must be "all" or a list of names from {known}, got {kernels!r}',
                          Status.INVALID_INPUT)
    unknown = sorted(set(kernels) - set(known))
    if unknown:
        raise ModelError(PATCH, f"no patch rule uses {unknown}; known kernels: {known}",
                          Status.INVALID_INPUT)
    return set(kernels)


#: Class names that look like a layer some kernel replaces, and the kernels that would.
_LOOKS_LIKE = [(re.compile(r"norm", re.I), {"rms_norm", "layer_norm"}),
               (re.compile(r"rope|rotary", re.I), {"rope", "rope_qk"}),
               (re.compile(r"mlp", re.I), {"swiglu", "gelu"}),
               (re.compile(r"attention|attn", re.I), {"rope_qk"}),
               (re.compile(r"moe", re.I), {"moe_route"})]
#: Class names of what holds layers (``Qwen3MoeModel``, ``Qwen3MoeDecoderLayer``): never a target.
_CONTAINER = re.compile(r"(Model|DecoderLayer|TransformerBlock|ForCausalLM)$")


def _unmatched(module: nn.Module, path: str, selected: frozenset[str]) -> Unmatched | None:
    """``module`` (which no selected rule matched) as an :class:`Unmatched` when its class name
    looks like a target of the selected kernels and no rule at all matches it (one of kernels not
    selected is the caller's choice), else None."""
    name = type(module).__name__
    if _CONTAINER.search(name) or not any(pattern.search(name) and kernels & selected
                                          for pattern, kernels in _LOOKS_LIKE):
        return None
    if any(rule.matches(module) for rule in RULES):
        return None
    refused = [rule.name for rule in RULES if rule.recognises(module)]
    reason = (f"recognised by the rule {refused[0]!r}, whose condition on the layer's settings does "
              f"not hold" if refused else "neither its class nor its forward is one a rule knows")
    return Unmatched(path, f"{type(module).__module__}.{type(module).__qualname__}", reason)


def _warn_unmatched(unmatched: list[Unmatched]) -> None:
    by_kind: dict[tuple[str, str], list[str]] = {}
    for u in unmatched:
        by_kind.setdefault((u.original, u.reason), []).append(u.path)
    lines = [f"{cls} at {', '.join(paths[:3])}{f' and {len(paths) - 3} more' if len(paths) > 3 else ''}"
             f" ({reason})" for (cls, reason), paths in by_kind.items()]
    warnings.warn(PatchWarning(
        f"patch left {len(unmatched)} layer(s) that look like kernel targets running stock: "
        + "; ".join(lines) + ". No rule matched them: a layer graphkern has no kernel for, or a "
        "forward a newer mlx-lm changed; the report's .unmatched lists them"), stacklevel=3)


def patch(model: nn.Module, kernels: str | Sequence[str] = "all", route: str = "auto") -> PatchReport:
    """Replace every layer of ``model`` that a rule of the selected ``kernels`` matches.

    The replacements share the originals' parameters (same arrays, same names). Nothing changes
    unless every match passes its checks: otherwise ``KernelError`` names the layer and the problem.
    Layers already patched stay as they are; patching twice is harmless. A module held at several
    places (tied layers, one norm shared by two blocks) gets one replacement, put at every place,
    so what is assigned through one place still reaches the others. A layer whose class looks
    like a target of the selected kernels (a norm, RoPE, MLP, attention or MoE block) but that no
    rule matched is listed in the report's ``unmatched``, and one ``gk.PatchWarning`` names them all.

    Args:
        model: the model, patched in place.
        kernels: ``"all"`` or the names of the library kernels to patch onto.
        route: how the new layers run each call (``graphkern.models.routes``): ``"auto"`` takes
            the stock op where a standalone kernel cannot pay for itself, ``"kernel"`` always
            the kernel, ``"stock"`` always the stock op.

    Raises:
        KernelError: a matched layer's parameters do not fit its kernel, or an argument is wrong.

    >>> import mlx.nn as nn
    >>> model = nn.Sequential(nn.LayerNorm(4), nn.RMSNorm(4))
    >>> [p.path for p in patch(model, kernels=["rms_norm"])]
    ['layers.1']
    """
    _require_module(model, "patch")
    check_route(PATCH, route)
    selected = frozenset(_select(kernels))
    rules = [rule for rule in RULES if rule.kernel in selected]
    installs: list[tuple[Any, Any, KernelLayer]] = []
    report: list[Patched] = []
    unmatched: list[Unmatched] = []

    def visit(module: nn.Module, path: str) -> None:
        for container, key, child, child_path in _children(module, path):
            rule = None if isinstance(child, KernelLayer) else next(
                (r for r in rules if r.matches(child)), None)
            if rule is None and not isinstance(child, KernelLayer):
                missed = _unmatched(child, child_path, selected)
                if missed is not None:
                    unmatched.append(missed)
            if rule is not None:
                child = _one_per_module(child, KernelLayer, functools.partial(rule.build, child, child_path))
                child.select(selected)
                _route_layer(child, route)
                # the mode of the model around it: a module can be shared between models (mlx-lm's
                # SwitchGLU takes one default SwiGLU instance), and another model's eval() set its own
                child._training = module._training
                installs.append((container, key, child))
                report.append(Patched(child_path, rule.kernel, rule.name,
                                      type(child.original).__qualname__, child.note()))
            visit(child, child_path)

    token = _built.set({})
    try:
        visit(model, "")
    finally:
        _built.reset(token)
    for container, key, replacement in installs:
        container[key] = replacement
    if unmatched:
        _warn_unmatched(unmatched)
    return PatchReport(report, unmatched)


def _route_layer(layer: KernelLayer, route: str) -> None:
    """``layer`` and the kernel layers it built inside itself (a block's norms) take ``route``."""
    for _, module in layer.named_modules():
        if isinstance(module, KernelLayer):
            object.__setattr__(module, "_gk_call_route", route)


def set_route(model: nn.Module, route: str) -> int:
    """Give every patched layer in ``model`` the route ``route`` (``graphkern.models.routes``);
    returns how many layers there are.

    Raises:
        ModelError: ``route`` is not one of ``"auto"``, ``"kernel"``, ``"stock"``.

    >>> import mlx.nn as nn
    >>> model = nn.Sequential(nn.RMSNorm(8))
    >>> _ = patch(model)
    >>> set_route(model, "kernel")
    1
    """
    _require_module(model, "set_route")
    check_route("set the route of patched layers", route)
    layers = [m for _, m in model.named_modules() if isinstance(m, KernelLayer)]
    for layer in layers:
        object.__setattr__(layer, "_gk_call_route", route)
    return len(layers)


def _require_module(model: Any, function: str) -> None:
    """``ModelError`` for what is not an ``nn.Module`` (walking it would fail with a bare TypeError)."""
    if not isinstance(model, nn.Module):
        got = "None" if model is None else f"{type(model).__module__}.{type(model).__qualname__}"
        raise ModelError(PATCH, f"{function} takes an mlx.nn.Module and got {got}", Status.INVALID_INPUT)


def _sync(layer: KernelLayer) -> None:
    """Carry parameters replaced while patched (training, ``update``) back to the originals, and
    child modules replaced while patched (``nn.quantize``'s quantized projections, adapters). Only
    the ones replaced: a layer left out of the model by a later patch (the input norm a fused block
    took over) holds arrays older than its original's."""
    original = layer.original
    for key, value in layer.replaced_arrays().items():
        if key in original:
            original[key] = value
    for key, value in layer.replaced_children().items():
        original[key] = value  # its own kernel layers are put back when unpatch walks into it
    for _, _, child, _ in _children(layer, ""):
        if isinstance(child, KernelLayer):
            _sync(child)


def unpatch(model: nn.Module) -> list[str]:
    """Put back every layer ``patch`` replaced (the very same module objects); returns their paths.
    A replacement held at several places puts its one original back at each.

    What was done to the model while patched is carried over to the originals: updated parameters,
    and child modules put in place of stock ones (``nn.quantize(model)`` after ``patch`` leaves the
    stock layers with the quantized projections).
    """
    _require_module(model, "unpatch")
    restored: list[str] = []

    def visit(module: nn.Module, path: str) -> None:
        for container, key, child, child_path in _children(module, path):
            if isinstance(child, KernelLayer):
                _sync(child)
                child = child.original
                container[key] = child
                restored.append(child_path)
            visit(child, child_path)

    visit(model, "")
    return restored


def patched_layers(model: nn.Module) -> dict[str, str]:
    """``{path: kernel}`` for every kernel-backed layer in ``model``."""
    _require_module(model, "patched_layers")
    found: dict[str, str] = {}

    def visit(module: nn.Module, path: str) -> None:
        for _, _, child, child_path in _children(module, path):
            if isinstance(child, KernelLayer):
                found[child_path] = child.kernel
            visit(child, child_path)

    visit(model, "")
    return found
