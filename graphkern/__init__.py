"""graphkern: custom GPU kernels as first-class nodes of MLX compiled graphs.

>>> import graphkern as gk
>>> gk.Status.OK == 0
True
"""

from __future__ import annotations

from .nodes import Kernel, KernelError, KernelResult, NodeKind, OutputSpec, Status, TemplateArg
from .graph import Failure, Graph, GraphError
from .runtime import active_backend, apply, apply_in_graph, kernel_cache, launch
from .trace import CompiledGraph, compile, trace

__version__ = "0.1.0"

__all__ = [
    "CompiledGraph",
    "Failure",
    "Graph",
    "GraphError",
    "compile",
    "trace",
    "Kernel",
    "KernelError",
    "KernelResult",
    "NodeKind",
    "OutputSpec",
    "Status",
    "TemplateArg",
    "__version__",
    "active_backend",
    "apply",
    "apply_in_graph",
    "kernel_cache",
    "launch",
]
