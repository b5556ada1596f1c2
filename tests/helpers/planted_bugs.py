"""Real bugs planted in real models, for the values tests: a kernel that makes NaNs, a SwiGLU off by
1%, a weight off by 1%.

The first two are kernel-backed layers patched into an 8-layer tiny mlx-lm llama, the way
``gk.patch`` installs the library's kernels: a :class:`KernelLayer` sharing the replaced layer's
parameters. The third is one weight of that llama, patched, scaled in place.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

import graphkern as gk
from graphkern.models import patch
from graphkern.models.layers import KernelLayer
from graphkern.models.tiny import TINY_CONFIGS, random_model

LAYERS = 8
BAD_LAYER = 3
WEIGHT_LAYER = 5  # weight_off_llama's
TOKENS = mx.array([[3, 17, 42, 5, 99, 1, 7, 64], [8, 8, 120, 33, 2, 0, 71, 9]])

NAN_SQRT = gk.Kernel(
    "nan_sqrt", ["x"], ["out"],
    metal="uint i = thread_position_in_grid.x; out[i] = metal::sqrt(x[i] - T(10));",
    cuda="auto i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[0]) out[i] = sqrt(x[i] - T(10));",
    reference=lambda x: [mx.sqrt(x - 10)],  # NaN for every input below 10
)

SWIGLU_OFF = gk.Kernel(
    "swiglu_off", ["gate", "up"], ["out"],
    metal="uint i = thread_position_in_grid.x; T g = gate[i]; "
          "out[i] = g / (T(1) + metal::exp(-g)) * up[i] * T(1.01);",
    cuda="auto i = blockIdx.x * blockDim.x + threadIdx.x; if (i < gate_shape[0]) { T g = gate[i]; "
         "out[i] = g / (T(1) + exp(-g)) * up[i] * T(1.01); }",
    reference=lambda gate, up: [nn.silu(gate) * up * 1.01],  # 1% too large
)


def _launch(kernel: gk.Kernel, inputs: list[mx.array]) -> mx.array:
    x = inputs[0]
    return gk.launch(kernel, inputs, [gk.OutputSpec(x.shape, x.dtype)], grid=(x.size, 1, 1),
                     threadgroup=(min(256, max(1, x.size)), 1, 1), template=[("T", x.dtype)])[0]


class SqrtNorm(KernelLayer):
    """Replaces an RMSNorm: the norm squashed to (0, 1), then ``nan_sqrt``: NaN everywhere."""

    kernel = "nan_sqrt"

    def __call__(self, x: mx.array) -> mx.array:
        small = mx.sigmoid(mx.fast.rms_norm(x, self["weight"], self.eps))  # small positive inputs
        return _launch(NAN_SQRT, [small])


class SwiGLUOff(KernelLayer):
    """Replaces a Llama MLP: ``down(swiglu_off(gate(x), up(x)))``, 1% off."""

    kernel = "swiglu_off"

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(_launch(SWIGLU_OFF, [self.gate_proj(x), self.up_proj(x)]))


def llama(dtype: mx.Dtype = mx.float32, loud: float = 1.0) -> nn.Module:
    """The 8-layer tiny llama (the same weights every time). ``loud`` scales its token embeddings,
    so the residual stream is that many times larger, as in a real checkpoint with massive
    activations: there a node within tolerance can hold a larger abs error than one beyond it."""
    model = random_model({**TINY_CONFIGS["llama"], "num_hidden_layers": LAYERS}, dtype)
    if loud != 1.0:
        model.model.embed_tokens.weight = model.model.embed_tokens.weight * loud
    return model


def nan_llama(dtype: mx.Dtype = mx.float32) -> nn.Module:
    """The llama with layer 3's post-attention norm replaced by :class:`SqrtNorm`."""
    model = llama(dtype)
    layer = model.model.layers[BAD_LAYER]
    layer.post_attention_layernorm = SqrtNorm(layer.post_attention_layernorm)
    return model


def swiglu_off_llama(dtype: mx.Dtype = mx.float32, patch_library: bool = True) -> nn.Module:
    """The llama patched with the library's kernels (``gk.patch``), then layer 3's MLP replaced
    by :class:`SwiGLUOff`."""
    model = llama(dtype)
    if patch_library:
        gk.patch(model)
    layer = model.model.layers[BAD_LAYER]
    mlp = layer.mlp.original if isinstance(layer.mlp, KernelLayer) else layer.mlp
    layer.mlp = SwiGLUOff(mlp)
    return model


def weight_off_llama(dtype: mx.Dtype = mx.float32, loud: float = 1.0) -> nn.Module:
    """The llama (``loud`` as :func:`llama`) patched with the library's kernels (``gk.patch``),
    then layer 5's attention query weight made 1% too large: the first divergence is the weight
    itself (the transpose that reads it), and what it feeds differs from there on."""
    model = llama(dtype, loud)
    patch(model)
    q_proj = model.model.layers[WEIGHT_LAYER].self_attn.q_proj
    q_proj.weight = q_proj.weight * 1.01
    return model


NAN_SCOPE = f"model.layers.{BAD_LAYER}.post_attention_layernorm"
SWIGLU_SCOPE = f"model.layers.{BAD_LAYER}.mlp"
WEIGHT_OFF = f"model.layers.{WEIGHT_LAYER}.self_attn.q_proj.weight"


#: A deep, narrow llama for half-precision comparisons: 32 layers of hidden 128.
DEEP_CONFIG = {**TINY_CONFIGS["llama"], "num_hidden_layers": 32, "hidden_size": 128, "intermediate_size": 256,
               "vocab_size": 256}
DEEP_BAD_LAYER = 20


def deep_llama(dtype: mx.Dtype = mx.bfloat16) -> nn.Module:
    """The 32-layer llama (the same weights every time)."""
    return random_model(DEEP_CONFIG, dtype)


def deep_llama_scaled(dtype: mx.Dtype = mx.bfloat16, weight: str = "self_attn.o_proj",
                      factor: float = 1.01) -> nn.Module:
    """The 32-layer llama with layer 20's ``weight`` 1% too large (``factor``; scaled in float32,
    then rounded to ``dtype``): a real 1% error, below what bfloat16 rounding already makes of a
    patched model."""
    model = deep_llama(dtype)
    module = model.model.layers[DEEP_BAD_LAYER]
    for part in weight.split("."):
        module = getattr(module, part)
    module.weight = (module.weight.astype(mx.float32) * factor).astype(dtype)
    return model
