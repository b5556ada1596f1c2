"""The Metal source MLX compiles for one launch of a kernel, written as MLX 0.32's ``metal_kernel`` writes it.

``mx.fast.metal_kernel`` (mlx/backend/common/metal_kernel.cpp) builds a kernel's text from the
header, a generated ``[[kernel]]`` signature (``write_signature``), the body and, with template
arguments, an explicit instantiation; ``CustomKernel::eval_gpu`` puts MLX's utils preamble
(``metal::utils()``) in front before handing it to Metal. The rules that matter for whether a body
compiles:

- an input with fewer than 8 elements (``max_constant_array_size``) is ``const constant T*``, any
  other ``const device T*``; a 0-d input is a reference (``&``), not a pointer;
- ``<name>_shape``, ``_strides`` and ``_ndim`` parameters exist only when the body names them;
- a Metal attribute (``thread_position_in_grid`` ...) is a parameter when the body names it;
- template values are spelled as MLX's ``get_type_string`` spells dtypes (``float16_t``,
  ``bfloat16_t``), ints in decimal and bools as ``1``/``0`` (``std::ostream << bool``).

``utils_preamble()`` is ``metal::utils()``: MLX's headers in inclusion order, each without its
``#include "..."`` and ``#pragma once`` lines (mlx/backend/metal/make_compiled_preamble.sh). The
headers are MLX 0.32.4's, from the ``mlx-metal`` wheel, in ``mlx_headers/`` (MIT licence, Apple Inc.).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import mlx.core as mx

from graphkern.launching.backends import mlx_kernel_name
from graphkern.launching.source_text import for_backend
from graphkern.nodes import Kernel, OutputSpec, TemplateArg, dtype_name

__all__ = ["MAX_CONSTANT_ARRAY_SIZE", "METAL_ATTRIBUTES", "ArgInfo", "MetalSource", "metal_source",
           "utils_preamble"]

#: MLX passes an input with fewer elements than this in the ``constant`` address space.
MAX_CONSTANT_ARRAY_SIZE = 8

#: The attributes ``metal_kernel`` adds as parameters when the body names them, in MLX's order.
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# get_type_string (mlx/backend/common/compiled.cpp)
_TYPE_STRING = {
    "bool": "bool", "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
    "int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t", "float16": "float16_t",
    "bfloat16": "bfloat16_t", "float32": "float", "float64": "double", "complex64": "complex64_t",
}

# make_compiled_preamble.sh's order for utils.h: each header after the headers it includes
_PREAMBLE_HEADERS = ("bf16.h", "bf16_math.h", "complex.h", "defines.h", "logging.h", "utils.h")
_LOCAL_INCLUDE = re.compile(r'#include ".*.h"')


def type_string(dtype: mx.Dtype) -> str:
    """MLX's spelling of ``dtype`` in generated sources.

    >>> type_string(mx.bfloat16)
    'bfloat16_t'
    """
    return _TYPE_STRING[dtype_name(dtype)]


@functools.cache
def utils_preamble() -> str:
    """``metal::utils()``: the text MLX puts before every custom kernel's source."""
    folder = resources.files("graphkern.metal_check") / "mlx_headers"
    parts = ["// Copyright © 2025 Apple Inc.\n\n"
             "// Auto generated source for mlx/backend/metal/kernels/utils.h\n\n"]
    for name in _PREAMBLE_HEADERS:
        path = f"mlx/backend/metal/kernels/{name}"
        rule = "/" * 79
        text = (folder / name).read_text()
        kept = [line for line in text.split("\n")
                if not (_LOCAL_INCLUDE.search(line) or "#pragma once" in line)]
        parts.append(f'{rule}\n// Contents from "{path}"\n{rule}\n\n#line 1 "{path}"\n'
                     + "\n".join(kept) + "\n")
    parts.append("/" * 79)
    return "\n" + "".join(parts) + "\n"


@dataclass(frozen=True)
class ArgInfo:
    """What the generated signature needs of one input: its dtype, rank and element count."""

    dtype: mx.Dtype
    ndim: int
    size: int

    @classmethod
    def of(cls, value: object) -> ArgInfo:
        array = value if isinstance(value, mx.array) else mx.array(value)  # type: ignore[arg-type]
        return cls(array.dtype, array.ndim, array.size)

    @property
    def address_space(self) -> str:
        return "constant" if self.size < MAX_CONSTANT_ARRAY_SIZE else "device"


@dataclass(frozen=True)
class MetalSource:
    """One generated kernel: MLX's function name, the text MLX builds (``text``, without the
    preamble), and where the header and body start in it (1-based lines), to map errors back."""

    name: str
    text: str
    header_line: int
    body_line: int
    header: str
    body: str
    #: The template values as MLX's explicit instantiation spells them (``float16_t``, ``256``, ``1``).
    template_values: tuple[str, ...] = ()

    @property
    def full_text(self) -> str:
        """What Metal is handed: MLX's utils preamble, then ``text``."""
        return utils_preamble() + self.text

    def origin(self, line: int) -> tuple[str, int]:
        """Where line ``line`` of ``text`` came from: ``("body", n)``, ``("header", n)`` or
        ``("generated", line)`` (the signature or the instantiation MLX writes)."""
        body_lines = self.body.count("\n") + 1
        # a header without a final line break shares its last line with the generated signature
        header_lines = self.header.count("\n") + (0 if self.header.endswith("\n") or not self.header else 1)
        if self.body_line <= line < self.body_line + body_lines:
            return "body", line - self.body_line + 1
        if self.header_line <= line < self.header_line + header_lines:
            return "header", line - self.header_line + 1
        return "generated", line


def _template_value(value: mx.Dtype | int | bool) -> str:
    if isinstance(value, mx.Dtype):
        return type_string(value)
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _template_hash(template_def: str) -> str:
    """``make_template_hash``: ``<float, 4>`` -> ``_float_4``."""
    out = re.sub(r", ", "_", template_def).replace("<", "_").replace(">", "_")
    return out[:-1]


def metal_source(kernel: Kernel, inputs: Sequence[object], output_specs: Sequence[OutputSpec],
                 template: Sequence[TemplateArg] = ()) -> MetalSource:
    """The Metal text ``mx.fast.metal_kernel`` builds for this launch of ``kernel``.

    ``inputs`` are arrays (or scalars, or :class:`ArgInfo`); only their dtypes, ranks and sizes matter.

    >>> k = Kernel("copy", ["x"], ["y"], metal="y[thread_position_in_grid.x] = x[thread_position_in_grid.x];")
    >>> src = metal_source(k, [mx.zeros(4)], [OutputSpec((4,), mx.float32)])
    >>> print(src.text.splitlines()[1])
      const constant float* x [[buffer(0)]],
    """
    if kernel.metal is None:
        raise ValueError(f"kernel {kernel.name!r} has no Metal source")
    header = for_backend(kernel.header, "metal")
    body = for_backend(kernel.metal, "metal")
    infos = [v if isinstance(v, ArgInfo) else ArgInfo.of(v) for v in inputs]
    name = "custom_kernel_" + mlx_kernel_name(kernel)
    values = tuple(_template_value(t.value) for t in template)
    template_def = ""
    if template:
        template_def = "<" + ", ".join(values) + ">"
        name += "_" + _template_hash(template_def)
    for info in infos:
        passed = "s" if info.ndim == 0 else "c" if info.address_space == "constant" else ""
        name += "_" + type_string(info.dtype) + passed
    for spec in output_specs:
        name += "_" + type_string(spec.dtype)

    out = [header]
    if template:
        kinds = ["typename" if isinstance(t.value, mx.Dtype) else "bool" if isinstance(t.value, bool)
                 else "int" for t in template]
        out.append("template <" + ", ".join(f"{k} {t.name}" for k, t in zip(kinds, template)) + ">\n")
    out.append(f"[[kernel]] void {name}(\n")
    index = 0
    for input_name, info in zip(kernel.input_names, infos):
        ref = "&" if info.ndim == 0 else "*"
        ctype = type_string(info.dtype)
        out.append(f"  const {info.address_space} {ctype}{ref} {input_name} [[buffer({index})]],\n")
        index += 1
        if info.ndim > 0:
            for suffix, ctype in (("_shape", "int*"), ("_strides", "int64_t*"), ("_ndim", "int&")):
                if input_name + suffix in body:
                    out.append(f"  const constant {ctype} {input_name}{suffix} [[buffer({index})]],\n")
                    index += 1
    attributes = [f"  {ctype} {attr} [[{attr}]]" for attr, ctype in METAL_ATTRIBUTES if attr in body]
    for output_name, spec in zip(kernel.output_names, output_specs):
        ctype = f"atomic<{type_string(spec.dtype)}>" if kernel.atomic_outputs else type_string(spec.dtype)
        out.append(f"  device {ctype}* {output_name} [[buffer({index})]]")
        # as MLX writes it: the running buffer index (shape buffers included) against inputs + outputs
        more = index < len(infos) + len(kernel.output_names) - 1 or bool(attributes)
        out.append(",\n" if more else ") {\n")
        index += 1
    for i, attr in enumerate(attributes):
        out.append(attr + (",\n" if i < len(attributes) - 1 else ") {\n"))
    signature_end = "".join(out)
    text = signature_end + body + "\n}\n"
    if template:
        instance = name + template_def
        text += (f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({instance}) {instance};\n')
    header_line = 1
    body_line = signature_end.count("\n") + 1
    return MetalSource(name, text, header_line, body_line, header, body, values)
