"""Kernel-backed stand-ins for stock layers: same parameters, same attributes, a library kernel inside.

A :class:`KernelLayer` is built from the layer it replaces: it shares that layer's parameters and
child modules (the very same array and module objects, under the same names, so ``parameters()``,
``load_weights`` and optimizers see no difference) and copies its plain attributes (``eps``,
``dims``...). Only ``__call__`` changes. The original is kept, outside the parameter tree, for
``unpatch``.

>>> import mlx.core as mx, mlx.nn as nn
>>> norm = nn.RMSNorm(8)
>>> fast = KernelRMSNorm(norm)
>>> fast.weight is norm.weight, fast.original is norm
(True, True)
>>> bool(mx.allclose(fast(mx.ones((2, 8))), norm(mx.ones((2, 8)))))
True
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from graphkern import kernels as gkk
from graphkern.autodiff import without_vjp

__all__ = [
    "KernelAddRMSNorm",
    "KernelGELU",
    "KernelGeGLUMLP",
    "KernelGateUpMLP",
    "KernelLayer",
    "KernelLayerNorm",
    "KernelRMSNorm",
    "KernelResidualBlock",
    "KernelRoPE",
    "KernelSoftmax",
    "KernelSwiGLU",
    "KernelSwiGLUMLP",
]

_MODULE_INTERNALS = ("_no_grad", "_training")


class _Held:
    """Holds a module as a plain attribute, so it stays out of the parameter tree."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module


class KernelLayer(nn.Module):
    """A stock layer whose forward runs a graphkern library kernel; built from the layer it replaces.

    ``kernel`` names the library kernel (``patch(kernels=[...])`` selects by it); ``original`` is
    the replaced module, which ``unpatch`` puts back.
    """

    kernel: ClassVar[str] = ""

    def __init__(self, original: nn.Module):
        super().__init__()
        for key, value in original.items():
            self[key] = value  # parameters and children: shared, same names
        for key, value in vars(original).items():
            if key not in _MODULE_INTERNALS:
                object.__setattr__(self, key, value)
        self._no_grad = set(original._no_grad)  # frozen parameters stay frozen
        self._training = original._training
        self._gk_original = _Held(original)

    @property
    def original(self) -> nn.Module:
        """The module this one replaced."""
        return self._gk_original.module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's ``forward``. In evaluation mode (``model.eval()``, as ``mlx_lm.load`` leaves
        a model) its launches carry no custom vjp, as inside ``gk.without_vjp()``: an evaluating
        model is not differentiated, and the wrapper costs every launch host time. In training
        mode (``model.train()``) they are differentiable."""
        if self._training:
            return self.forward(*args, **kwargs)
        with without_vjp():
            return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _extra_repr(self) -> str:
        return f"{self.kernel} kernel, replaces {type(self.original).__name__}"


class KernelRMSNorm(KernelLayer):
    """``nn.RMSNorm`` (``offset=1``: Gemma's ``rms_norm(x, 1 + weight)``) on the ``rms_norm`` kernel."""

    kernel = "rms_norm"

    def __init__(self, original: nn.Module, offset: float = 0.0):
        super().__init__(original)
        self._gk_offset = offset

    def scale(self) -> mx.array:
        weight: mx.array = self["weight"]
        return weight + self._gk_offset if self._gk_offset else weight

    def forward(self, x: mx.array) -> mx.array:
        return gkk.rms_norm(x, self.scale(), self.eps)


class KernelAddRMSNorm(KernelRMSNorm):
    """A residual add fused with the RMSNorm after it: ``(x + residual, rms_norm(x + residual))``."""

    kernel = "add_rms_norm"

    def forward(self, x: mx.array, residual: mx.array) -> tuple[mx.array, mx.array]:  # type: ignore[override]
        return gkk.add_rms_norm(x, residual, self.scale(), self.eps)


class KernelLayerNorm(KernelLayer):
    """``nn.LayerNorm`` (with or without weight and bias) on the ``layer_norm`` kernel."""

    kernel = "layer_norm"

    def forward(self, x: mx.array) -> mx.array:
        weight = self.get("weight", None)
        bias = self.get("bias", None)
        return gkk.layer_norm(x, weight, bias, self.eps)


class KernelRoPE(KernelLayer):
    """``nn.RoPE`` on the ``rope`` kernel; ``offset`` is an int or an integer array, as for MLX."""

    kernel = "rope"

    def forward(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return gkk.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
                        offset=offset)


class KernelSwiGLU(KernelLayer):
    """mlx-lm's ``SwiGLU`` activation module, ``(x, gate) -> silu(gate) * x``, on ``swiglu``."""

    kernel = "swiglu"

    def forward(self, x: mx.array, gate: mx.array) -> mx.array:
        return gkk.swiglu(gate, x)


class KernelSwiGLUMLP(KernelLayer):
    """A Llama-style MLP, ``down(silu(gate(x)) * up(x))``, with the gate on the ``swiglu`` kernel."""

    kernel = "swiglu"

    def forward(self, x: mx.array) -> mx.array:
        return self.down_proj(gkk.swiglu(self.gate_proj(x), self.up_proj(x)))


class KernelGateUpMLP(KernelLayer):
    """A Phi-3-style MLP with one fused ``gate_up_proj``: ``down(silu(gate) * up)`` on ``swiglu``."""

    kernel = "swiglu"

    def forward(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(gkk.swiglu(gate, up))


class KernelGeGLUMLP(KernelLayer):
    """A Gemma-style MLP, ``down(gelu(gate(x)) * up(x))``, with the GELU on the ``gelu`` kernel."""

    kernel = "gelu"

    def __init__(self, original: nn.Module, approx: bool = False):
        super().__init__(original)
        self._gk_approx = approx

    def forward(self, x: mx.array) -> mx.array:
        return self.down_proj(gkk.gelu(self.gate_proj(x), approx=self._gk_approx) * self.up_proj(x))


class KernelGELU(KernelLayer):
    """``nn.GELU`` (exact, or ``approx="precise"``/``"tanh"``) on the ``gelu`` kernel."""

    kernel = "gelu"

    def forward(self, x: mx.array) -> mx.array:
        return gkk.gelu(x, approx=self._approx in ("precise", "tanh"))


class KernelSoftmax(KernelLayer):
    """``nn.Softmax`` (over the last axis) on the ``softmax`` kernel."""

    kernel = "softmax"

    def forward(self, x: mx.array) -> mx.array:
        return gkk.softmax(x)


class KernelResidualBlock(KernelLayer):
    """A pre-norm transformer block whose second residual add runs fused with the next RMSNorm.

    Replaces ``h = x + attn(norm1(x)); out = h + ffn(norm2(h))``: ``norm2`` becomes a
    :class:`KernelAddRMSNorm` (in this block only; the original block keeps its norm) that returns
    ``(h, norm2(h))`` from one kernel. ``ffn`` is the name of the feed-forward child.
    """

    kernel = "add_rms_norm"

    def __init__(self, original: nn.Module, ffn: str, norm: KernelAddRMSNorm):
        super().__init__(original)
        self._gk_ffn = ffn
        self.post_attention_layernorm = norm

    def forward(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h, normed = self.post_attention_layernorm(x, r)
        return h + self[self._gk_ffn](normed)
