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

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern.kernels._base import FLOAT_DTYPES
from graphkern.models.layers import (
    KernelAddRMSNorm,
    KernelGateUpMLP,
    KernelGeGLUMLP,
    KernelGELU,
    KernelLayer,
    KernelLayerNorm,
    KernelResidualBlock,
    KernelRMSNorm,
    KernelRoPE,
    KernelSoftmax,
    KernelSwiGLU,
    KernelSwiGLUMLP,
)
from graphkern.models.patterns import Forward
from graphkern.nodes import KernelError, Status, dtype_name

__all__ = ["RULES", "Patched", "Rule", "kernel_names", "patch", "patched_layers", "unpatch"]

PATCH = "patch a model with graphkern kernels"
_SWIGLU = "mlx_lm.models.activations:swiglu"


@dataclass(frozen=True)
class Rule:
    """How one kind of layer becomes kernel-backed.

    A module matches when its class is one of ``classes`` (exactly) or its forward is one of
    ``forwards``, and ``when`` (if given) accepts it. ``build(module, path)`` checks the module's
    parameters (raising ``KernelError``) and returns the replacement.
    """

    name: str
    kernel: str
    build: Callable[[nn.Module, str], KernelLayer]
    classes: tuple[type, ...] = ()
    forwards: tuple[Forward, ...] = ()
    when: Callable[[nn.Module], bool] | None = None

    def matches(self, module: nn.Module) -> bool:
        cls = type(module)
        if cls not in self.classes and not any(f.matches(cls) for f in self.forwards):
            return False
        return self.when is None or self.when(module)


@dataclass(frozen=True)
class Patched:
    """One replaced layer: where, by which kernel and rule, and what it was."""

    path: str
    kernel: str
    rule: str
    original: str


# ----------------------------------------------------------------------------- parameter checks


def _refuse(path: str, description: str) -> KernelError:
    return KernelError(PATCH, f"{path or '<model>'}: {description}", Status.INVALID_INPUT)


def _float_dtype(dtype: mx.Dtype, what: str, path: str) -> None:
    if dtype not in FLOAT_DTYPES:
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


def _eps(module: nn.Module, path: str) -> None:
    eps = getattr(module, "eps", None)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise _refuse(path, f"eps must be a finite number >= 0, got {eps!r}")


def _child(module: nn.Module, key: str, path: str) -> nn.Module:
    child = module.get(key) if isinstance(module, dict) else None
    if not isinstance(child, nn.Module):
        raise _refuse(path, f"has no {key} layer")
    return child


def _linear(module: nn.Module, key: str, path: str) -> tuple[int, int, mx.Dtype]:
    """(input dims, output dims, output dtype) of a Linear or QuantizedLinear child."""
    layer = _child(module, key, path)
    weight = layer.get("weight")
    if not isinstance(weight, mx.array) or weight.ndim != 2:
        raise _refuse(f"{path}.{key}", "expected a Linear layer with a 2-D weight")
    scales = layer.get("scales")
    if isinstance(scales, mx.array):  # quantized: packed weight, output in the scales' dtype
        bits = getattr(layer, "bits", 32)
        return weight.shape[1] * 32 // bits, weight.shape[0], scales.dtype
    return weight.shape[1], weight.shape[0], weight.dtype


def _same(path: str, what: str, a: tuple[str, Any], b: tuple[str, Any]) -> None:
    if a[1] != b[1]:
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


def _rope(module: nn.Module, path: str) -> KernelLayer:
    dims = getattr(module, "dims", None)
    if isinstance(dims, bool) or not isinstance(dims, int) or dims <= 0 or dims % 2:
        raise _refuse(path, f"RoPE dims must be a positive even int, got {dims!r}")
    return KernelRoPE(module)


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


def _post_norm(block: nn.Module) -> tuple[nn.Module, float] | None:
    """The block's post-attention norm (looked through an earlier patch) and its weight offset."""
    norm = block.get("post_attention_layernorm") if isinstance(block, dict) else None
    if isinstance(norm, KernelRMSNorm):
        return norm.original, norm._gk_offset
    if not isinstance(norm, nn.Module):
        return None
    for rule, offset in ((RMS_NORM, 0.0), (OFFSET_RMS_NORM, 1.0)):
        if rule.matches(norm):
            return norm, offset
    return None


def _residual_block(ffn: str) -> Callable[[nn.Module, str], KernelLayer]:
    def build(module: nn.Module, path: str) -> KernelLayer:
        found = _post_norm(module)
        assert found is not None  # the rule's `when` checked it
        norm, offset = found
        norm_path = f"{path}.post_attention_layernorm"
        _vector(norm, "weight", norm_path)
        _eps(norm, norm_path)
        _child(module, ffn, path)
        return KernelResidualBlock(module, ffn, KernelAddRMSNorm(norm, offset))

    return build


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


_MX = {"mx": "mlx.core"}

RMS_NORM = Rule("RMSNorm", "rms_norm", _rms_norm(0.0), classes=(nn.RMSNorm,), forwards=(
    Forward("def __call__(self, x):\n    return mx.fast.rms_norm(x, self.weight, self.eps)", _MX),
    Forward('def __call__(self, x):\n    return mx.fast.rms_norm(x, self["weight"], self.eps)', _MX)))
OFFSET_RMS_NORM = Rule("RMSNorm with weight + 1 (Gemma)", "rms_norm", _rms_norm(1.0), forwards=(
    Forward("def __call__(self, x):\n    return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)", _MX),))

#: Every rule, in the order they are tried (a block before the layers inside it).
RULES: list[Rule] = [
    *(Rule(f"pre-norm block (residual add + RMSNorm before {ffn})", "add_rms_norm", _residual_block(ffn),
           forwards=(_block(ffn),), when=lambda m: _post_norm(m) is not None)
      for ffn in ("mlp", "block_sparse_moe")),
    RMS_NORM,
    OFFSET_RMS_NORM,
    Rule("LayerNorm", "layer_norm", _layer_norm, classes=(nn.LayerNorm,)),
    Rule("RoPE", "rope", _rope, classes=(nn.RoPE,)),
    Rule("SwiGLU MLP", "swiglu", _gated(KernelSwiGLUMLP), forwards=(
        _mlp("swiglu(self.gate_proj(x), self.up_proj(x))"),
        _mlp("nn.silu(self.gate_proj(x)) * self.up_proj(x)"))),
    Rule("SwiGLU MLP with a fused gate_up_proj (Phi-3)", "swiglu", _gate_up, forwards=(Forward(
        "def __call__(self, x):\n    x = self.gate_up_proj(x)\n    gate, x = mx.split(x, 2, axis=-1)\n"
        "    return self.down_proj(swiglu(gate, x))", {**_MX, "swiglu": _SWIGLU}),)),
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
    """The kernel names ``patch(kernels=...)`` accepts."""
    return sorted({rule.kernel for rule in RULES})


# ----------------------------------------------------------------------------- walking


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
        raise KernelError(PATCH, f'kernels must be "all" or a list of names from {known}, got {kernels!r}',
                          Status.INVALID_INPUT)
    unknown = sorted(set(kernels) - set(known))
    if unknown:
        raise KernelError(PATCH, f"no patch rule uses {unknown}; known kernels: {known}",
                          Status.INVALID_INPUT)
    return set(kernels)


def patch(model: nn.Module, kernels: str | Sequence[str] = "all") -> list[Patched]:
    """Replace every layer of ``model`` that a rule of the selected ``kernels`` matches.

    The replacements share the originals' parameters (same arrays, same names). Nothing changes
    unless every match passes its checks: otherwise ``KernelError`` names the layer and the problem.
    Layers already patched stay as they are; patching twice is harmless.

    >>> import mlx.nn as nn
    >>> model = nn.Sequential(nn.LayerNorm(4), nn.RMSNorm(4))
    >>> [p.path for p in patch(model, kernels=["rms_norm"])]
    ['layers.1']
    """
    rules = [rule for rule in RULES if rule.kernel in _select(kernels)]
    installs: list[tuple[Any, Any, KernelLayer]] = []
    report: list[Patched] = []

    def visit(module: nn.Module, path: str) -> None:
        for container, key, child, child_path in _children(module, path):
            rule = None if isinstance(child, KernelLayer) else next(
                (r for r in rules if r.matches(child)), None)
            if rule is not None:
                child = rule.build(child, child_path)
                installs.append((container, key, child))
                report.append(Patched(child_path, rule.kernel, rule.name,
                                      type(child.original).__qualname__))
            visit(child, child_path)

    visit(model, "")
    for container, key, replacement in installs:
        container[key] = replacement
    return report


def _sync(layer: KernelLayer) -> None:
    """Carry parameters replaced while patched (training, ``update``) back to the originals."""
    original = layer.original
    for key, value in layer.items():
        if isinstance(value, mx.array) and key in original and original[key] is not value:
            original[key] = value
    for _, _, child, _ in _children(layer, ""):
        if isinstance(child, KernelLayer):
            _sync(child)


def unpatch(model: nn.Module) -> list[str]:
    """Put back every layer ``patch`` replaced (the very same module objects); returns their paths.

    Parameters updated while patched are carried over to the originals.
    """
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
    found: dict[str, str] = {}

    def visit(module: nn.Module, path: str) -> None:
        for _, _, child, child_path in _children(module, path):
            if isinstance(child, KernelLayer):
                found[child_path] = child.kernel
            visit(child, child_path)

    visit(model, "")
    return found
