"""The recorder of a trace: it sees every kernel, collective and module call while ``fn`` runs
inside MLX's capture, tags their outputs so ``graphkern.tracing.capture`` can find them among MLX's
events, and says what each kernel node shows (launch, sources, template floats).
"""

from __future__ import annotations

import contextlib
import inspect
import random
import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..launching import backends
from ..launching.validation import Launch
from ..nodes import Kernel, KernelError, dtype_name, float_from_bits
from .capture import MAGIC, Record

__all__ = ["TraceRecorder", "float_template_names", "kernel_sources", "module_class_name", "reference_source",
           "template_floats"]


class TraceRecorder:
    """Collects the kernel, collective and module calls of one trace and tags their outputs."""

    inspects = True  # launches inside run plain: mx.export_function cannot export custom vjps
    stands_in_collectives = True  # mx.export_function cannot record collectives either

    def __init__(self, modules: dict[int, str] | None = None, tag: bool = True,
                 objects: dict[int, nn.Module] | None = None):
        self.records: dict[int, Record] = {}
        self.modules = modules or {}
        self.objects = objects or {}  # the modules by id, to place a module shared by several parents
        self._placed: dict[tuple[int, int], str] = {}
        self.stack: list[tuple[int, str]] = []
        self.tag = tag
        self.nonce = random.getrandbits(31)
        self.calls = 0
        self.last_record: int | None = None
        self.kernels: dict[int, Kernel] = {}  # the kernel objects launched, by identity
        self.launches: list[Launch | None] = []  # each kernel call's launch, in call order
        self.collectives = 0
        self.group: dict[str, int] = {}  # rank and group_size of the first collective

    @property
    def scope(self) -> str:
        return self.stack[-1][1] if self.stack else ""

    def path_of(self, module: nn.Module) -> str | None:
        """The path of a call of ``module``: its path in the model, or, for one module object held
        by several parents (mlx-lm's MoE layers share one activation; tied layers), its name under
        the module calling it."""
        path = self.modules.get(id(module))
        if path is None or not self.stack:
            return path
        top_id, top = self.stack[-1]
        if not top or path.startswith(top + "."):
            return path
        key = (top_id, id(module))
        placed = self._placed.get(key)
        if placed is None:
            parent = self.objects.get(top_id)
            # anywhere under the caller: a block's experts may call the activation of its
            # switch layer (``block.switch_mlp.activation``) without calling the switch layer
            inside = parent.named_modules() if parent is not None else []
            placed = next((f"{top}.{name}" for name, child in inside if child is module and name), path)
            self._placed[key] = placed
        return placed

    def _tagged(self, record: Record, inputs: list[mx.array], outputs: list[mx.array]) -> list[mx.array]:
        self.records[record.id] = record
        self.last_record = record.id
        if not self.tag:
            return outputs
        tag = mx.array([MAGIC, record.id, self.nonce], dtype=mx.uint32)
        return list(mx.depends(outputs, [*inputs, tag]))

    def kernel_call(self, launch: Launch | None, kernel: Any, inputs: list[mx.array],
                    outputs: list[mx.array], error: KernelError | None,
                    request: dict[str, Any] | None = None) -> list[mx.array]:
        name = kernel.name if isinstance(kernel, Kernel) else "invalid_kernel"
        if isinstance(kernel, Kernel):
            self.kernels[id(kernel)] = kernel
        record = Record(len(self.records), "kernel", name, self.scope, len(outputs),
                        call_index=self.calls, error=error,
                        attrs=_kernel_attrs(launch, kernel, request))
        self.calls += 1
        self.launches.append(launch)
        return self._tagged(record, inputs, outputs)

    def collective_call(self, op: str, attrs: dict[str, Any], inputs: list[mx.array],
                        outputs: list[mx.array]) -> list[mx.array]:
        """Record a collective's stand-in (see ``graphkern.distributed.collectives``)."""
        record = Record(len(self.records), "collective", op, self.scope, len(outputs),
                        call_index=self.collectives, attrs=attrs)
        self.collectives += 1
        self.group = self.group or {"rank": attrs["rank"], "group_size": attrs["group_size"]}
        return self._tagged(record, inputs, outputs)

    def module_call(self, path: str, module: nn.Module, inputs: list[mx.array],
                    outputs: list[mx.array], error: KernelError | None) -> list[mx.array]:
        record = Record(len(self.records), "module", module_class_name(module), path, len(outputs),
                        error=error)
        return self._tagged(record, inputs, outputs)


def module_class_name(module: Any) -> str:
    """The class a module shows in graphs and messages: a layer ``gk.patch`` put on a kernel shows
    the class it replaced (the kernel is a detail of the user's module, not a new identity).

    >>> import mlx.nn as nn, graphkern as gk
    >>> model = nn.Sequential(nn.RMSNorm(4)); _ = gk.patch(model)
    >>> type(model.layers[0]).__name__, module_class_name(model.layers[0])
    ('KernelRMSNorm', 'RMSNorm')
    """
    shown = getattr(module, "shown_class_name", None)
    return shown() if callable(shown) else type(module).__name__


def _kernel_attrs(launch: Launch | None, kernel: Any,
                  request: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a kernel node shows: the launch, or for a launch refused before it ran, the
    configuration that was asked for (so a failed node still says which grid it was given)."""
    if not isinstance(kernel, Kernel):
        return {"kernel": repr(kernel)[:80], "backend": "", "source": None}
    attrs: dict[str, Any] = {"kernel": kernel.name, "source_hash": kernel.source_hash,
                             "source": None, "backend": "", "generated_name": None,
                             "grid": None, "threadgroup": None, "template": [],
                             "input_names": list(kernel.input_names)}
    if launch is not None:
        attrs.update(backend=launch.backend, grid=list(launch.grid),
                     threadgroup=list(launch.threadgroup),
                     template=[[a.name, _template_text(a.value)] for a in launch.template],
                     source=kernel.source_for(launch.backend))
        if launch.backend != "reference":
            attrs["generated_name"] = backends.generated_name(kernel)
    elif request is not None:
        backend = request.get("backend")
        if not isinstance(backend, str):
            with contextlib.suppress(KernelError):
                backend = backends.active_backend()
        attrs.update(backend=backend if isinstance(backend, str) else "",
                     grid=_requested_dims(request.get("grid")),
                     threadgroup=_requested_dims(request.get("threadgroup")),
                     template=_requested_template(request.get("template")))
        if attrs["backend"] in ("metal", "cuda"):
            attrs["source"] = kernel.source_for(attrs["backend"])
    return attrs


def _template_text(value: Any) -> str:
    return dtype_name(value) if isinstance(value, mx.Dtype) else repr(value)


def _requested_dims(value: Any) -> list[Any] | None:
    """A grid or threadgroup as it was given (ints kept, anything else as its repr)."""
    if not isinstance(value, (list, tuple)):
        return None if value is None else [repr(value)[:40]]
    return [v if isinstance(v, int) and not isinstance(v, bool) else repr(v)[:40]
            for v in list(value)[:8]]


def _requested_template(value: Any) -> list[list[str]]:
    out = []
    for item in value if isinstance(value, (list, tuple)) else ():
        name, arg = (item.name, item.value) if hasattr(item, "name") and hasattr(item, "value") \
            else (item if isinstance(item, (list, tuple)) and len(item) == 2 else ("?", item))
        out.append([str(name)[:40], _template_text(arg)[:80]])
    return out


_FLOAT_READ = re.compile(r"(?:__int_as_float|as_type<float>|float_from_bits)\s*\(\s*([A-Za-z_]\w*)\s*\)")


def float_template_names(kernel: Kernel) -> frozenset[str]:
    """The int template arguments ``kernel`` reads back as float32 bits (``__int_as_float(EPS)``
    in CUDA, ``as_type<float>(EPS)`` in Metal, ``float_from_bits(EPS)`` in the reference), as
    the library passes floats such as an epsilon or a scale.

    >>> k = Kernel("k", ["x"], ["y"], cuda="y[0] = x[0] * __int_as_float(SCALE);")
    >>> sorted(float_template_names(k))
    ['SCALE']
    """
    texts = [kernel.metal, kernel.cuda, kernel.header, reference_source(kernel)]
    return frozenset(m.group(1) for text in texts if text for m in _FLOAT_READ.finditer(text))


def template_floats(template: list[list[str]], names: frozenset[str]) -> dict[str, float]:
    """``{"EPS": 1e-05}`` for the template arguments in ``names`` that hold float32 bits.

    >>> template_floats([["EPS", "925353388"], ["N", "4"]], frozenset({"EPS"}))
    {'EPS': 1e-05}
    """
    out = {}
    for name, text in template:
        if name in names:
            with contextlib.suppress(ValueError, OverflowError):
                out[name] = float(f"{float_from_bits(int(text)):.7g}")
    return out


def reference_source(kernel: Kernel) -> str | None:
    """The Python source of ``kernel``'s reference, or None when Python cannot find it."""
    if kernel.reference is None:
        return None
    try:
        return inspect.getsource(kernel.reference)
    except (OSError, TypeError):
        return None


def kernel_sources(kernels: list[Kernel]) -> dict[str, dict[str, str]]:
    """Each kernel's sources by backend (``metal``, ``cuda``, ``reference``: its Python),
    keyed by source hash, for the drawings to show whatever backend the trace ran on."""
    table: dict[str, dict[str, str]] = {}
    for kernel in kernels:
        sources = {"metal": kernel.metal, "cuda": kernel.cuda, "reference": reference_source(kernel)}
        table[kernel.source_hash] = {k: v for k, v in sources.items() if v}
    return table
