"""The patched norms: RMSNorm (Gemma's ``1 + weight`` form too), the RMSNorm that takes the residual
add before it, and LayerNorm."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern import kernels as gkk
from graphkern.models.layers.base import StandaloneLayer


class KernelRMSNorm(StandaloneLayer):
    """``nn.RMSNorm`` (``offset=1``: Gemma's ``rms_norm(x, 1 + weight)``) on the ``rms_norm`` kernel."""

    kernel = "rms_norm"

    def __init__(self, original: nn.Module, offset: float = 0.0):
        super().__init__(original)
        self._gk_offset = offset

    def scale(self) -> mx.array:
        weight: mx.array = self["weight"]
        return weight + self._gk_offset if self._gk_offset else weight

    def forward(self, x: mx.array) -> mx.array:
        if self["weight"].dtype != x.dtype:  # mx.fast.rms_norm promotes; the kernel takes one dtype
            return self.stock(x)  # type: ignore[no-any-return]
        return gkk.rms_norm(x, self.scale(), self.eps)


class KernelAddRMSNorm(KernelRMSNorm):
    """An RMSNorm that takes the residual add before it: ``norm(x)`` is the RMSNorm (on the
    ``rms_norm`` kernel), ``norm(x, residual)`` is ``(x + residual, norm(x + residual))`` from one
    ``add_rms_norm`` kernel, the sum rounded to the dtype first, as the unfused layers do."""

    kernel = "add_rms_norm"

    def forward(self, x: mx.array, residual: mx.array | None = None) -> Any:  # type: ignore[override]
        if residual is None:
            return super().forward(x)
        if not x.dtype == residual.dtype == self["weight"].dtype:
            h = x + residual
            return h, self.stock(h)
        return gkk.add_rms_norm(x, residual, self.scale(), self.eps)

    def stock_call(self, x: mx.array, residual: mx.array | None = None) -> Any:  # type: ignore[override]
        if residual is None:
            return self._gk_stock_forward(self, x)
        h = x + residual
        return h, self._gk_stock_forward(self, h)

    def failed_output(self, x: mx.array, residual: mx.array | None = None) -> Any:
        """What a trace puts in place of a failed call (graphkern.trace): zeros of its outputs."""
        return mx.zeros_like(x) if residual is None else (mx.zeros_like(x), mx.zeros_like(x))


class KernelLayerNorm(StandaloneLayer):
    """``nn.LayerNorm`` (with or without weight and bias) on the ``layer_norm`` kernel."""

    kernel = "layer_norm"

    def forward(self, x: mx.array) -> mx.array:
        weight = self.get("weight", None)
        bias = self.get("bias", None)
        if any(a is not None and a.dtype != x.dtype for a in (weight, bias)):  # mx.fast promotes
            return self.stock(x)  # type: ignore[no-any-return]
        return gkk.layer_norm(x, weight, bias, self.eps)
