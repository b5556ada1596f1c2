"""A quantized model's vocabulary projection on ``quantized_matvec`` for the few rows of a decoding
step: ``lm_head`` as an ``nn.QuantizedLinear``, or the tied embedding's ``as_linear`` (Llama 3.2,
Qwen 3, Gemma). It is the largest single product of a small model's step, and stock MLX's product of
one row reads 4-bit weights more slowly than the library's quantized kernels do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern.kernels.ops.quantized_projections import QuantizedWeight
from graphkern.launching.autodiff import vjp_enabled, without_vjp
from graphkern.launching.context import state
from graphkern.models.layers.base import KernelLayer
from graphkern.models.layers.weights import few_rows_product, read_quantization

__all__ = ["KernelQuantizedEmbedding", "KernelQuantizedOutput", "readable_quantization"]


def readable_quantization(module: Any) -> bool:
    """Whether ``module`` is an ``nn.QuantizedLinear`` without a bias or an ``nn.QuantizedEmbedding``
    whose affine weights ``quantized_matvec`` reads (bits 4 or 8, groups of 32, 64 or 128)."""
    return read_quantization(module) is not None


def _product(layer: KernelLayer, x: mx.array, stock: Callable[[Any, mx.array], mx.array]) -> mx.array:
    """``x @ dequantize(layer's weight).T``: one ``quantized_matvec`` launch for the few rows its
    route takes through the quantized kernels (:func:`few_rows_product`), else ``stock(layer, x)``."""
    scales = layer["scales"]
    found = None
    if x.dtype == scales.dtype:
        weight = QuantizedWeight(layer["weight"], scales, layer["biases"])
        found = few_rows_product(layer._gk_call_route, x, weight, layer.group_size, layer.bits)
    return stock(layer, x) if found is None else found


class KernelQuantizedOutput(KernelLayer):
    """A model's ``lm_head`` (an ``nn.QuantizedLinear``) whose product of a decoding step's few rows
    is one ``quantized_matvec`` launch: ``x @ dequantize(W).T``, as the stock layer computes it."""

    kernel = "quantized_matvec"

    def forward(self, x: mx.array) -> mx.array:
        return _product(self, x, self._gk_stock_forward)  # type: ignore[arg-type]


class KernelQuantizedEmbedding(KernelLayer):
    """A quantized embedding (``nn.QuantizedEmbedding``) whose ``as_linear``, the output layer of a
    model with tied embeddings, takes a decoding step's few rows through ``quantized_matvec``; its
    lookup is the stock one."""

    kernel = "quantized_matvec"

    def __call__(self, x: mx.array) -> mx.array:
        """The stock lookup, without a patched layer's checks: it launches no kernel."""
        return self._gk_stock_forward(self, x)  # type: ignore[no-any-return]

    def forward(self, x: mx.array) -> mx.array:
        return self._gk_stock_forward(self, x)  # type: ignore[no-any-return]

    def as_linear(self, x: mx.array) -> mx.array:
        """``x`` times the dequantized embedding table, transposed: the logits of tied embeddings.
        Run as a patched layer's call runs (the stock one inside a forward on the stock layers;
        without a custom vjp in evaluation mode)."""
        stock: Callable[[Any, mx.array], mx.array] = nn.QuantizedEmbedding.as_linear
        if state.stock_layers:
            return stock(self, x)
        if self._training or not vjp_enabled():
            return _product(self, x, stock)
        with without_vjp():
            return _product(self, x, stock)
