"""graphkern's error classes and warnings, by kind, so code can catch what it can handle.

Every error is a :class:`GraphkernError` carrying ``operation`` (what was attempted),
``description`` (what was wrong) and ``status`` (the code the same failure gets on a node)::

    GraphkernError
    └── KernelError            kernels: defining, launching, applying one (graphkern.nodes)
        ├── GraphError         a compiled graph with a failed node was called (graphkern.tracing.graph)
        │   └── GroupError     the ranks of a job cannot run a call together (graphkern.distributed)
        │       └── JobAborted
        │           └── CollectiveTimeout
        ├── GraphFormatError   a graph document that does not load, a graph that fails lint
        ├── BackendError       a backend that is unknown or that a kernel has no source for
        ├── ModelError         a model, layer or cache graphkern cannot wrap, patch or check
        └── DrawingError       a drawing asked for in a format or colouring that does not exist

The kinds derive from ``KernelError`` because it was raised for all of them before they had
their own classes: ``except gk.KernelError`` keeps catching what it caught.

>>> import graphkern as gk
>>> try:
...     gk.Graph.from_json("{")
... except gk.GraphFormatError as exc:
...     print(exc.operation, isinstance(exc, gk.KernelError))
load a graphkern graph from JSON True
"""

from __future__ import annotations

from .nodes import GraphkernError, KernelError

__all__ = ["BackendError", "DrawingError", "GraphFormatError", "GraphkernError", "KernelError", "ModelError",
           "PatchWarning"]


class GraphFormatError(KernelError):
    """A graph document that is not a graphkern graph (``Graph.from_json``, ``graphkern show``),
    or a graph that breaks its own rules (``Graph.lint``)."""


class BackendError(KernelError):
    """A backend that does not exist (``GRAPHKERN_BACKEND``, ``backend=``), or a kernel with no
    source for the backend asked for and no reference (``Status.BACKEND_UNAVAILABLE``)."""


class ModelError(KernelError):
    """A model, layer or cache graphkern cannot take: ``wrap`` of what is not an ``nn.Module``, a
    cache that is not mlx-lm's, a layer whose parameters a kernel cannot take (``patch``), a model
    ``check_model`` cannot check or build."""


class DrawingError(KernelError):
    """A drawing asked for in a way that does not exist: a file suffix or format Graphviz does not
    write, a colouring no node carries."""


class PatchWarning(UserWarning):
    """``patch`` left layers that look like kernel targets (a norm, RoPE, MLP, attention or MoE
    block, by class name) running stock, because no rule matched them; the report's
    ``unmatched`` lists them with the reason."""
