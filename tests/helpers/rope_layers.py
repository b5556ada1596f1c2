"""Every RoPE layer mlx-lm ships, for the CPU and GPU tests that compare them patched and stock."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.models import rope_utils

#: Positions up to 32k: where ulps in the frequencies become visible.
OFFSETS = [0, 4093, 32760]

#: name -> a 64-dims layer, given ``traditional`` (LongRoPE has no such option); those of the
#: installed mlx-lm (its older releases lack the newer layers, ``MISSING`` says which).
_ALL: dict[str, Callable[[bool], nn.Module]] = {
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
_CLASSES = {"proportional": "ProportionalRoPE", "dynamic_ntk": "DynamicNTKScalingRoPE"}
MISSING = {name for name, cls in _CLASSES.items() if not hasattr(rope_utils, cls)}
ROPES = {name: make for name, make in _ALL.items() if name not in MISSING}


def needs(name: str) -> pytest.MarkDecorator:
    """Skips a test of RoPE layer ``name`` where the installed mlx-lm has no such layer."""
    return pytest.mark.skipif(name in MISSING,
                              reason=f"mlx-lm {mlx_lm.__version__} has no {_CLASSES.get(name)}")


#: Whether the installed mlx-lm's YarnRoPE takes ``scale`` and ``inverse`` per call (0.32 on).
YARN_CALL_ARGUMENTS = "scale" in inspect.signature(rope_utils.YarnRoPE.__call__).parameters
