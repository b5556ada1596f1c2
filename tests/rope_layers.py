"""Every RoPE layer mlx-lm ships, for the CPU and GPU tests that compare them patched and stock."""

from __future__ import annotations

from collections.abc import Callable

import mlx.nn as nn
from mlx_lm.models import rope_utils

#: Positions up to 32k: where ulps in the frequencies become visible.
OFFSETS = [0, 4093, 32760]

#: name -> a 64-dims layer, given ``traditional`` (LongRoPE has no such option).
ROPES: dict[str, Callable[[bool], nn.Module]] = {
    "default": lambda t: nn.RoPE(64, traditional=t, base=10000.0),
    "linear": lambda t: nn.RoPE(64, traditional=t, base=500000.0, scale=0.25),
    "llama3": lambda t: rope_utils.Llama3RoPE(64, 8192, t, 500000.0, {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "yarn": lambda t: rope_utils.YarnRoPE(64, t, 32768, 10000, scaling_factor=4.0,
                                          original_max_position_embeddings=4096),
    "su_scaled": lambda t: rope_utils.SuScaledRoPE(64, 10000.0, 131072, 4096,
                                                   long_factor=[1.0 + 0.1 * i for i in range(32)]),
    "proportional": lambda t: rope_utils.ProportionalRoPE(64, 32, t, 10000.0, factor=2.0),
    "dynamic_ntk": lambda t: rope_utils.DynamicNTKScalingRoPE(64, 40000, t, 10000.0, factor=2.0),
}
