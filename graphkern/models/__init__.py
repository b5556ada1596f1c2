"""Whole models on graphkern: wrap a forward pass as a compiled graph, patch layers onto kernels.

>>> import mlx.core as mx, mlx.nn as nn, graphkern.models as gkm
>>> model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8))
>>> [p.kernel for p in gkm.patch(model)]
['rms_norm']
>>> wrapped = gkm.wrap(model)
>>> _ = wrapped(mx.ones((2, 8)))
>>> [wrapped.graph.node(k)["scope"] for k in wrapped.graph.kernels()]
['layers.1']
"""

from __future__ import annotations

from graphkern.models.launch_count import Launches, decode_launches
from graphkern.models.layers import KernelLayer
from graphkern.models.model_checks import MODEL_TOLERANCES, check_model
from graphkern.models.patching import (
    OPT_IN_KERNELS,
    RULES,
    Patched,
    Rule,
    default_kernels,
    kernel_names,
    patch,
    patched_layers,
    set_route,
    unpatch,
)
from graphkern.models.patterns import Forward
from graphkern.models.routes import ROUTES
from graphkern.models.wrapping import WrappedModel, wrap

__all__ = [
    "ROUTES",
    "RULES",
    "Forward",
    "KernelLayer",
    "Launches",
    "MODEL_TOLERANCES",
    "OPT_IN_KERNELS",
    "Patched",
    "Rule",
    "WrappedModel",
    "check_model",
    "decode_launches",
    "default_kernels",
    "kernel_names",
    "patch",
    "patched_layers",
    "set_route",
    "unpatch",
    "wrap",
]
