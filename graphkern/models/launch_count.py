"""How many kernel launches one decoded token costs: ``decode_launches(model)``, on any backend.

Decoding a token is host-bound (every launch costs host time), so the count is what a fusion buys.
It is read from a ``gk.trace`` of one decode step (a warm KV cache, one new token): every kernel
node is one launch, and so is every op node, except the ops that only make a view of their input
(reshapes, transposes, slices, broadcasts: ``VIEWS``). MLX's fused ops (``mx.fast.rms_norm``,
``layer_norm``, ``rope``, ``scaled_dot_product_attention``) and mlx-lm's compiled ``swiglu``, one
launch each on a GPU, run their CPU fallbacks as several ops; while counting they are recorded as
one node each, so the count is the GPU's on a CPU too.

>>> from graphkern.models.tiny import tiny_model                   # doctest: +SKIP
>>> decode_launches(tiny_model("llama")).total                      # doctest: +SKIP
37
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern.models.wrapping import wrap
from graphkern.nodes import Kernel, OutputSpec
from graphkern.runtime import launch

__all__ = ["VIEWS", "Launches", "decode_launches", "fused_ops_as_nodes"]

#: Ops that make a view of their input on a GPU (no kernel), as decoding meets them.
VIEWS = frozenset({"Reshape", "Transpose", "Flatten", "Unflatten", "ExpandDims", "Squeeze", "Broadcast",
                   "Slice", "AsStrided", "StopGradient"})
_FAST = ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention")


@dataclass
class Launches:
    """Launches of one decode step: ``total`` and how many of each kind (kernel or op name)."""

    total: int
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)

    def __str__(self) -> str:
        return f"{self.total} launches: " + ", ".join(f"{k} {n}" for k, n in self.kinds.most_common())


def _as_node(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` recorded as one kernel node named ``name`` (its reference: ``fn`` itself)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        values = [*args, *kwargs.values()]
        where = [i for i, v in enumerate(values) if isinstance(v, mx.array)]

        def rebuilt(arrays: tuple[mx.array, ...]) -> Any:
            given = list(values)
            for i, a in zip(where, arrays):
                given[i] = a
            return fn(*given[:len(args)], **dict(zip(kwargs, given[len(args):])))

        arrays = [values[i] for i in where]
        out = rebuilt(tuple(arrays))  # lazy: its shape and dtype
        kernel = Kernel(name, [f"in{i}" for i in range(len(arrays))], ["out"],
                        reference=lambda *a: [rebuilt(a)])
        return launch(kernel, arrays, [OutputSpec(tuple(out.shape), out.dtype)], grid=(1, 1, 1),
                      threadgroup=(1, 1, 1))[0]

    return call


@contextlib.contextmanager
def fused_ops_as_nodes() -> Iterator[None]:
    """While inside, ``mx.fast``'s fused ops and mlx-lm's compiled ``swiglu`` are one kernel node
    each in a trace (kernels ``mx_fast_rms_norm``..., ``mlx_lm_swiglu``), as they are one launch
    each on a GPU."""
    saved: list[tuple[Any, str, Any]] = [(mx.fast, name, getattr(mx.fast, name)) for name in _FAST]
    activations = sys.modules.get("mlx_lm.models.activations")
    compiled = getattr(activations, "swiglu", None)
    if compiled is not None:
        saved += [(module, "swiglu", compiled) for name, module in list(sys.modules.items())
                  if name.startswith("mlx_lm.") and getattr(module, "swiglu", None) is compiled]
    try:
        for owner, name, fn in saved:
            label = "mlx_lm_swiglu" if name == "swiglu" else f"mx_fast_{name}"
            setattr(owner, name, _as_node(label, fn))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def decode_launches(model: nn.Module, prompt_length: int = 8, batch: int = 1) -> Launches:
    """The launches of one decoded token of an mlx-lm ``model`` (stock or patched), after a prompt
    of ``prompt_length`` tokens, counted from a trace (see the module's docstring)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.zeros((batch, prompt_length), dtype=mx.int32)
    mx.eval(model(prompt, cache=cache))
    with fused_ops_as_nodes():
        graph = wrap(model).trace(mx.ones((batch, 1), dtype=mx.int32), cache=cache)
    kinds: collections.Counter[str] = collections.Counter()
    for node in graph.kernels():
        kinds[graph.node(node)["kernel"]] += 1
    for node in graph.nodes("op"):
        op = graph.node(node)["op"]
        if op not in VIEWS:
            kinds[op] += 1
    return Launches(sum(kinds.values()), kinds)
