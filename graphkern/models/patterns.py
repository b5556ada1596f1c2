"""Recognise a layer by what its forward does, not by its class name.

mlx-lm defines the same MLP, the same Gemma RMSNorm, the same transformer block in dozens of model
files, each a class of its own. A :class:`Forward` pattern matches every class whose ``__call__`` is,
statement for statement, the pattern's body (parameter names, comments, annotations and docstrings
aside), provided the globals that body uses (``swiglu``, ``nn``, ``mx``) are the expected objects.

>>> import mlx.nn as nn
>>> rms = Forward('def __call__(self, x):\\n    return mx.fast.rms_norm(x, self["weight"], self.eps)',
...               {"mx": "mlx.core"})
>>> rms.matches(nn.RMSNorm), rms.matches(nn.LayerNorm)
(True, False)
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from graphkern.launching.launch_cache import memoized

__all__ = ["Forward", "forward_fingerprint", "is_class", "module_global"]

_MISSING = object()


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]):
        self.names = names

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id=self.names.get(node.id, node.id), ctx=node.ctx)


def _fingerprint(fdef: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = fdef.args
    params = [a.arg for a in (*args.posonlyargs, *args.args)]
    rename = _Rename({p: f"_arg{i}" for i, p in enumerate(params)})
    body = list(fdef.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    shape = (len(params), [ast.dump(d) for d in args.defaults], args.vararg is not None,
             args.kwarg is not None, [a.arg for a in args.kwonlyargs])
    return repr((shape, [ast.dump(rename.visit(statement)) for statement in body]))


def _parse(source: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    tree = ast.parse(textwrap.dedent(source))
    fdef = tree.body[0] if tree.body else None
    return fdef if isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


@memoized("forward fingerprints", maxsize=1024)
def _function_fingerprint(function: Any) -> str | None:
    try:
        fdef = _parse(inspect.getsource(function))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    return _fingerprint(fdef) if fdef is not None else None


def forward_fingerprint(cls: type) -> str | None:
    """A normalised dump of ``cls.__call__``'s body, or None when its source is not available.

    graphkern's module hooks (installed while tracing) are looked through.
    """
    call = cls.__dict__.get("__call__") or next(
        (k.__dict__["__call__"] for k in cls.__mro__ if "__call__" in k.__dict__), None)
    call = inspect.unwrap(call) if call is not None else None
    if call is None or not inspect.isfunction(call):
        return None
    return _function_fingerprint(call)


@memoized("pattern names", maxsize=None)
def _resolve(path: str) -> Any:
    """``"pkg.mod:attr"`` or ``"pkg.mod"`` -> the object (``_MISSING`` when it cannot be imported)."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return _MISSING
    return getattr(module, attr, _MISSING) if attr else module


def is_class(cls: type, path: str) -> bool:
    """Whether ``cls`` is the class ``"pkg.mod:Name"`` (looked up only when the names agree, so a
    plain model never imports the package).

    >>> import mlx.nn as nn
    >>> is_class(nn.RoPE, "mlx.nn.layers.positional_encoding:RoPE"), is_class(nn.RoPE, "mlx_lm:RoPE")
    (True, False)
    """
    module, _, name = path.partition(":")
    return cls.__module__ == module and cls.__qualname__ == name and _resolve(path) is cls


def module_global(cls: type, name: str) -> Any:
    """The global ``name`` of the module ``cls`` is defined in (None when absent)."""
    module = sys.modules.get(cls.__module__)
    return vars(module).get(name) if module is not None else None


@dataclass(frozen=True)
class Forward:
    """A layer's forward, as the source of a ``def`` whose body is what ``__call__`` must do.

    ``names`` maps each global the body uses to the object it must be in the layer's module
    (``"mlx_lm.models.activations:swiglu"``, ``"mlx.nn"``); a module that rebinds one does not match.
    """

    source: str
    names: Mapping[str, str] = field(default_factory=dict)

    @functools.cached_property
    def fingerprint(self) -> str:
        fdef = _parse(self.source)
        if fdef is None:
            raise ValueError(f"a Forward pattern must be a def, got {self.source!r}")
        return _fingerprint(fdef)

    def matches(self, cls: type) -> bool:
        """Whether instances of ``cls`` compute exactly this forward."""
        if forward_fingerprint(cls) != self.fingerprint:
            return False
        module = sys.modules.get(cls.__module__)
        scope = vars(module) if module is not None else {}
        return all(scope.get(name, _MISSING) is _resolve(path) is not _MISSING
                   for name, path in self.names.items())
