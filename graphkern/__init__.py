"""graphkern: custom GPU kernels as first-class nodes of MLX compiled graphs.

>>> import graphkern as gk
>>> gk.Status.OK == 0
True
"""

from __future__ import annotations

import typing as _typing

from .compiling import CompiledGraph, compile
from .compiling import extensions as _compiling_extensions
from .errors import BackendError, DrawingError, GraphFormatError, GraphkernError, ModelError, PatchWarning
from .launching.autodiff import without_vjp
from .launching.backends import active_backend
from .launching.context import mlx_thread
from .launching.launch_cache import cache_stats, clear_caches
from .launching.mlx_kernels import kernel_cache
from .nodes import Kernel, KernelError, KernelResult, NodeKind, OutputSpec, Status, TemplateArg
from .runtime import BoundLaunch, apply, apply_in_graph, bind, launch
from .tracing import extensions as _tracing_extensions
from .tracing.graph import Failure, Graph, GraphError
from .tracing.traceable import ScopeWarning, trace

if _typing.TYPE_CHECKING:  # the slot fillers' annotations only: nothing more in the package's namespace
    from collections.abc import Iterable, Sequence
    from contextlib import AbstractContextManager
    from typing import Any

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


# ----------------------------------------------------------------------------- the layers' slots
# Tracing and compiling sit below graphkern.distributed and graphkern.debugging and import neither:
# they declare slots (graphkern.tracing.extensions, graphkern.compiling.extensions) and the facade,
# above every layer, fills them here. Each filler imports its module on first use, not here, so
# that `import graphkern` stays light: the distributed and debugging packages load on the first
# trace, compile or check_finite that needs them.


class _Collectives:
    """``graphkern.distributed.collectives``: stand-ins while tracing, collective nodes run again."""

    def standing_in(self, fn: Any, modules: Iterable[Any]) -> AbstractContextManager[None]:
        from .distributed.collectives import standing_in  # lazy: keeps `import graphkern` light

        return standing_in(fn, modules)

    def run_again(self, data: dict[str, Any], inputs: list[Any]) -> list[Any] | str:
        from .distributed.collectives import run_again  # lazy: keeps `import graphkern` light

        return run_again(data, inputs)


def _rank_sync(modules: Sequence[Any], group: Any, timeout: Any) -> Any:
    """``graphkern.distributed.sync.rank_sync``: the ranks' agreement and watchdog."""
    from .distributed.sync import rank_sync  # lazy: keeps `import graphkern` light

    return rank_sync(modules, group, timeout)


def _inspect_values(traceable: Any, flat: Any, backend: str | None) -> Graph:
    """``gk.inspect``'s values run of one call, for ``check_finite``."""
    from .debugging.values import Inspector  # lazy: keeps `import graphkern` light

    return Inspector(backend=backend).run(traceable, flat)


_tracing_extensions.use_collectives(_Collectives())
_compiling_extensions.use_rank_sync(_rank_sync)
_compiling_extensions.use_value_inspector(_inspect_values)

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
