"""The patched feed-forwards and activations: the gated MLPs (SwiGLU, Phi-3's fused gate and up,
GeGLU), mlx-lm's SwiGLU module, GELU and softmax."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from graphkern import kernels as gkk
from graphkern.models.layers.base import StandaloneLayer


class KernelSwiGLU(StandaloneLayer):
    """mlx-lm's ``SwiGLU`` activation module, ``(x, gate) -> silu(gate) * x``, on ``swiglu``."""

    kernel = "swiglu"
    elementwise = True

    def forward(self, x: mx.array, gate: mx.array) -> mx.array:
        return gkk.swiglu(gate, x)


class KernelSwiGLUMLP(StandaloneLayer):
    """A Llama-style MLP, ``down(silu(gate(x)) * up(x))``, with the gate on the ``swiglu`` kernel."""

    kernel = "swiglu"
    elementwise = True

    def forward(self, x: mx.array) -> mx.array:
        return self.down_proj(gkk.swiglu(self.gate_proj(x), self.up_proj(x)))


class KernelGateUpMLP(StandaloneLayer):
    """A Phi-3-style MLP with one fused ``gate_up_proj``: ``down(silu(gate) * up)`` on ``swiglu``."""

    kernel = "swiglu"
    elementwise = True

    def forward(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(gkk.swiglu(gate, up))


class KernelGeGLUMLP(StandaloneLayer):
    """A Gemma-style MLP, ``down(gelu(gate(x)) * up(x))``, with the GELU on the ``gelu`` kernel
    (``approx``: the tanh form); a fused block decoding a few rows takes its gate and up products and
    the GELU into ``norm_geglu`` instead."""

    kernel = "gelu"
    elementwise = True

    def __init__(self, original: nn.Module, approx: bool = False):
        super().__init__(original)
        self._gk_approx = approx

    def forward(self, x: mx.array) -> mx.array:
        return self.down_proj(gkk.gelu(self.gate_proj(x), approx=self._gk_approx) * self.up_proj(x))


class KernelGELU(StandaloneLayer):
    """``nn.GELU`` (exact, or ``approx="precise"``/``"tanh"``) on the ``gelu`` kernel."""

    kernel = "gelu"
    elementwise = True

    def forward(self, x: mx.array) -> mx.array:
        return gkk.gelu(x, approx=self._approx in ("precise", "tanh"))


class KernelSoftmax(StandaloneLayer):
    """``nn.Softmax`` (over the last axis) on the ``softmax`` kernel."""

    kernel = "softmax"

    def forward(self, x: mx.array) -> mx.array:
        return gkk.softmax(x)
