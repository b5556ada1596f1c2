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

The layers live a module a job: ``base`` (:class:`KernelLayer`, :class:`StandaloneLayer`, the
stock view of patched layers), ``norms``, ``rope``, ``feedforward`` (the MLPs and activations),
``attention``, ``moe`` (the sparse mixture-of-experts block), ``logits`` (a quantized model's
vocabulary projection), ``weights`` (a block's projection
weights as the fused kernels take them), ``block`` (:class:`KernelResidualBlock`) and ``stack``
(:class:`KernelDecoderStack`). Code outside the package imports the layers from here.
"""

from __future__ import annotations

from graphkern.models.layers.attention import FUSED_QKV as FUSED_QKV
from graphkern.models.layers.attention import SEPARATE_QKV as SEPARATE_QKV
from graphkern.models.layers.attention import KernelAttention
from graphkern.models.layers.base import KernelLayer
from graphkern.models.layers.base import StandaloneLayer as StandaloneLayer
from graphkern.models.layers.block import LLAMA_BLOCK as LLAMA_BLOCK
from graphkern.models.layers.block import BlockLayout, KernelResidualBlock
from graphkern.models.layers.feedforward import (
    KernelGateUpMLP,
    KernelGeGLUMLP,
    KernelGELU,
    KernelSoftmax,
    KernelSwiGLU,
    KernelSwiGLUMLP,
)
from graphkern.models.layers.logits import KernelQuantizedEmbedding, KernelQuantizedOutput
from graphkern.models.layers.moe import KernelSparseMoE
from graphkern.models.layers.norms import KernelAddRMSNorm, KernelLayerNorm, KernelRMSNorm
from graphkern.models.layers.rope import (
    KernelDynamicRoPE,
    KernelFreqsRoPE,
    KernelRoPE,
    KernelSuScaledRoPE,
    KernelYarnRoPE,
    Rotary,
)
from graphkern.models.layers.stack import KernelDecoderStack, KernelSlidingDecoderStack

__all__ = [
    "KernelAddRMSNorm",
    "KernelAttention",
    "KernelDecoderStack",
    "KernelDynamicRoPE",
    "KernelFreqsRoPE",
    "KernelGELU",
    "KernelGeGLUMLP",
    "KernelGateUpMLP",
    "KernelLayer",
    "KernelLayerNorm",
    "KernelQuantizedEmbedding",
    "KernelQuantizedOutput",
    "KernelRMSNorm",
    "KernelResidualBlock",
    "KernelRoPE",
    "KernelSlidingDecoderStack",
    "KernelSoftmax",
    "KernelSparseMoE",
    "KernelSuScaledRoPE",
    "KernelSwiGLU",
    "KernelSwiGLUMLP",
    "KernelYarnRoPE",
    "BlockLayout",
    "Rotary",
]
