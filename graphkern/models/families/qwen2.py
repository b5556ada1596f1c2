"""Qwen 2 and 2.5: Llama's blocks with biased query, key and value projections (the fused
projection kernels add the biases after their products), and a decoder loop written for pipeline
parallelism, which the stack links when the model runs whole on one process.
"""

from __future__ import annotations

from graphkern.models.families.llama import EMBED
from graphkern.models.layers import KernelDecoderStack
from graphkern.models.patterns import Forward
from graphkern.models.rules import MASK, MX, Rule, build_stack, rms_norm_offset

__all__ = ["RULES"]

#: mlx-lm's Qwen2Model (and the models sharing its forward): Qwen3Model's with pipeline
#: parallelism, linked only when the model runs whole on one process.
_PIPELINE_STACK = Forward(
    EMBED.replace("    if cache is None:\n        cache = [None] * len(self.layers)\n", "")
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
    "    return self.norm(h)\n", {**MASK, **MX})

RULES: list[Rule] = [
    Rule("decoder stack (Qwen 2): each residual add fused into the next RMSNorm", "add_rms_norm",
         build_stack(KernelDecoderStack), forwards=(_PIPELINE_STACK,),
         when=lambda m: rms_norm_offset(m.get("norm")) is not None and getattr(m, "pipeline_size", 1) == 1
         and len(getattr(m, "pipeline_layers", ())) == len(m.get("layers", ()))),
]
