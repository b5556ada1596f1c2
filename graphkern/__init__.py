"""graphkern: custom GPU kernels as first-class nodes of MLX compiled graphs.

>>> import graphkern as gk
>>> gk.Status.OK == 0
True
"""

from __future__ import annotations

from .errors import BackendError, DrawingError, GraphFormatError, GraphkernError, ModelError, PatchWarning
from .launching.autodiff import without_vjp
from .launching.backends import active_backend
from .launching.context import mlx_thread
from .launching.launch_cache import cache_stats, clear_caches
from .launching.mlx_kernels import kernel_cache
from .nodes import Kernel, KernelError, KernelResult, NodeKind, OutputSpec, Status, TemplateArg
from .runtime import BoundLaunch, apply, apply_in_graph, bind, launch
from .trace import ScopeWarning, trace
from .tracing.compiled import CompiledGraph, compile
from .tracing.graph import Failure, Graph, GraphError

__version__ = "0.1.0"

_LAZY = {  # heavier parts, imported on first use so `import graphkern` stays light
    "wrap": "graphkern.models", "patch": "graphkern.models", "unpatch": "graphkern.models",
    "set_route": "graphkern.models",
    "check_model": "graphkern.models", "check": "graphkern.debugging.kernel_checks",
    "diff": "graphkern.viz.graph_diff", "kernels": "graphkern.kernels",
    "inspect": "graphkern.debugging.values", "Inspector": "graphkern.debugging.values",
    "compare": "graphkern.debugging.comparison", "Comparison": "graphkern.debugging.comparison",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(_LAZY[name])
        value = getattr(module, name, module)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'graphkern' has no attribute {name!r}")

__all__ = [
    "BackendError",
    "BoundLaunch",
    "CompiledGraph",
    "Comparison",
    "DrawingError",
    "Failure",
    "Graph",
    "GraphError",
    "GraphFormatError",
    "GraphkernError",
    "Inspector",
    "compile",
    "trace",
    "Kernel",
    "KernelError",
    "KernelResult",
    "ModelError",
    "NodeKind",
    "OutputSpec",
    "PatchWarning",
    "ScopeWarning",
    "Status",
    "TemplateArg",
    "__version__",
    "active_backend",
    "apply",
    "apply_in_graph",
    "bind",
    "cache_stats",
    "check",
    "check_model",
    "clear_caches",
    "compare",
    "diff",
    "inspect",
    "kernel_cache",
    "kernels",
    "launch",
    "mlx_thread",
    "patch",
    "set_route",
    "unpatch",
    "without_vjp",
    "wrap",
]
