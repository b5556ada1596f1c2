"""``patch``: swap stock layers for kernel-backed ones; ``unpatch``: put the originals back.

Each :class:`~graphkern.models.rules.Rule` recognises one kind of layer (by exact class, or by what
its forward does: see ``patterns``), checks its parameters and builds the
:class:`~graphkern.models.layers.KernelLayer` that replaces it; the families in
``graphkern.models.families`` hold the rules for their own layers, ``graphkern.models.rules`` those
every family shares. ``patch`` checks every match before it changes anything: a layer whose
parameters the kernel cannot take (wrong rank, mismatched sizes or dtypes) raises ``KernelError``
and the model is left as it was.

>>> import mlx.core as mx, mlx.nn as nn
>>> model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8), nn.GELU())
>>> [(p.path, p.kernel) for p in patch(model)]
[('layers.1', 'rms_norm'), ('layers.2', 'gelu')]
>>> unpatch(model)
['layers.1', 'layers.2']
>>> type(model.layers[1]).__name__
'RMSNorm'
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.nn as nn

from graphkern.errors import ModelError, PatchWarning
from graphkern.models.families import gemma, gemma3, llama, moe, phi3, qwen2
from graphkern.models.layers import KernelLayer, KernelResidualBlock
from graphkern.models.routes import check_route
from graphkern.models.rules import LAYER_RULES, PATCH, ROPE_RULES, Rule, building, one_per_module
from graphkern.nodes import Status

__all__ = ["OPT_IN_KERNELS", "PATCH", "ROPE_RULES", "RULES", "PatchReport", "Patched", "Rule", "Unmatched",
           "default_kernels", "kernel_names", "patch", "patched_layers", "set_route", "unpatch"]


@dataclass(frozen=True)
class Patched:
    """One replaced layer: where, by which kernel and rule, and what it was; ``note`` says what of
    it stays stock (a block's projections quantized in a way the fused kernels do not read)."""

    path: str
    kernel: str
    rule: str
    original: str
    note: str = ""


@dataclass(frozen=True)
class Unmatched:
    """A layer that looks like one a kernel replaces (a norm, RoPE, MLP, attention or MoE block, by
    its class name) but that no selected rule matched: where, its class and why."""

    path: str
    original: str
    reason: str


class PatchReport(list[Patched]):
    """What ``patch`` did: the replaced layers (a list of :class:`Patched`) and, as ``unmatched``,
    the layers that look like targets but that no rule matched (:class:`Unmatched`)."""

    def __init__(self, patched: list[Patched], unmatched: list[Unmatched]) -> None:
        super().__init__(patched)
        self.unmatched = unmatched



#: Every rule, in the order they are tried: each family's, then those of layers every family shares.
RULES: list[Rule] = [*llama.RULES, *qwen2.RULES, *phi3.RULES, *gemma.RULES, *gemma3.RULES, *moe.RULES,
                     *LAYER_RULES]


def kernel_names() -> list[str]:
    """The kernel names ``patch(kernels=...)`` accepts: those of the rules, and those fused blocks
    also decode with (``norm_projections``, ``norm_swiglu``, ``norm_geglu`` and their quantized forms)."""
    return sorted({rule.kernel for rule in RULES} | KernelResidualBlock.DECODING_KERNELS)


#: Kernels ``patch`` takes only when asked for by name or with ``kernels="all"``: measured slower
#: than the path without them in whole models. ``quantized_matvec`` (a quantized block's output and
#: down products and the output layer, at a decoding step's few rows) made 4-bit decoding slower
#: on an H100 at Llama 3.2 1B, Qwen3 0.6B and Mistral 7B dimensions than the fused blocks without it.
OPT_IN_KERNELS = frozenset({"quantized_matvec"})


def default_kernels() -> list[str]:
    """What ``patch(model)`` patches onto: every kernel of :func:`kernel_names` but the opt-in ones
    (:data:`OPT_IN_KERNELS`)."""
    return [name for name in kernel_names() if name not in OPT_IN_KERNELS]


# ----------------------------------------------------------------------------- walking


Slot = tuple[Any, Any, nn.Module, str]  # (container, key, child, path)


def _children(module: Any, path: str) -> Iterator[Slot]:
    """Every module directly inside ``module``, with the container and key that hold it."""
    items = module.items() if isinstance(module, dict) else enumerate(module)
    for key, value in list(items):
        child_path = f"{path}.{key}" if path else str(key)
        if isinstance(value, nn.Module):
            yield module, key, value, child_path
        elif isinstance(value, (list, dict)):
            yield from _children(value, child_path)


def _select(kernels: str | Sequence[str]) -> set[str]:
    known = kernel_names()
    if kernels == "default":
        return set(default_kernels())
    if kernels == "all":
        return set(known)
    if isinstance(kernels, str) or not isinstance(kernels, Sequence):
        raise ModelError(PATCH, f'kernels must be "default", "all" or a list of names from {known}, got '
                          f'{kernels!r}', Status.INVALID_INPUT)
    unknown = sorted(set(kernels) - set(known))
    if unknown:
        raise ModelError(PATCH, f"no patch rule uses {unknown}; known kernels: {known}",
                          Status.INVALID_INPUT)
    return set(kernels)


#: Class names that look like a layer some kernel replaces, and the kernels that would.
_LOOKS_LIKE = [(re.compile(r"norm", re.I), {"rms_norm", "layer_norm"}),
               (re.compile(r"rope|rotary", re.I), {"rope", "rope_qk"}),
               (re.compile(r"mlp", re.I), {"swiglu", "gelu"}),
               (re.compile(r"attention|attn", re.I), {"rope_qk"}),
               (re.compile(r"moe", re.I), {"moe_route"})]
#: Class names of what holds layers (``Qwen3MoeModel``, ``Qwen3MoeDecoderLayer``): never a target.
_CONTAINER = re.compile(r"(Model|DecoderLayer|TransformerBlock|ForCausalLM)$")


def _unmatched(module: nn.Module, path: str, selected: frozenset[str]) -> Unmatched | None:
    """``module`` (which no selected rule matched) as an :class:`Unmatched` when its class name
    looks like a target of the selected kernels and no rule at all matches it (one of kernels not
    selected is the caller's choice), else None."""
    name = type(module).__name__
    if _CONTAINER.search(name) or not any(pattern.search(name) and kernels & selected
                                          for pattern, kernels in _LOOKS_LIKE):
        return None
    if any(rule.matches(module) for rule in RULES):
        return None
    refused = [rule.name for rule in RULES if rule.recognises(module)]
    reason = (f"recognised by the rule {refused[0]!r}, whose condition on the layer's settings does "
              f"not hold" if refused else "neither its class nor its forward is one a rule knows")
    return Unmatched(path, f"{type(module).__module__}.{type(module).__qualname__}", reason)


def _warn_unmatched(unmatched: list[Unmatched]) -> None:
    by_kind: dict[tuple[str, str], list[str]] = {}
    for u in unmatched:
        by_kind.setdefault((u.original, u.reason), []).append(u.path)
    lines = [f"{cls} at {', '.join(paths[:3])}{f' and {len(paths) - 3} more' if len(paths) > 3 else ''}"
             f" ({reason})" for (cls, reason), paths in by_kind.items()]
    warnings.warn(PatchWarning(
        f"patch left {len(unmatched)} layer(s) that look like kernel targets running stock: "
        + "; ".join(lines) + ". No rule matched them: a layer graphkern has no kernel for, or a "
        "forward a newer mlx-lm changed; the report's .unmatched lists them"), stacklevel=3)


def patch(model: nn.Module, kernels: str | Sequence[str] = "default", route: str = "auto") -> PatchReport:
    """Replace every layer of ``model`` that a rule of the selected ``kernels`` matches.

    The replacements share the originals' parameters (same arrays, same names). Nothing changes
    unless every match passes its checks: otherwise ``KernelError`` names the layer and the problem.
    Layers already patched stay as they are; patching twice is harmless. A module held at several
    places (tied layers, one norm shared by two blocks) gets one replacement, put at every place,
    so what is assigned through one place still reaches the others. A layer whose class looks
    like a target of the selected kernels (a norm, RoPE, MLP, attention or MoE block) but that no
    rule matched is listed in the report's ``unmatched``, and one ``gk.PatchWarning`` names them all.

    Args:
        model: the model, patched in place.
        kernels: ``"default"`` (every library kernel but the opt-in ``quantized_matvec``, see
            :data:`OPT_IN_KERNELS`), ``"all"``, or the names of the library kernels to patch onto.
        route: how the new layers run each call (``graphkern.models.routes``): ``"auto"`` takes
            the stock op where a standalone kernel cannot pay for itself, ``"kernel"`` always
            the kernel, ``"stock"`` always the stock op.

    Raises:
        KernelError: a matched layer's parameters do not fit its kernel, or an argument is wrong.

    >>> import mlx.nn as nn
    >>> model = nn.Sequential(nn.LayerNorm(4), nn.RMSNorm(4))
    >>> [p.path for p in patch(model, kernels=["rms_norm"])]
    ['layers.1']
    """
    _require_module(model, "patch")
    check_route(PATCH, route)
    selected = frozenset(_select(kernels))
    rules = [rule for rule in RULES if rule.kernel in selected]
    installs: list[tuple[Any, Any, KernelLayer]] = []
    report: list[Patched] = []
    unmatched: list[Unmatched] = []

    def visit(module: nn.Module, path: str) -> None:
        for container, key, child, child_path in _children(module, path):
            rule = None if isinstance(child, KernelLayer) else next(
                (r for r in rules if r.takes(child, key)), None)
            if rule is None and not isinstance(child, KernelLayer):
                missed = _unmatched(child, child_path, selected)
                if missed is not None:
                    unmatched.append(missed)
            if rule is not None:
                child = one_per_module(child, KernelLayer, functools.partial(rule.build, child, child_path))
                child.select(selected)
                _route_layer(child, route)
                # the mode of the model around it: a module can be shared between models (mlx-lm's
                # SwitchGLU takes one default SwiGLU instance), and another model's eval() set its own
                child._training = module._training
                installs.append((container, key, child))
                report.append(Patched(child_path, rule.kernel, rule.name,
                                      type(child.original).__qualname__, child.note()))
            visit(child, child_path)

    token = building.set({})
    try:
        visit(model, "")
    finally:
        building.reset(token)
    for container, key, replacement in installs:
        container[key] = replacement
    if unmatched:
        _warn_unmatched(unmatched)
    return PatchReport(report, unmatched)


def _route_layer(layer: KernelLayer, route: str) -> None:
    """``layer`` and the kernel layers it built inside itself (a block's norms) take ``route``."""
    for _, module in layer.named_modules():
        if isinstance(module, KernelLayer):
            module.use_route(route)


def set_route(model: nn.Module, route: str) -> int:
    """Give every patched layer in ``model`` the route ``route`` (``graphkern.models.routes``);
    returns how many layers there are.

    Raises:
        ModelError: ``route`` is not one of ``"auto"``, ``"kernel"``, ``"stock"``.

    >>> import mlx.nn as nn
    >>> model = nn.Sequential(nn.RMSNorm(8))
    >>> _ = patch(model)
    >>> set_route(model, "kernel")
    1
    """
    _require_module(model, "set_route")
    check_route("set the route of patched layers", route)
    layers = [m for _, m in model.named_modules() if isinstance(m, KernelLayer)]
    for layer in layers:
        layer.use_route(route)
    return len(layers)


def _require_module(model: Any, function: str) -> None:
    """``ModelError`` for what is not an ``nn.Module`` (walking it would fail with a bare TypeError)."""
    if not isinstance(model, nn.Module):
        got = "None" if model is None else f"{type(model).__module__}.{type(model).__qualname__}"
        raise ModelError(PATCH, f"{function} takes an mlx.nn.Module and got {got}", Status.INVALID_INPUT)


def _sync(layer: KernelLayer) -> None:
    """Carry parameters replaced while patched (training, ``update``) back to the originals, and
    child modules replaced while patched (``nn.quantize``'s quantized projections, adapters). Only
    the ones replaced: a layer left out of the model by a later patch (the input norm a fused block
    took over) holds arrays older than its original's."""
    original = layer.original
    for key, value in layer.replaced_arrays().items():
        if key in original:
            original[key] = value
    for key, value in layer.replaced_children().items():
        original[key] = value  # its own kernel layers are put back when unpatch walks into it
    for _, _, child, _ in _children(layer, ""):
        if isinstance(child, KernelLayer):
            _sync(child)


def unpatch(model: nn.Module) -> list[str]:
    """Put back every layer ``patch`` replaced (the very same module objects); returns their paths.
    A replacement held at several places puts its one original back at each.

    What was done to the model while patched is carried over to the originals: updated parameters,
    and child modules put in place of stock ones (``nn.quantize(model)`` after ``patch`` leaves the
    stock layers with the quantized projections).
    """
    _require_module(model, "unpatch")
    restored: list[str] = []

    def visit(module: nn.Module, path: str) -> None:
        for container, key, child, child_path in _children(module, path):
            if isinstance(child, KernelLayer):
                _sync(child)
                child = child.original
                container[key] = child
                restored.append(child_path)
            visit(child, child_path)

    visit(model, "")
    return restored


def patched_layers(model: nn.Module) -> dict[str, str]:
    """``{path: kernel}`` for every kernel-backed layer in ``model``."""
    _require_module(model, "patched_layers")
    found: dict[str, str] = {}

    def visit(module: nn.Module, path: str) -> None:
        for _, _, child, child_path in _children(module, path):
            if isinstance(child, KernelLayer):
                found[child_path] = child.kernel
            visit(child, child_path)

    visit(model, "")
    return found
