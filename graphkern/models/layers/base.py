"""What every patched layer shares: :class:`KernelLayer` (built from the layer it replaces, sharing
its items), :class:`StandaloneLayer` (a layer whose route may run the replaced forward), the stock
view of a tree of patched layers (:func:`stock_tree`, kept current by the guards' ``item_writes``), and
:func:`run_segment`, a layer's compiled segment call."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn

from graphkern.launching import backends
from graphkern.launching.autodiff import vjp_enabled, without_vjp
from graphkern.launching.context import current_recorder, state
from graphkern.launching.fastpaths import BACKEND_VARIABLE, environ_get
from graphkern.models.routes import takes_stock
from graphkern.models.segments import Segments
from graphkern.tracing.guards import same_items

_MODULE_INTERNALS = ("_no_grad", "_training")


class Held:
    """Holds a module (or an array) as a plain attribute, so it stays out of the parameter tree."""

    __slots__ = ("module",)

    def __init__(self, module: Any):
        self.module = module


_dict_get = dict.get


def stock_tree(node: Any) -> Any:
    """``node`` (a module, list or dict) as the stock layers run it: each patched layer the layer
    it replaced, a shallow copy holding the patched layer's current items under the replaced
    layer's names (weights loaded or trained since patching included), or the replaced layer
    itself where it holds just those; a stock module or container with a patched layer under it
    copied over its stock children; the rest itself.

    (The replaced layers themselves, where nothing changed, rather than copies: a copy's objects
    lie apart from the children it shares, and a forward walking them costs the host more.)"""
    if isinstance(node, list):
        items = [stock_tree(v) for v in node]
        return items if any(a is not b for a, b in zip(items, node)) else node
    if not isinstance(node, dict):
        return node
    if isinstance(node, KernelLayer):
        original = node.original
        found = {key: stock_tree(node[key]) for key in original if key in node}
        if all(_same(value, original[key]) for key, value in found.items()):
            return original
        replaced = copy.copy(original)
        for key, value in found.items():
            dict.__setitem__(replaced, key, value)
        return replaced
    found = {key: stock_tree(value) for key, value in node.items()}
    if all(found[key] is value for key, value in node.items()):
        return node
    twin = copy.copy(node)
    for key, value in found.items():
        dict.__setitem__(twin, key, value)
    return twin


def _same(found: Any, held: Any) -> bool:
    """Whether ``found`` (a :func:`stock_tree`) is what ``held`` already is: the same object, or
    a list of the same objects."""
    return found is held or (type(found) is list and type(held) is list and same_items(found, held))


def _item(name: str) -> Any:
    """A name stock forwards read as an attribute (``self.weight``, ``self.down_proj``): the
    layer's item of that name, looked up in its dict first. ``nn.Module`` finds an item only in
    ``__getattr__``, after Python's own lookup failed (an AttributeError made and dropped on
    every read). Without such an item the name is an ordinary attribute: the instance's, else
    what the layer's ``__getattr__`` finds."""

    def get(layer: Any) -> Any:
        if (value := _dict_get(layer, name)) is not None:
            return value
        try:
            return layer.__dict__[name]
        except KeyError:
            raise AttributeError(name) from None  # Python then asks __getattr__

    def set_(layer: Any, value: Any) -> None:
        layer.__dict__[name] = value

    def delete(layer: Any) -> None:
        try:
            del layer.__dict__[name]
        except KeyError:
            raise AttributeError(name) from None

    return property(get, set_, delete)


class KernelLayer(nn.Module):
    """A stock layer whose forward runs a graphkern library kernel; built from the layer it replaces.

    ``kernel`` names the library kernel (``patch(kernels=[...])`` selects by it); ``original`` is
    the replaced module, which ``unpatch`` puts back.
    """

    kernel: ClassVar[str] = ""
    #: Whether its kernel is elementwise (an activation), which ``mx.compile`` fuses from stock ops.
    elementwise: ClassVar[bool] = False
    #: This layer's route (``patch(route=...)``, ``set_route``): set per layer, past the module's items.
    _gk_call_route: str = "auto"

    def __init__(self, original: nn.Module):
        super().__init__()
        for key, value in original.items():
            self[key] = value  # parameters and children: shared, same names
        for key, value in vars(original).items():
            if key not in _MODULE_INTERNALS:
                object.__setattr__(self, key, value)
        self._no_grad = set(original._no_grad)  # frozen parameters stay frozen
        self._training = original._training
        self._gk_original = Held(original)
        # the replaced class's forward, for stock(); not bound to this layer, since a compiled
        # segment calls it on a copy of the layer holding its tracers
        self._gk_stock_forward = type(original).__call__
        self._gk_shared = Held(dict(original.items()))  # what it shares, as built

    @property
    def original(self) -> nn.Module:
        """The module this one replaced."""
        return self._gk_original.module

    def __getattr__(self, key: str) -> Any:
        """A child or parameter by name (``nn.Module``'s lookup), else a property of the replaced
        layer's class read on this layer (Qwen 2's ``pipeline_layers``), as the stock layer has it."""
        # nn.Module's lookup inlined: a stock forward run on this layer reads its children and
        # parameters through here on every call
        if (value := self.get(key)) is not None:
            return value
        held = self.__dict__.get("_gk_original")  # absent while copy.copy rebuilds a layer
        found = getattr(type(held.module), key, None) if held is not None else None
        if isinstance(found, property) and found.fget is not None:
            return found.fget(self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    def replaced_arrays(self) -> dict[str, mx.array]:
        """This layer's arrays that are no longer the ones it shared with the original when built
        (replaced by training or ``update`` while patched), by name."""
        shared = self._gk_shared.module
        return {k: v for k, v in self.items() if isinstance(v, mx.array) and v is not shared.get(k, v)}

    def replaced_children(self) -> dict[str, Any]:
        """This layer's child modules (and lists or dicts of them) put in while patched in place of
        the ones it shared with the original (``nn.quantize``'s ``QuantizedLinear``, a LoRA
        adapter), by name; a kernel layer ``patch`` built from the shared child is not one."""
        shared = self._gk_shared.module
        replaced = {}
        for key, value in self.items():
            if isinstance(value, mx.array) or value is shared.get(key):
                continue
            if isinstance(value, KernelLayer) and value.original is shared.get(key):
                continue  # patched in place of the shared child: unpatch restores that child
            replaced[key] = value
        return replaced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's ``forward``. In evaluation mode (``model.eval()``, as ``mlx_lm.load`` leaves
        a model) its launches carry no custom vjp, as inside ``gk.without_vjp()``: an evaluating
        model is not differentiated, and the wrapper costs every launch host time. In training
        mode (``model.train()``) they are differentiable. Inside a forward that runs the stock
        layers (a short prompt: ``graphkern.models.prefill``) it is the replaced layer's forward on
        this layer's items (:meth:`stock`). (A
        :class:`StandaloneLayer` first asks its route whether the call runs stock.)"""
        if state.stock_layers:  # stock_layers_run(), read directly: this runs on every call
            return self._gk_stock_forward(self, *args, **kwargs)  # stock(): on this layer's items
        if self._training or not vjp_enabled():  # a layer inside an evaluating one: already plain
            return self.forward(*args, **kwargs)
        with without_vjp():
            return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def use_route(self, route: str) -> None:
        """Take ``route`` (``graphkern.models.routes``) from the next call on: ``patch(route=...)``
        and ``set_route`` set it through here."""
        object.__setattr__(self, "_gk_call_route", route)

    def stock(self, *args: Any, **kwargs: Any) -> Any:
        """The replaced layer's own forward on this layer's arrays: for calls the kernel does not
        take (a norm weight in another dtype, which ``mx.fast`` promotes; a block sharded since
        it was patched)."""
        return self._gk_stock_forward(self, *args, **kwargs)

    def stock_call(self, *args: Any, **kwargs: Any) -> Any:
        """A call as the stock layers make it, for this layer's own call signature (a fused
        layer's takes more than the replaced one's): by default :meth:`stock`."""
        return self._gk_stock_forward(self, *args, **kwargs)  # stock(), one call fewer: every call

    def select(self, kernels: frozenset[str]) -> None:
        """Told by ``patch`` which kernels were selected, for a layer that can use more than its
        own (by default it uses only ``kernel``)."""

    def segment_reads(self, name: str) -> tuple[tuple[str, ...], ...] | None:
        """The subtrees (paths of child names) segment ``name`` reads, or None for the whole
        layer: a compiled call takes its arrays one by one, so each one it need not take saves
        host time on every call (``graphkern.models.segments``)."""
        return None

    def segments(self) -> Segments:
        """This layer's compiled segments (see ``graphkern.models.segments``), made on first use."""
        found: Segments | None = self.__dict__.get("_gk_segments")
        if found is None or found.layer() is not self:  # a copy of a layer makes its own
            found = Segments(self)
            object.__setattr__(self, "_gk_segments", found)
        return found

    def shown_class_name(self) -> str:
        """The class graphs, pictures and messages show: the replaced layer's (``graphkern.trace``)."""
        return type(self.original).__name__

    def note(self) -> str:
        """Anything ``patch`` should report of this layer beyond its kernel (empty: nothing)."""
        return ""

    def _extra_repr(self) -> str:
        own = self.original._extra_repr()
        return f"{own}, kernel={self.kernel}" if own else f"kernel={self.kernel}"

    def __repr__(self) -> str:
        """The replaced layer's repr with its kernel: ``RMSNorm(64, eps=1e-05, kernel=rms_norm)``."""
        return self.shown_class_name() + super().__repr__()[len(type(self).__name__):]


class StandaloneLayer(KernelLayer):
    """A patched layer whose kernel fuses nothing that pays for its launch plan (a norm, a RoPE,
    an activation, an MLP): where its route says so (``graphkern.models.routes.takes_stock``) a
    call runs :meth:`stock_call`, for about what the replaced layer's own call costs the host.
    Its first argument has a name, ``x``, as in every stock forward a rule matches it by, so a call
    is not taken apart and put back together on the way."""

    #: Whether :meth:`stock_call` is the replaced layer's forward as it is (a subclass that
    #: overrides it is not), so a stock call can go straight to that forward.
    _gk_plain_stock: ClassVar[bool] = True
    #: The function a stock call runs (the replaced layer's forward, or this class's
    #: ``stock_call`` where it overrides it; called with the layer first) when the route is
    #: ``"auto"`` and a GPU backend is detected, else None (:meth:`use_route` keeps it).
    _gk_auto_stock: Callable[..., Any] | None = None

    # items the replaced layers' forwards read as attributes (mlx's norms and mlx-lm's MLPs and
    # RoPEs), found without nn.Module.__getattr__
    weight = _item("weight")
    bias = _item("bias")
    gate_proj = _item("gate_proj")
    up_proj = _item("up_proj")
    down_proj = _item("down_proj")
    gate_up_proj = _item("gate_up_proj")
    _freqs = _item("_freqs")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._gk_plain_stock = cls.stock_call is StandaloneLayer.stock_call

    def __init__(self, original: nn.Module):
        super().__init__(original)
        self.use_route(self._gk_call_route)

    def use_route(self, route: str) -> None:
        super().use_route(route)
        # the detected backend cannot change in a process: read once here, not on every call
        gpu = backends.gpu_detected()
        stock = self._gk_stock_forward if self._gk_plain_stock else type(self).stock_call
        object.__setattr__(self, "_gk_auto_stock", stock if route == "auto" and gpu else None)

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        stock = self._gk_auto_stock
        if stock is not None and state.plain and not environ_get(BACKEND_VARIABLE):
            # takes_stock's answer on the auto route with a GPU detected, no backend forced and
            # nothing set on this thread (decoding on a GPU), from the fewest reads; a call of
            # one or two positional arguments goes on without packing them
            if not (args or kwargs):
                return stock(self, x)
            if len(args) == 1 and not kwargs:
                return stock(self, x, args[0])
            return stock(self, x, *args, **kwargs)
        if not state.stock_layers and takes_stock(self._gk_call_route, self.elementwise):
            if self._gk_plain_stock:
                return self._gk_stock_forward(self, x, *args, **kwargs)  # stock_call, one call fewer
            return self.stock_call(x, *args, **kwargs)
        return super().__call__(x, *args, **kwargs)

    def stock_call(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self._gk_stock_forward(self, x, *args, **kwargs)


def run_segment(segments: Segments, name: Any, method: Callable[..., Any], *args: Any) -> Any:
    """``segments(name, *args)``: ``method`` compiled, or run as it is where it cannot be (a layer
    that is not a tree of arrays) or while a graphkern trace records the launches (the graph then
    shows the kernels decoding runs). ``method(*args)``, or ``method(*constants, *args)`` for a
    name ``(method, *constants)``."""
    found = segments(name, *args) if segments.usable and current_recorder() is None else None
    if found is not None:
        return found
    return method(*args) if isinstance(name, str) else method(*name[1:], *args)
