"""A block's projection weights as the fused kernels take them: plain or affine-quantized weights of
a module's children, their biases, and the row ranges of a fused weight."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from graphkern import kernels as gkk
from graphkern.kernels.ops.quantized_projections import (
    QUANTIZED_BITS,
    QUANTIZED_GROUP_SIZES,
    QuantizedWeight,
    quantized_projections_fit,
)
from graphkern.models.routes import fused_rows
from graphkern.models.segments import row_ranges


def plain_weights(module: nn.Module, names: tuple[str, ...], x: mx.array,
                  biased: bool = False) -> list[mx.array] | None:
    """The weights of ``module``'s children ``names`` when each is a plain ``nn.Linear`` in x's
    dtype (what the projection kernels take), without a bias unless ``biased`` (the caller adds
    :func:`projection_biases` to the products), else None."""
    weights = []
    for name in names:
        linear = module.get(name)
        if type(linear) is not nn.Linear or linear.weight.dtype != x.dtype or not _bias_ok(linear, x, biased):
            return None
        weights.append(linear.weight)
    return weights


def _bias_ok(linear: nn.Module, x: mx.array, biased: bool) -> bool:
    """Whether ``linear``'s bias (if any) can be added to a kernel's product of ``x``."""
    bias = linear.get("bias")
    return bias is None or (biased and bias.dtype == x.dtype)


def projection_biases(module: nn.Module, names: tuple[str, ...]) -> list[mx.array | None]:
    """The biases of ``module``'s children ``names`` (None for a child without one)."""
    return [module[name].get("bias") for name in names]


def every_bias(biases: list[mx.array | None]) -> list[mx.array] | None:
    """``biases`` where every projection has one (what the projection kernels add), else None."""
    present = [b for b in biases if b is not None]
    return present if present and len(present) == len(biases) else None


def rotated_projection_biases(biases: list[mx.array | None],
                              weights: int) -> list[mx.array] | None | Literal[False]:
    """The biases ``quantized_norm_rope_projections`` adds for projections with these ``biases``
    (``weights`` quantized weights): None for none, the three of separate query, key and value
    projections that all have one; False where it cannot (some but not all, or a fused ``qkv_proj``
    with one)."""
    if all(b is None for b in biases):
        return None
    every = every_bias(biases)
    return every if every is not None and weights == 3 else False


def with_biases(products: list[mx.array], biases: list[mx.array | None]) -> list[mx.array]:
    """Each product plus its bias, as ``nn.Linear`` adds it (Qwen 2's query, key and value)."""
    return [p if b is None else p + b for p, b in zip(products, biases)]


class Quantized(NamedTuple):
    """Affine-quantized weights of one kind, as the quantized projection kernels take them."""

    weights: list[QuantizedWeight]
    group_size: int
    bits: int


def read_quantization(linear: Any, biased: bool = False) -> tuple[int, int] | None:
    """``(group_size, bits)`` of an ``nn.QuantizedLinear`` (without a bias unless ``biased``) or an
    ``nn.QuantizedEmbedding`` whose affine weights the quantized kernels read, else None."""
    if (type(linear) not in (nn.QuantizedLinear, nn.QuantizedEmbedding) or ("bias" in linear and not biased)
            or "biases" not in linear or getattr(linear, "mode", "affine") != "affine"):
        return None
    found = (linear.group_size, linear.bits)
    return found if found[0] in QUANTIZED_GROUP_SIZES and found[1] in QUANTIZED_BITS else None


def quantized_weights(module: nn.Module, names: tuple[str, ...], x: mx.array,
                      biased: bool = False) -> Quantized | None:
    """The weights of ``module``'s children ``names`` when each is an ``nn.QuantizedLinear`` the
    quantized kernels read (:func:`read_quantization`; with a bias only if ``biased``), all quantized
    alike, with scales in x's dtype; else None."""
    found = [read_quantization(module.get(name), biased) for name in names]
    if found[0] is None or any(f != found[0] for f in found):
        return None
    linears = [module[name] for name in names]
    if any(linear.scales.dtype != x.dtype or not _bias_ok(linear, x, biased) for linear in linears):
        return None
    weights = [QuantizedWeight(linear.weight, linear.scales, linear.biases) for linear in linears]
    return Quantized(weights, *found[0])


def quantized_note(module: nn.Module, names: tuple[str, ...], biased: bool = False) -> str:
    """What a block says of quantized children ``names`` the quantized kernels cannot read (other
    bit widths, modes other than affine, a bias): they keep their stock products. Empty when there
    are none."""
    odd = [name for name in names if isinstance(module.get(name), nn.QuantizedLinear)
           and read_quantization(module.get(name), biased) is None]
    if not odd:
        return ""
    kinds = sorted({f"{module[n].bits}-bit {getattr(module[n], 'mode', 'affine')}" for n in odd})
    return (f"{', '.join(odd)} ({', '.join(kinds)}): quantization the fused kernels do not read "
            f"(affine, bits {QUANTIZED_BITS}, groups {QUANTIZED_GROUP_SIZES}, no bias); stock products")


def quantized_row_ranges(fused: QuantizedWeight, sizes: Sequence[int]) -> list[QuantizedWeight]:
    """:func:`row_ranges` of a quantized weight: its packed rows, scales and biases alike."""
    return [QuantizedWeight(*parts) for parts in zip(*(row_ranges(part, sizes) for part in fused))]


def halves(rows: int) -> tuple[int, int]:
    """The gate rows and up rows of a fused ``gate_up_proj`` weight of ``rows`` rows."""
    return rows // 2, rows // 2


def few_rows_product(route: str, x: mx.array, weight: QuantizedWeight, group_size: int,
                     bits: int) -> mx.array | None:
    """``x @ dequantize(weight).T`` in one ``quantized_matvec`` launch where a layer on ``route``
    takes x's rows through the quantized kernels (a decoding step's few) and they fit its shared
    memory; else None (the caller's stock product)."""
    if fused_rows(route, x.size // x.shape[-1], quantized=True) and quantized_projections_fit(x, group_size):
        return gkk.quantized_matvec(x, weight, group_size=group_size, bits=bits)  # type: ignore[no-any-return]
    return None
