"""Launches checked once and called many times: ``bind``.

``gk.apply`` checks the launch configuration (output specs, grid, threadgroup, template, init
value) on every call: it finds a configuration it has seen by building its key, which is most of
its cost. A ``BoundLaunch`` holds the checked configuration, so a call checks only its inputs, as
``jax.jit(f).lower(...).compile()`` hands back a callable that skips the dispatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from .. import runtime
from ..nodes import Kernel, OutputSpec, TemplateLike
from . import backends, context, launch_paths, validation

__all__ = ["BoundLaunch", "bind"]


class BoundLaunch:
    """A kernel launch whose configuration was checked once (see ``bind``); call it with the
    kernel's inputs. Outside a trace a call is ``gk.apply`` (failures raise ``KernelError``);
    inside a trace or a compiled graph it is ``gk.apply_in_graph`` (failures become the node's
    status), as ``gk.launch`` does. A change of backend (``GRAPHKERN_BACKEND``, ``using_backend``)
    after binding is seen: the call then takes ``gk.apply``'s way."""

    __slots__ = ("kernel", "output_specs", "grid", "threadgroup", "template", "init_value",
                 "backend", "launch", "_setting", "_arity")

    def __init__(self, kernel: Kernel, output_specs: Sequence[OutputSpec], *,
                 grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 template: Sequence[TemplateLike] = (), init_value: float | None = None,
                 backend: str | None = None):
        self.launch = validation.validated_launch(kernel, output_specs, grid, threadgroup, template,
                                               init_value, backend)  # raises KernelError
        self.kernel, self.output_specs, self.backend = kernel, list(output_specs), backend
        self.grid, self.threadgroup = grid, threadgroup
        self.template, self.init_value = list(template), init_value
        self._setting = backend or backends.backend_setting()
        self._arity = len(kernel.input_names)

    def __call__(self, *inputs: Any) -> list[mx.array]:
        if (len(inputs) == self._arity and context.state.recorder is None
                and (self.backend or backends.backend_setting()) == self._setting):
            for value in inputs:
                if value.__class__ is not mx.array:
                    break
            else:  # all arrays, outside traces, on the backend it was bound for
                return launch_paths.run_eager(self.launch, inputs)
        return self._general(list(inputs))

    def _general(self, inputs: list[Any]) -> list[mx.array]:
        """Scalars among the inputs, a trace, a new backend: ``gk.apply``'s or
        ``gk.apply_in_graph``'s way, with every check."""
        keywords: dict[str, Any] = dict(grid=self.grid, threadgroup=self.threadgroup,
                                        template=self.template, init_value=self.init_value,
                                        backend=self.backend)
        if context.current_recorder() is not None:
            return runtime.apply_in_graph(self.kernel, inputs, self.output_specs,
                                          **keywords).outputs
        return runtime.apply(self.kernel, inputs, self.output_specs, **keywords)

    def __repr__(self) -> str:
        return (f"BoundLaunch({self.kernel.name!r}, backend={self.launch.backend!r}, "
                f"grid={self.launch.grid}, threadgroup={self.launch.threadgroup})")


def bind(kernel: Kernel, output_specs: Sequence[OutputSpec], *, grid: tuple[int, int, int],
         threadgroup: tuple[int, int, int], template: Sequence[TemplateLike] = (),
         init_value: float | None = None, backend: str | None = None) -> BoundLaunch:
    """Check a launch configuration now and return it as a callable: for a kernel launched many
    times with one configuration (a layer's forward, a loop), each call then checks only its
    inputs. Raises ``KernelError`` for a bad configuration, as ``gk.apply`` would.

    >>> import mlx.core as mx, graphkern as gk
    >>> k = gk.Kernel("twice", ["x"], ["out"], reference=lambda x: [x * 2])
    >>> twice = gk.bind(k, [gk.OutputSpec((3,), mx.float32)], grid=(3, 1, 1),
    ...                 threadgroup=(3, 1, 1))
    >>> twice(mx.ones((3,)))[0]
    array([2, 2, 2], dtype=float32)
    """
    return BoundLaunch(kernel, output_specs, grid=grid, threadgroup=threadgroup,
                       template=template, init_value=init_value, backend=backend)
