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
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern.models.wrapping import wrap
from graphkern.nodes import Kernel, OutputSpec
from graphkern.runtime import launch

__all__ = ["VIEWS", "Launches", "decode_launches", "fused_ops_as_nodes"]

#: Ops that make a view of their input on a GPU (no kernel), as decoding meets them; ``Split``'s
#: outputs are slices of its input's buffer, as ``Slice``'s.
VIEWS = frozenset({"Reshape", "Transpose", "Flatten", "Unflatten", "ExpandDims", "Squeeze", "Broadcast",
                   "Slice", "Split", "AsStrided", "StopGradient"})
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


class _FusedFronts:
    """The node-recording functions put in front of ``mx.fast``'s fused ops and mlx-lm's ``swiglu``
    bindings, reference-counted as ``ModuleHooks`` and the collective stand-ins are: thread-safe,
    each place patched by the first use that needs it, nested and concurrent uses counted, the
    original put back once, when the last use ends."""

    lock = threading.Lock()
    #: (id of the owner, attribute) -> (owner, original, uses)
    places: dict[tuple[int, str], tuple[Any, Any, int]] = {}

    @classmethod
    def _original(cls, owner: Any, name: str) -> Any:
        held = cls.places.get((id(owner), name))
        return held[1] if held is not None else getattr(owner, name, None)

    @classmethod
    def _wanted(cls) -> list[tuple[Any, str]]:
        wanted: list[tuple[Any, str]] = [(mx.fast, name) for name in _FAST]
        activations = sys.modules.get("mlx_lm.models.activations")
        compiled = cls._original(activations, "swiglu") if activations is not None else None
        if compiled is not None:
            wanted += [(module, "swiglu") for name, module in list(sys.modules.items())
                       if name.startswith("mlx_lm.") and cls._original(module, "swiglu") is compiled]
        return wanted

    @classmethod
    def install(cls) -> list[tuple[int, str]]:
        keys = []
        with cls.lock:
            for owner, name in cls._wanted():
                key = (id(owner), name)
                held = cls.places.get(key)
                if held is None:
                    original = getattr(owner, name)
                    label = "mlx_lm_swiglu" if name == "swiglu" else f"mx_fast_{name}"
                    setattr(owner, name, _as_node(label, original))
                    cls.places[key] = (owner, original, 1)
                else:
                    cls.places[key] = (owner, held[1], held[2] + 1)
                keys.append(key)
        return keys

    @classmethod
    def remove(cls, keys: list[tuple[int, str]]) -> None:
        with cls.lock:
            for key in keys:
                owner, original, uses = cls.places[key]
                if uses == 1:
                    setattr(owner, key[1], original)
                    del cls.places[key]
                else:
                    cls.places[key] = (owner, original, uses - 1)


@contextlib.contextmanager
def fused_ops_as_nodes() -> Iterator[None]:
    """While inside, ``mx.fast``'s fused ops and mlx-lm's compiled ``swiglu`` are one kernel node
    each in a trace (kernels ``mx_fast_rms_norm``..., ``mlx_lm_swiglu``), as they are one launch
    each on a GPU. The functions are patched process-wide (outside a trace they run as before):
    thread-safe, nested and concurrent uses counted, the originals restored when the last use ends.

    >>> import mlx.core as mx
    >>> stock = mx.fast.rms_norm
    >>> with fused_ops_as_nodes():
    ...     with fused_ops_as_nodes():
    ...         patched = mx.fast.rms_norm is not stock
    ...     still = mx.fast.rms_norm is not stock
    >>> patched, still, mx.fast.rms_norm is stock
    (True, True, True)
    """
    keys = _FusedFronts.install()
    try:
        yield
    finally:
        _FusedFronts.remove(keys)


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
