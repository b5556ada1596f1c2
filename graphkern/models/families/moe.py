"""Sparse mixtures of experts (Mixtral, Qwen 3 MoE): the router's top-k and softmax on one
``moe_route`` kernel, and the switch layers' SwiGLU activation.
"""

from __future__ import annotations

from graphkern.models.layers import KernelSwiGLU
from graphkern.models.patterns import Forward
from graphkern.models.rules import MX, SWIGLU, Rule, build_sparse_moe

__all__ = ["RULES"]

_MIXTRAL_MOE = Forward(
    "def __call__(self, x: mx.array) -> mx.array:\n"
    "    gates = self.gate(x)\n"
    "    k = self.num_experts_per_tok\n"
    "    inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])\n"
    "    scores = mx.take_along_axis(gates, inds, axis=-1)\n"
    "    scores = mx.softmax(scores, axis=-1, precise=True)\n"
    "    y = self.switch_mlp(x, inds)\n"
    "    y = (y * scores[..., None]).sum(axis=-2)\n"
    "    return y\n", MX)

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
    "    return y\n", MX)


#: mlx-lm 0.30 and 0.31's Qwen 3 MoE block: no sharding, and no cast of the weighted sum.
_QWEN3_MOE_EARLIER = Forward(
    "def __call__(self, x: mx.array) -> mx.array:\n"
    "    gates = self.gate(x)\n"
    "    gates = mx.softmax(gates, axis=-1, precise=True)\n"
    "    k = self.top_k\n"
    "    inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]\n"
    "    scores = mx.take_along_axis(gates, inds, axis=-1)\n"
    "    if self.norm_topk_prob:\n"
    "        scores /= mx.sum(scores, axis=-1, keepdims=True)\n"
    "    y = self.switch_mlp(x, inds)\n"
    "    y = (y * scores[..., None]).sum(axis=-2)\n"
    "    return y\n", MX)

RULES: list[Rule] = [
    Rule("sparse mixture of experts (Mixtral): the router's top-k and softmax", "moe_route",
         build_sparse_moe("num_experts_per_tok"), forwards=(_MIXTRAL_MOE,)),
    Rule("sparse mixture of experts (Qwen 3 MoE): the router's softmax and top-k", "moe_route",
         build_sparse_moe("top_k", softmax_first=True, normalize="norm_topk_prob", cast=True),
         forwards=(_QWEN3_MOE,), when=lambda m: getattr(m, "sharding_group", None) is None),
    Rule("sparse mixture of experts (Qwen 3 MoE, mlx-lm 0.30-0.31): the router's softmax and top-k",
         "moe_route", build_sparse_moe("top_k", softmax_first=True, normalize="norm_topk_prob"),
         forwards=(_QWEN3_MOE_EARLIER,)),
    Rule("SwiGLU activation (mlx-lm switch layers)", "swiglu", lambda m, p: KernelSwiGLU(m), forwards=(
        Forward("def __call__(self, x, gate):\n    return swiglu(gate, x)", {"swiglu": SWIGLU}),)),
]
