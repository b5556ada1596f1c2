"""What ``patch`` is made of: a :class:`Rule` a kind of layer, the checks a rule makes of a layer's
parameters, the builders of the kernel-backed layers, and the rules for layers every family shares
(norms, RoPEs, MLPs, activations). What one model family knows (its forwards, block layouts and
layers of its own) lives in ``graphkern.models.families``, which builds its rules from these.

>>> import mlx.nn as nn
>>> RMS_NORM.matches(nn.RMSNorm(8)), RMS_NORM.matches(nn.LayerNorm(8))
(True, False)
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern.errors import ModelError
from graphkern.kernels.base import FLOAT_DTYPES
from graphkern.kernels.ops.moe_route import MAX_EXPERTS, MAX_TOP_K
from graphkern.kernels.ops.rope_qk import MAX_HEAD_DIM
from graphkern.models.layers import (
    FUSED_QKV,
    SEPARATE_QKV,
    BlockLayout,
    KernelAddRMSNorm,
    KernelAttention,
    KernelDecoderStack,
    KernelDynamicRoPE,
    KernelFreqsRoPE,
    KernelGateUpMLP,
    KernelGELU,
    KernelLayer,
    KernelLayerNorm,
    KernelQuantizedEmbedding,
    KernelQuantizedOutput,
    KernelResidualBlock,
    KernelRMSNorm,
    KernelRoPE,
    KernelSoftmax,
    KernelSparseMoE,
    KernelSuScaledRoPE,
    KernelSwiGLUMLP,
    KernelYarnRoPE,
)
from graphkern.models.layers.logits import readable_quantization
from graphkern.models.patterns import Forward, is_class, module_global
from graphkern.nodes import KernelError, Status, dtype_name

PATCH = "patch a model with graphkern kernels"
#: Where mlx-lm keeps what the forwards below use, as ``Forward`` names them.
SWIGLU = "mlx_lm.models.activations:swiglu"
MLX_LM_BASE = "mlx_lm.models.base"
_ROPE_UTILS = "mlx_lm.models.rope_utils"
MX = {"mx": "mlx.core"}
MASK = {"create_attention_mask": f"{MLX_LM_BASE}:create_attention_mask"}
#: The lines of mlx-lm's attention forwards between their projections and their scores: the RoPE
#: of the queries and keys at the cache's offset, and the cache update.
ROPE_AND_CACHE = (
    "    if cache is not None:\n"
    "        queries = self.rope(queries, offset=cache.offset)\n"
    "        keys = self.rope(keys, offset=cache.offset)\n"
    "        keys, values = cache.update_and_fetch(keys, values)\n"
    "    else:\n"
    "        queries = self.rope(queries)\n"
    "        keys = self.rope(keys)\n")
#: Their last lines where the scores are ``scaled_dot_product_attention``'s (mlx-lm's base).
SDPA_OUTPUT = (
    "    output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, "
    "mask=mask)\n"
    "    output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)\n"
    "    return self.o_proj(output)\n")
SDPA = {"scaled_dot_product_attention": f"{MLX_LM_BASE}:scaled_dot_product_attention"}


@dataclass(frozen=True)
class Rule:
    """How one kind of layer becomes kernel-backed.

    A module matches when its class is one of ``classes`` (exactly; a class or its
    ``"pkg.module:Name"``, looked up only for a class of that name) or its forward is one of
    ``forwards``, and ``when`` (if given) accepts it; with ``keys``, only a module held under one
    of those names (``lm_head``). ``build(module, path)`` checks the module's parameters (raising
    ``KernelError``) and returns the replacement.
    """

    name: str
    kernel: str
    build: Callable[[nn.Module, str], KernelLayer]
    classes: tuple[type | str, ...] = ()
    forwards: tuple[Forward, ...] = ()
    when: Callable[[nn.Module], bool] | None = None
    keys: tuple[str, ...] = ()

    def matches(self, module: nn.Module) -> bool:
        return self.recognises(module) and (self.when is None or self.when(module))

    def takes(self, module: nn.Module, key: Any) -> bool:
        """Whether this rule replaces ``module``, held under ``key`` in its container."""
        return (not self.keys or key in self.keys) and self.matches(module)

    def recognises(self, module: nn.Module) -> bool:
        """Whether ``module``'s class or forward is this rule's (``when`` aside)."""
        cls = type(module)
        return any(cls is c if isinstance(c, type) else is_class(cls, c) for c in self.classes) or any(
            f.matches(cls) for f in self.forwards)



# ----------------------------------------------------------------------------- one replacement a module


#: The replacements the ``patch`` call in progress built, by the id of the module each replaces.
building: contextvars.ContextVar[dict[int, KernelLayer] | None] = contextvars.ContextVar(
    "graphkern_patch_built", default=None)


def one_per_module(original: nn.Module, kind: type[KernelLayer],
                    build: Callable[[], KernelLayer]) -> KernelLayer:
    """The replacement of ``kind`` this ``patch`` call already built for ``original``, else
    ``build()``'s, remembered: a module held at several places (tied layers, one activation
    shared by several blocks) gets one replacement, put at every place, so it stays shared."""
    built = building.get()
    found = built.get(id(original)) if built is not None else None
    if isinstance(found, kind):
        return found
    made = build()
    if built is not None:
        built[id(original)] = made
    return made



# ----------------------------------------------------------------------------- parameter checks


def refuse(path: str, description: str) -> KernelError:
    return ModelError(PATCH, f"{path or '<model>'}: {description}", Status.INVALID_INPUT)


def check_float_dtype(dtype: mx.Dtype | None, what: str, path: str) -> None:
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise refuse(path, f"{what} is {dtype_name(dtype)}; the kernels take float32, float16 "
                      "and bfloat16")


def check_vector(module: nn.Module, key: str, path: str, size: int | None = None) -> mx.array:
    value = module.get(key) if isinstance(module, dict) else None
    if not isinstance(value, mx.array):
        raise refuse(path, f"{key} must be an mx.array, got {type(value).__name__}")
    if value.ndim != 1 or (size is not None and value.shape[0] != size):
        expected = f"({size},)" if size is not None else "1-D"
        raise refuse(path, f"{key} has shape {tuple(value.shape)}; expected {expected}")
    check_float_dtype(value.dtype, key, path)
    return value


def check_number(module: nn.Module, key: str, path: str, *, at_least: float | None = None,
            positive: bool = False) -> float:
    value = getattr(module, key, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            at_least is not None and value < at_least) or (positive and value <= 0):
        bound = " > 0" if positive else f" >= {at_least:g}" if at_least is not None else ""
        raise refuse(path, f"{key} must be a finite number{bound}, got {value!r}")
    return float(value)


def check_eps(module: nn.Module, path: str) -> None:
    check_number(module, "eps", path, at_least=0)


def child_of(module: nn.Module, key: str, path: str) -> nn.Module:
    child = module.get(key) if isinstance(module, dict) else None
    if not isinstance(child, nn.Module):
        raise refuse(path, f"has no {key} layer")
    return child


def linear_shape(module: nn.Module, key: str, path: str) -> tuple[int, int, mx.Dtype | None]:
    """(input dims, output dims, output dtype) of a Linear or QuantizedLinear child; the dtype is
    None for a quantization whose scales are not floats (mxfp4...): its output takes its input's."""
    layer = child_of(module, key, path)
    weight = layer.get("weight")
    if not isinstance(weight, mx.array) or weight.ndim != 2:
        raise refuse(f"{path}.{key}", "expected a Linear layer with a 2-D weight")
    scales = layer.get("scales")
    if isinstance(scales, mx.array):  # quantized: packed weight, output in the scales' dtype
        bits = getattr(layer, "bits", 32)
        dtype = scales.dtype if mx.issubdtype(scales.dtype, mx.floating) else None
        return weight.shape[1] * 32 // bits, weight.shape[0], dtype
    return weight.shape[1], weight.shape[0], weight.dtype


def check_same(path: str, what: str, a: tuple[str, Any], b: tuple[str, Any]) -> None:
    if a[1] != b[1] and a[1] is not None and b[1] is not None:  # None: not known from the weights
        show = (lambda v: dtype_name(v)) if isinstance(a[1], mx.Dtype) else repr
        raise refuse(path, f"{what} mismatch: {a[0]} gives {show(a[1])} but {b[0]} gives {show(b[1])}")


# ----------------------------------------------------------------------------- builders


def build_rms_norm(offset: float) -> Callable[[nn.Module, str], KernelLayer]:
    def build(module: nn.Module, path: str) -> KernelLayer:
        check_vector(module, "weight", path)
        check_eps(module, path)
        return KernelRMSNorm(module, offset)

    return build


def build_layer_norm(module: nn.Module, path: str) -> KernelLayer:
    check_eps(module, path)
    weight = check_vector(module, "weight", path) if "weight" in module else None
    if "bias" in module:
        bias = check_vector(module, "bias", path, weight.shape[0] if weight is not None else None)
        if weight is not None:
            check_same(path, "dtype", ("weight", weight.dtype), ("bias", bias.dtype))
    return KernelLayerNorm(module)


def build_rope(layer: type[KernelRoPE], dims_key: str = "dims", freqs: bool = False,
          numbers: tuple[str, ...] = ()) -> Callable[[nn.Module, str], KernelLayer]:
    """A RoPE layer (``layer`` stands in for it): even ``dims_key``, a ``_freqs`` table of dims / 2
    floats when ``freqs``, finite ``numbers`` (``base`` > 0 where it is one)."""

    def build(module: nn.Module, path: str) -> KernelLayer:
        dims = getattr(module, dims_key, None)
        if isinstance(dims, bool) or not isinstance(dims, int) or dims <= 0 or dims % 2:
            raise refuse(path, f"RoPE {dims_key} must be a positive even int, got {dims!r}")
        if freqs:
            table = module.get("_freqs") if isinstance(module, dict) else None
            if not isinstance(table, mx.array) or table.shape != (dims // 2,):
                got = tuple(table.shape) if isinstance(table, mx.array) else type(table).__name__
                raise refuse(path, f"RoPE frequencies (_freqs) must have shape ({dims // 2},), got {got}")
            if not mx.issubdtype(table.dtype, mx.floating):
                raise refuse(path, f"RoPE frequencies (_freqs) are {dtype_name(table.dtype)}; "
                              "expected floats")
        for key in numbers:
            check_number(module, key, path, positive=key in ("base", "mscale", "max_position_embeddings"))
        return layer(module)

    return build


def rotary_of(module: nn.Module, path: str) -> KernelRoPE | None:
    """``module`` (an attention's RoPE) as a :class:`KernelRoPE`: itself when patched, else built by
    its rule (checked); None for a RoPE no rule knows."""
    if isinstance(module, KernelRoPE):
        return module
    rule = next((r for r in ROPE_RULES if r.matches(module)), None)
    if rule is None:
        return None
    return one_per_module(module, KernelRoPE, lambda: rule.build(module, path))  # type: ignore[return-value]


def head_dim_of(module: nn.Module, path: str, counts: list[int], heads: str, kv_heads: str,
              projections: tuple[str, ...]) -> tuple[int, mx.Dtype | None]:
    """(head dimension, output dtype) of an attention's query, key and value projections: three
    children, or one fused child giving ``heads + 2 * kv_heads`` heads' features."""
    if projections == FUSED_QKV:
        _, out, dtype = linear_shape(module, "qkv_proj", path)
        total = counts[0] + 2 * counts[1]
        if out % total:
            raise refuse(path, f"qkv_proj gives {out} features, not a multiple of {heads} + 2 x {kv_heads}"
                          f" = {total} heads")
        check_float_dtype(dtype, "qkv_proj's output", path)
        return out // total, dtype
    _, q_out, q_dtype = linear_shape(module, "q_proj", path)
    _, k_out, k_dtype = linear_shape(module, "k_proj", path)
    linear_shape(module, "v_proj", path)
    check_same(path, "dtype", ("q_proj", q_dtype), ("k_proj", k_dtype))
    check_float_dtype(q_dtype, "q_proj's output", path)
    if q_out % counts[0]:
        raise refuse(path, f"q_proj gives {q_out} features, not a multiple of {heads}={counts[0]}")
    d = q_out // counts[0]
    check_same(path, "key features", ("k_proj", k_out), (f"{kv_heads} x head dim", counts[1] * d))
    return d, q_dtype


def build_attention(heads: str, kv_heads: str, norms: bool, projections: tuple[str, ...] = SEPARATE_QKV,
               kind: type[KernelAttention] = KernelAttention,
               norm_offset: float = 0.0) -> Callable[[nn.Module, str], KernelLayer]:
    """An attention whose prologue (per-head norms, RoPE, layout) goes on ``rope_qk``, as a ``kind``;
    ``norm_offset``: its per-head norms scale by ``norm_offset + weight`` (1 for Gemma 3's)."""

    def build(module: nn.Module, path: str) -> KernelLayer:
        counts = []
        for key in (heads, kv_heads):
            value = getattr(module, key, None)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise refuse(path, f"{key} must be a positive int, got {value!r}")
            counts.append(value)
        d, q_dtype = head_dim_of(module, path, counts, heads, kv_heads, projections)
        if d > MAX_HEAD_DIM:
            raise refuse(path, f"head dimension {d} is over the rope_qk kernel's {MAX_HEAD_DIM}")
        rotary = rotary_of(child_of(module, "rope", path), f"{path}.rope")
        assert rotary is not None  # the rule's `when` checked it
        dims = getattr(rotary, "dims", getattr(rotary, "dim", 0))
        if dims > d:
            raise refuse(f"{path}.rope", f"RoPE dims {dims} exceed the head dimension {d}")
        if norms:
            eps = []
            for key in ("q_norm", "k_norm"):
                norm = child_of(module, key, path)
                weight = check_vector(norm, "weight", f"{path}.{key}", d)
                check_same(f"{path}.{key}", "dtype", ("weight", weight.dtype), ("q_proj", q_dtype))
                check_eps(norm, f"{path}.{key}")
                eps.append(norm.eps)
            check_same(path, "eps", ("q_norm", eps[0]), ("k_norm", eps[1]))
        sdpa = module_global(type(module), "scaled_dot_product_attention")
        return kind(module, heads, kv_heads, rotary, norms, sdpa, projections, norm_offset)

    return build


def knows_rope_and_norms(norms: bool, norm_offset: float = 0.0) -> Callable[[nn.Module], bool]:
    """Whether an attention's RoPE is one a rule knows, and (``norms``) its ``q_norm`` and
    ``k_norm`` are RMSNorms whose weight offset is ``norm_offset``."""

    def when(module: nn.Module) -> bool:
        rope = module.get("rope") if isinstance(module, dict) else None
        if not isinstance(rope, nn.Module) or (
                not isinstance(rope, KernelRoPE) and not any(r.matches(rope) for r in ROPE_RULES)):
            return False
        return not norms or all(rms_norm_offset(module.get(key)) == norm_offset
                                for key in ("q_norm", "k_norm"))

    return when


def build_gated_mlp(kind: Callable[[nn.Module], KernelLayer]) -> Callable[[nn.Module, str], KernelLayer]:
    """An MLP ``down(act(gate(x)) * up(x))``: gate and up agree, down takes their output."""

    def build(module: nn.Module, path: str) -> KernelLayer:
        _, gate_out, gate_dtype = linear_shape(module, "gate_proj", path)
        _, up_out, up_dtype = linear_shape(module, "up_proj", path)
        down_in, _, _ = linear_shape(module, "down_proj", path)
        check_same(path, "output size", ("gate_proj", gate_out), ("up_proj", up_out))
        check_same(path, "dtype", ("gate_proj", gate_dtype), ("up_proj", up_dtype))
        check_same(path, "hidden size", ("gate_proj", gate_out), ("down_proj (input)", down_in))
        check_float_dtype(gate_dtype, "gate_proj's output", path)
        return kind(module)

    return build


def build_gate_up_mlp(module: nn.Module, path: str) -> KernelLayer:
    _, out, dtype = linear_shape(module, "gate_up_proj", path)
    down_in, _, _ = linear_shape(module, "down_proj", path)
    if out % 2:
        raise refuse(path, f"gate_up_proj has {out} outputs; it must split into two halves")
    check_same(path, "hidden size", ("gate_up_proj (half)", out // 2), ("down_proj (input)", down_in))
    check_float_dtype(dtype, "gate_up_proj's output", path)
    return KernelGateUpMLP(module)


def rms_norm_offset(norm: Any) -> float | None:
    """The weight offset of an RMSNorm a rule knows (0, or 1 for Gemma's; looked through an earlier
    patch), else None."""
    if isinstance(norm, KernelRMSNorm):
        return norm._gk_offset
    if not isinstance(norm, nn.Module):
        return None
    return next((offset for rule, offset in ((RMS_NORM, 0.0), (OFFSET_RMS_NORM, 1.0)) if rule.matches(norm)),
                None)


def add_norm_of(block: nn.Module, key: str, path: str) -> KernelAddRMSNorm | None:
    """``block``'s RMSNorm ``key`` as a :class:`KernelAddRMSNorm` (checked), or None if no rule knows it."""
    norm = block.get(key) if isinstance(block, dict) else None
    offset = rms_norm_offset(norm)
    if offset is None or not isinstance(norm, nn.Module):
        return None
    original = norm.original if isinstance(norm, KernelRMSNorm) else norm
    check_vector(original, "weight", f"{path}.{key}")
    check_eps(original, f"{path}.{key}")
    return one_per_module(original, KernelAddRMSNorm,  # type: ignore[return-value]
                           lambda: KernelAddRMSNorm(original, offset))


def build_residual_block(layout: BlockLayout, kind: type[KernelResidualBlock] = KernelResidualBlock
                         ) -> Callable[[nn.Module, str], KernelLayer]:
    """A pre-norm block of ``layout`` whose residual adds run inside its norms, as a ``kind``."""

    def build(module: nn.Module, path: str) -> KernelLayer:
        norm = add_norm_of(module, layout.pre_ffn_norm, path)
        assert norm is not None  # the rule's `when` checked it
        child_of(module, layout.ffn, path)
        for post in (layout.post_attention_norm, layout.post_ffn_norm):
            if post is not None:
                child_of(module, post, path)
        return kind(module, layout, norm, add_norm_of(module, "input_layernorm", path))

    return build


def build_stack(kind: type[KernelDecoderStack]) -> Callable[[nn.Module, str], KernelLayer]:
    def build(module: nn.Module, path: str) -> KernelLayer:
        norm = add_norm_of(module, "norm", path)
        assert norm is not None  # the rule's `when` checked it
        layers = module.get("layers") if isinstance(module, dict) else None
        if not isinstance(layers, list):
            raise refuse(path, f"layers must be a list of blocks, got {type(layers).__name__}")
        return kind(module, norm, module_global(type(module), "create_attention_mask"))

    return build


def build_sparse_moe(top_k: str, softmax_first: bool = False, normalize: str | None = None,
                cast: bool = False) -> Callable[[nn.Module, str], KernelLayer]:
    """A sparse mixture-of-experts block whose router the ``moe_route`` kernel can take."""

    def build(module: nn.Module, path: str) -> KernelLayer:
        _, experts, dtype = linear_shape(module, "gate", path)
        check_float_dtype(dtype, "gate's output", path)
        k = getattr(module, top_k, None)
        if not 1 <= experts <= MAX_EXPERTS:
            raise refuse(path, f"the router has {experts} experts; moe_route takes 1 to {MAX_EXPERTS}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(experts, MAX_TOP_K):
            raise refuse(path, f"{top_k} is {k!r}; moe_route takes 1 to {min(experts, MAX_TOP_K)}")
        return KernelSparseMoE(module, top_k, softmax_first, normalize, cast)

    return build




# ----------------------------------------------------------------------------- rules every family shares


def mlp_forward(call: str) -> Forward:
    return Forward(f"def __call__(self, x):\n    return self.down_proj({call})",
                   {"swiglu": SWIGLU} if "swiglu" in call else {"nn": "mlx.nn"})



RMS_NORM = Rule("RMSNorm", "rms_norm", build_rms_norm(0.0), classes=(nn.RMSNorm,), forwards=(
    Forward("def __call__(self, x):\n    return mx.fast.rms_norm(x, self.weight, self.eps)", MX),
    Forward('def __call__(self, x):\n    return mx.fast.rms_norm(x, self["weight"], self.eps)', MX)))
OFFSET_RMS_NORM = Rule("RMSNorm with weight + 1 (Gemma)", "rms_norm", build_rms_norm(1.0), forwards=(
    Forward("def __call__(self, x):\n    return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)", MX),))

#: Every RoPE layer mlx-lm ships, by exact class.
ROPE_RULES: list[Rule] = [
    Rule("RoPE", "rope", build_rope(KernelRoPE, numbers=("base", "scale")), classes=(nn.RoPE,)),
    Rule("Llama 3 RoPE", "rope", build_rope(KernelFreqsRoPE, freqs=True),
         classes=(f"{_ROPE_UTILS}:Llama3RoPE",)),
    Rule("proportional RoPE", "rope", build_rope(KernelFreqsRoPE, freqs=True),
         classes=(f"{_ROPE_UTILS}:ProportionalRoPE",)),
    Rule("YaRN RoPE", "rope", build_rope(KernelYarnRoPE, freqs=True, numbers=("mscale",)),
         classes=(f"{_ROPE_UTILS}:YarnRoPE",)),
    Rule("LongRoPE (SuScaledRoPE)", "rope",
         build_rope(KernelSuScaledRoPE, "dim", freqs=True, numbers=("_scale",)),
         classes=(f"{_ROPE_UTILS}:SuScaledRoPE",)),
    Rule("dynamic NTK RoPE", "rope",
         build_rope(KernelDynamicRoPE, numbers=("base", "factor", "max_position_embeddings")),
         classes=(f"{_ROPE_UTILS}:DynamicNTKScalingRoPE",)),
]


def stack_rule(name: str, kind: type[KernelDecoderStack], forward: Forward) -> Rule:
    return Rule(name, "add_rms_norm", build_stack(kind), forwards=(forward,),
                when=lambda m: rms_norm_offset(m.get("norm")) is not None)




#: The rules for layers that are not a family's own, in the order they are tried.
LAYER_RULES: list[Rule] = [
    RMS_NORM,
    OFFSET_RMS_NORM,
    Rule("LayerNorm", "layer_norm", build_layer_norm, classes=(nn.LayerNorm,)),
    *ROPE_RULES,
    Rule("SwiGLU MLP", "swiglu", build_gated_mlp(KernelSwiGLUMLP), forwards=(
        mlp_forward("swiglu(self.gate_proj(x), self.up_proj(x))"),
        mlp_forward("nn.silu(self.gate_proj(x)) * self.up_proj(x)"))),
    Rule("GELU", "gelu", lambda m, p: KernelGELU(m), classes=(nn.GELU,),
         when=lambda m: getattr(m, "_approx", None) in ("none", "precise", "tanh")),
    Rule("Softmax", "softmax", lambda m, p: KernelSoftmax(m), classes=(nn.Softmax,)),
    Rule("quantized output layer", "quantized_matvec", lambda m, p: KernelQuantizedOutput(m),
         classes=(nn.QuantizedLinear,), when=readable_quantization, keys=("lm_head",)),
    Rule("quantized embedding (tied output layer)", "quantized_matvec",
         lambda m, p: KernelQuantizedEmbedding(m), classes=(nn.QuantizedEmbedding,),
         when=readable_quantization, keys=("embed_tokens",)),
]
