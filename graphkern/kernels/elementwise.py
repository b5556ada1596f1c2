"""The launch plan shared by the elementwise kernels (GELU, SwiGLU): one thread per 16-byte vector.

Bodies call ``gk::map`` (CUDA) or loop over their ``V`` elements (Metal); the element count comes
from the first input's shape, so the kernel is compiled once per dtype and vector width, not per size.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from graphkern.kernels.base import Plan, elementwise_config, output_spec, template_arg
from graphkern.nodes import Kernel, TemplateArg

__all__ = ["cuda_map_body", "metal_map_body", "plan_elementwise"]


def cuda_map_body(inputs: Sequence[str], expr: str) -> str:
    """A CUDA body applying ``expr`` (float arguments named like the inputs) elementwise into ``out``."""
    params = ", ".join(f"float {name}" for name in inputs)
    return (f"  gk::map<T, V>(out, gk::numel({inputs[0]}_shape, {inputs[0]}_ndim),\n"
            f"               [&]({params}) {{ return {expr}; }}, {', '.join(inputs)});\n")


def metal_map_body(inputs: Sequence[str], expr: str) -> str:
    """The Metal twin of :func:`cuda_map_body` (no vector loads; the grid is the same)."""
    loads = "".join(f"    const float {name} = static_cast<float>({name}_in[i]);\n" for name in inputs)
    aliases = "".join(f"  auto {name}_in = {name};\n" for name in inputs)
    return (f"{aliases}  const size_t base = size_t(thread_position_in_grid.x) * V;\n"
            f"  for (int j = 0; j < V; ++j) {{\n    const size_t i = base + j;\n{loads}"
            f"    out[i] = static_cast<T>({expr});\n  }}\n")


def plan_elementwise(op: str, kernel: Kernel, inputs: Sequence[mx.array],
                     extra: Sequence[TemplateArg] = (), block: int = 128) -> Plan:
    """One thread per V-element vector of ``inputs[0]`` (all inputs of the same shape and dtype), in
    threadgroups of ``block``."""
    x = inputs[0]
    flat = [a.reshape(1) if a.ndim == 0 else a for a in inputs]
    v, grid, group = elementwise_config(op, x.size, x.dtype, block)
    template = (template_arg("T", x.dtype), template_arg("V", v), *extra)
    return Plan(kernel, tuple(flat), (output_spec(flat[0].shape, x.dtype),), grid, group, template)
