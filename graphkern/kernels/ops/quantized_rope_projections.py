"""An attention block's whole decoding prologue in one launch, for affine-quantized projections:
``rms_norm(x + residual)``, its query, key and value products (``quantized_norm_projections``),
and the RoPE of queries and keys in attention's layouts (``rope_qk`` without head norms).

Queries come out in the projections' ``(B, L, heads, D)`` order and are returned as their
``(B, heads, L, D)`` view, keys in the KV cache's ``(B, kv_heads, L, D)`` order, values as their
projection ``(B, L, kv_heads * D)``: what ``quantized_norm_projections`` and then ``rope_qk``
return, with the same rounding (each product rounded to the dtype, then rotated in float32 and
rounded once). One launch fewer a block than the two kernels apart, and decoding is host-bound:
each launch costs the host more than the GPU spends on it.

CUDA: as ``quantized_norm_projections``, but every warp takes two features: a rotation pair of
one head (features ``i`` and ``i + dims / 2``, or ``2i`` and ``2i + 1`` for the traditional RoPE),
two features past ``dims``, or two rows of values. It makes their two products, then lane ``m``
rotates (or copies) token row ``m``. Metal: the same with a simdgroup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from graphkern.kernels.base import Case, Plan, template_arg, unused_input
from graphkern.kernels.declaration import declare
from graphkern.kernels.headers import dual_header
from graphkern.kernels.norm_rows import stock_normed
from graphkern.kernels.ops.quantized_projections import (
    QUANTIZED_CUDA,
    QUANTIZED_METAL,
    QUANTIZED_METAL_START,
    QUANTIZED_NORM_PROJECTIONS,
    Rotation,
    plan_quantized_rows,
    quantized_case,
    quantized_cuda_rows,
    quantized_norm_projections_reference,
    quantized_prefetch,
    quantized_product,
)
from graphkern.kernels.ops.rms_norm import RMS_SCALE_CUDA
from graphkern.kernels.ops.rope import (
    GPU_FORMULA_TOLERANCES,
    ROPE_CUDA,
    ROPE_METAL,
    launch_freqs,
    launch_offset,
    offset_input,
    rotary_template,
)
from graphkern.kernels.ops.rope_qk import MAX_HEAD_DIM, check_head_counts, rope_qk_reference, stock_prologue
from graphkern.nodes import Kernel, KernelError, Status, dtype_name

__all__ = ["QUANTIZED_NORM_ROPE_PROJECTIONS", "ROTATED_MAX_ROWS", "plan_quantized_norm_rope_projections",
           "quantized_norm_rope_projections", "rotated_case"]

#: Rows up to which a patched block decodes through this kernel rather than
#: ``quantized_norm_projections`` and ``rope_qk``. A warp makes two products here, so a launch has
#: half the warps: past a few rows that costs more device time than the launch it saves on a step
#: the host bounds (benchmarks/RESULTS_generate.md). At 2 rows its registers and occupancy are
#: about the unfused kernel's.
ROTATED_MAX_ROWS = 2

# A warp a unit of two features: the query heads' units, the key heads', then the values'. A head
# has D / 2 units: its HALF rotation pairs, then its features past dims two by two (copied); the
# values go two rows at a time. One text for both backends (QUALIFIER: CUDA's or Metal's).
_UNIT = r"""
namespace gk {

struct RotatedUnit {
  int kind;  // 0 queries, 1 keys, 2 values
  int head;
  int j;     // the unit within its head (or among the values)
  bool pair; // a rotation pair: features d1 and d2 rotated together
  int d1;
  int d2;
};

template <int D, int HALF, bool TRADITIONAL>
QUALIFIER RotatedUnit rotated_unit(int row, int hq, int hk) {
  const int qk_units = (hq + hk) * (D / 2);
  RotatedUnit u;
  u.kind = row < hq * (D / 2) ? 0 : row < qk_units ? 1 : 2;
  const int v = u.kind == 0 ? row : u.kind == 1 ? row - hq * (D / 2) : row - qk_units;
  u.head = u.kind == 2 ? 0 : v / (D / 2);
  u.j = u.kind == 2 ? v : v - u.head * (D / 2);
  u.pair = u.kind != 2 && u.j < HALF;
  u.d1 = u.pair ? (TRADITIONAL ? 2 * u.j : u.j) : 2 * u.j;
  u.d2 = u.pair ? (TRADITIONAL ? 2 * u.j + 1 : u.j + HALF) : 2 * u.j + 1;
  return u;
}

}  // namespace gk
"""

# Every warp runs the same two products: NVRTC given a branch with a third copy of them spills
# registers from 4 rows on.
_CUDA_ROTATED = quantized_cuda_rows("gk::aligned<4>(w0) && gk::aligned<4>(w1) && gk::aligned<4>(w2)", r"""
  const int heads = w0_shape[0] / D;
  const int kv_heads = w1_shape[0] / D;
  if (row < (heads + kv_heads) * (D / 2) + w2_shape[0] / 2) {
    const gk::RotatedUnit unit = gk::rotated_unit<D, HALF, TRADITIONAL>(row, heads, kv_heads);
    const uint32_t* wq = unit.kind == 0 ? w0 : unit.kind == 1 ? w1 : w2;
    const T* sc = unit.kind == 0 ? scales0 : unit.kind == 1 ? scales1 : scales2;
    const T* bi = unit.kind == 0 ? biases0 : unit.kind == 1 ? biases1 : biases2;
    const long long r1 = static_cast<long long>(unit.head) * D + unit.d1;
    const long long r2 = static_cast<long long>(unit.head) * D + unit.d2;"""
    + quantized_prefetch("wq", "sc", "bi", "r1") + quantized_prefetch("wq", "sc", "bi", "r2") + r"""
  }""", r"""
    constexpr int WORDS = K * BITS / 32;
    constexpr int G = K / GS;
    const int hq = w0_shape[0] / D;
    const int hk = w1_shape[0] / D;
    const int qk_units = (hq + hk) * (D / 2);
    const int lane = threadIdx.x & 31;
    if (row < qk_units + w2_shape[0] / 2) {
      const gk::RotatedUnit unit = gk::rotated_unit<D, HALF, TRADITIONAL>(row, hq, hk);
      const int kind = unit.kind;
      const int head = unit.head;
      const int j = unit.j;
      const bool pair = unit.pair;
      const int d1 = unit.d1;
      const int d2 = unit.d2;
      const uint32_t* wq = kind == 0 ? w0 : kind == 1 ? w1 : w2;
      const T* sc = kind == 0 ? scales0 : kind == 1 ? scales1 : scales2;
      const T* bi = kind == 0 ? biases0 : kind == 1 ? biases1 : biases2;
      T* out = kind == 0 ? y0 : kind == 1 ? y1 : y2;
      const long long r1 = static_cast<long long>(head) * D + d1;
      const long long r2 = static_cast<long long>(head) * D + d2;
      float a[M];
      float c[M];
      gk::quantized_row_dot<T, M, K, BITS, GS, WV>(wq + r1 * WORDS, sc + r1 * G, bi + r1 * G, xs, xsum, a);
      gk::quantized_row_dot<T, M, K, BITS, GS, WV>(wq + r2 * WORDS, sc + r2 * G, bi + r2 * G, xs, xsum, c);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (lane == m) {
          const int b = m / L;
          const int l = m - b * L;
          // queries and values keep the projections' (B, L, H, D) order; keys go in (B, H, L, D) order
          const long long at = kind == 0 ? (static_cast<long long>(m) * hq + head) * D
                               : kind == 1 ? ((static_cast<long long>(b) * hk + head) * L + l) * D
                                           : static_cast<long long>(m) * w2_shape[0];
          float o1 = a[m];
          float o2 = c[m];
          if constexpr (HAS_BIAS) {  // nn.Linear's bias: on the product rounded, rounded again
            const T* pb = kind == 0 ? pb0 : kind == 1 ? pb1 : pb2;
            o1 = gk::round_to<T>(gk::round_to<T>(o1) + static_cast<float>(pb[r1]));
            o2 = gk::round_to<T>(gk::round_to<T>(o2) + static_cast<float>(pb[r2]));
          }
          if (pair) {
            const float inv_freq = gk::rope_inv_freq<FREQS>(freqs, j, HALF, __int_as_float(LOG2_BASE));
            const float pos = __int_as_float(SCALE) * static_cast<float>(l + offset[PER_BATCH ? b : 0]);
            const float theta = pos * inv_freq;
            const float cs = cosf(theta);
            const float sn = sinf(theta);
            const float x1 = gk::in_scaled<T, IN_SCALE>(gk::round_to<T>(o1));
            const float x2 = gk::in_scaled<T, IN_SCALE>(gk::round_to<T>(o2));
            o1 = x1 * cs - x2 * sn;
            o2 = x1 * sn + x2 * cs;
          }
          out[at + d1] = static_cast<T>(o1);
          out[at + d2] = static_cast<T>(o2);
        }
      }
    }""")

_METAL_ROTATED = QUANTIZED_METAL_START + r"""
  const int hq = w0_shape[0] / D;
  const int hk = w1_shape[0] / D;
  const int qk_units = (hq + hk) * (D / 2);
  if (row >= qk_units + int(w2_shape[0]) / 2) {
    return;
  }
  const gk::RotatedUnit unit = gk::rotated_unit<D, HALF, TRADITIONAL>(row, hq, hk);
  const int kind = unit.kind;
  const int head = unit.head;
  const int j = unit.j;
  const bool pair = unit.pair;
  const int d1 = unit.d1;
  const int d2 = unit.d2;
  const size_t r1 = size_t(head) * D + d1;
  const size_t r2 = size_t(head) * D + d2;
  float c[M];
  if (kind == 0) {
    gk::quantized_row_dot<T, M, K, BITS, GS>(w0 + r1 * WORDS, scales0 + r1 * G, biases0 + r1 * G,
                                             xs, lane, acc);
    gk::quantized_row_dot<T, M, K, BITS, GS>(w0 + r2 * WORDS, scales0 + r2 * G, biases0 + r2 * G,
                                             xs, lane, c);
  } else if (kind == 1) {
    gk::quantized_row_dot<T, M, K, BITS, GS>(w1 + r1 * WORDS, scales1 + r1 * G, biases1 + r1 * G,
                                             xs, lane, acc);
    gk::quantized_row_dot<T, M, K, BITS, GS>(w1 + r2 * WORDS, scales1 + r2 * G, biases1 + r2 * G,
                                             xs, lane, c);
  } else {
    gk::quantized_row_dot<T, M, K, BITS, GS>(w2 + r1 * WORDS, scales2 + r1 * G, biases2 + r1 * G,
                                             xs, lane, acc);
    gk::quantized_row_dot<T, M, K, BITS, GS>(w2 + r2 * WORDS, scales2 + r2 * G, biases2 + r2 * G,
                                             xs, lane, c);
  }
  for (int m = 0; m < M; ++m) {
    if (int(lane) != m) {
      continue;
    }
    const int b = m / L;
    const int l = m - b * L;
    // queries and values keep the projections' (B, L, H, D) order; keys go in (B, H, L, D) order
    const size_t at = kind == 0 ? (size_t(m) * size_t(hq) + size_t(head)) * size_t(D)
                      : kind == 1 ? ((size_t(b) * size_t(hk) + size_t(head)) * size_t(L) + size_t(l)) * D
                                  : size_t(m) * size_t(w2_shape[0]);
    float o1 = acc[m];
    float o2 = c[m];
    if (HAS_BIAS) {  // nn.Linear's bias: on the product rounded, rounded again
      float b1 = 0.0f;
      float b2 = 0.0f;
      if (kind == 0) {
        b1 = static_cast<float>(pb0[r1]);
        b2 = static_cast<float>(pb0[r2]);
      } else if (kind == 1) {
        b1 = static_cast<float>(pb1[r1]);
        b2 = static_cast<float>(pb1[r2]);
      } else {
        b1 = static_cast<float>(pb2[r1]);
        b2 = static_cast<float>(pb2[r2]);
      }
      o1 = gk::round_to<T>(gk::round_to<T>(o1) + b1);
      o2 = gk::round_to<T>(gk::round_to<T>(o2) + b2);
    }
    if (pair) {
      const float inv_freq = gk::rope_inv_freq<FREQS>(freqs, j, HALF, as_type<float>(LOG2_BASE));
      const float pos = as_type<float>(SCALE) * float(l + offset[PER_BATCH ? b : 0]);
      const float theta = pos * inv_freq;
      const float cs = metal::fast::cos(theta);
      const float sn = metal::fast::sin(theta);
      const float x1 = gk::in_scaled<T, IN_SCALE>(gk::round_to<T>(o1));
      const float x2 = gk::in_scaled<T, IN_SCALE>(gk::round_to<T>(o2));
      o1 = x1 * cs - x2 * sn;
      o2 = x1 * sn + x2 * cs;
    }
    if (kind == 0) {
      y0[at + d1] = static_cast<T>(o1);
      y0[at + d2] = static_cast<T>(o2);
    } else if (kind == 1) {
      y1[at + d1] = static_cast<T>(o1);
      y1[at + d2] = static_cast<T>(o2);
    } else {
      y2[at + d1] = static_cast<T>(o1);
      y2[at + d2] = static_cast<T>(o2);
    }
  }
"""


def quantized_norm_rope_projections_reference(
        x: mx.array, residual: mx.array, w: mx.array, w0: mx.array, scales0: mx.array, biases0: mx.array,
        w1: mx.array, scales1: mx.array, biases1: mx.array, w2: mx.array, scales2: mx.array,
        biases2: mx.array, offset: mx.array, freqs: mx.array, pb0: mx.array, pb1: mx.array, pb2: mx.array,
        *, D: int, HALF: int, TRADITIONAL: bool, FREQS: bool, BASE: int, SCALE: int, IN_SCALE: int,
        PER_BATCH: bool, HAS_BIAS: bool, **launch: Any) -> list[mx.array]:
    """Stock MLX, in the stock layers' order: the norm and products of
    ``quantized_norm_projections_reference``, the projections' biases added as ``nn.Linear`` adds
    them (when HAS_BIAS), then the RoPE of ``rope_qk_reference``."""
    h, q, k, v = quantized_norm_projections_reference(x, residual, w, w0, scales0, biases0, w1, scales1,
                                                      biases1, w2, scales2, biases2, **launch)
    if HAS_BIAS:
        q, k, v = q + pb0, k + pb1, v + pb2
    unused = mx.zeros((1,), x.dtype)
    q_out, k_out = rope_qk_reference(q, k, offset, freqs, unused, unused, D=D, NORM=False, EPS=0, SCALE=SCALE,
                                     TRADITIONAL=TRADITIONAL, HALF=HALF, FREQS=FREQS, BASE=BASE,
                                     IN_SCALE=IN_SCALE, PER_BATCH=PER_BATCH)
    return [h, q_out, k_out, v]


QUANTIZED_NORM_ROPE_PROJECTIONS = Kernel(
    "gk_quantized_norm_rope_projections",
    input_names=[*QUANTIZED_NORM_PROJECTIONS.input_names, "offset", "freqs", "pb0", "pb1", "pb2"],
    output_names=["h", "y0", "y1", "y2"],
    metal=_METAL_ROTATED,
    cuda=_CUDA_ROTATED,
    header=dual_header(RMS_SCALE_CUDA + ROPE_CUDA + QUANTIZED_CUDA
                       + _UNIT.replace("QUALIFIER", "__device__ inline"),
                       ROPE_METAL + QUANTIZED_METAL + _UNIT.replace("QUALIFIER", "inline"),
                       body=_CUDA_ROTATED),
    reference=quantized_norm_rope_projections_reference,
)


def _rotation(op: str, x: mx.array, projections: Any, heads: int, kv_heads: int, dims: int, *,
              traditional: bool, base: float | None, scale: float, offset: int | mx.array,
              freqs: mx.array | None, input_scale: float, biases: Sequence[mx.array] | None) -> Rotation:
    """The rotation a launch adds, checked; the head size comes from the query projection's rows;
    with ``biases``, the three projections' biases added to their products before it."""
    if not isinstance(projections, (list, tuple)) or len(projections) != 3:
        raise KernelError(op, f"projections must be 3 (weight, scales, biases) triples (queries, keys, "
                          f"values), got {projections!r:.80}", Status.INVALID_INPUT)
    if x.ndim != 3:
        raise KernelError(op, f"x must be (B, L, K), got shape {tuple(x.shape)}", Status.INVALID_INPUT)
    check_head_counts(op, heads, kv_heads)
    first = projections[0]
    rows = first[0].shape[0] if isinstance(first, (list, tuple)) and isinstance(first[0], mx.array) else 0
    if rows % heads or (rows // heads) % 2 or not 0 < rows // heads <= MAX_HEAD_DIM:
        raise KernelError(op, f"the query projection's {rows} rows are not heads={heads} heads of an even "
                          f"number of features up to {MAX_HEAD_DIM}", Status.INVALID_INPUT)
    d = rows // heads
    template, table = rotary_template(op, d, dims, traditional=traditional, base=base, freqs=freqs,
                                      scale=scale, input_scale=input_scale)
    off, per_batch, _ = offset_input(op, offset, x.shape[0], 0)  # never in a shape: a few rows
    added = _projection_biases(op, x, projections, biases)
    template = (*template, template_arg("PER_BATCH", per_batch), template_arg("HAS_BIAS", biases is not None))
    return Rotation(heads, kv_heads, d, dims, template, (off, table, *added))


def _projection_biases(op: str, x: mx.array, projections: Any,
                       biases: Sequence[mx.array] | None) -> tuple[mx.array, mx.array, mx.array]:
    """The three projections' biases (Qwen 2's), checked, or three one-element stand-ins."""
    if biases is None:
        return (unused_input(x.dtype),) * 3
    if not isinstance(biases, (list, tuple)) or len(biases) != 3:
        raise KernelError(op, f"biases must be 3 arrays (queries, keys, values), got {biases!r:.80}",
                          Status.INVALID_INPUT)
    for name, bias, matrix in zip(("queries", "keys", "values"), biases, projections):
        weight = matrix[0] if isinstance(matrix, (list, tuple)) else None
        rows = weight.shape[0] if isinstance(weight, mx.array) else 0
        if not isinstance(bias, mx.array) or bias.shape != (rows,) or bias.dtype != x.dtype:
            found = (f"{tuple(bias.shape)} {dtype_name(bias.dtype)}" if isinstance(bias, mx.array)
                     else type(bias).__name__)
            raise KernelError(op, f"the {name}' bias is {found}; expected ({rows},) {dtype_name(x.dtype)}, "
                              f"one value a row of its projection", Status.INVALID_INPUT)
    return biases[0], biases[1], biases[2]


def rotated_case(shape: Sequence[int], dtype: mx.Dtype, key: mx.array, *, group_size: int = 64, bits: int = 4,
                 traditional: bool = False) -> Case:
    """Arguments for one call: ``quantized_case``'s rows and weights as queries (3 heads of 32),
    keys and values (1 head each), an offset of 7, half of each head rotated, an input scale."""
    case = quantized_case(shape, dtype, key, gated=False, group_size=group_size, bits=bits)
    kwargs = {**case.kwargs, "offset": 7, "base": 1e6, "traditional": traditional, "input_scale": 1.25}
    x, w, mats = case.args
    return Case((x, w, mats, 3, 1, 16), kwargs)


def _stock_rotated(x: mx.array, weight: mx.array | None, projections: Sequence[Any], heads: int,
                   kv_heads: int, dims: int, eps: float = 1e-5, residual: mx.array | None = None, *,
                   group_size: int = 64, bits: int = 4, biases: Sequence[mx.array] | None = None,
                   **rope: Any) -> tuple[mx.array, ...]:
    """The stock layers: ``mx.fast.rms_norm``, ``mx.quantized_matmul`` products (plus their biases),
    ``mx.fast.rope``."""
    h, normed = stock_normed(x, weight, eps, residual)
    q, k, v = (quantized_product(normed, m, group_size, bits) for m in projections)
    if biases is not None:
        q, k, v = q + biases[0], k + biases[1], v + biases[2]
    queries, keys = stock_prologue(q, k, heads, kv_heads, dims, **rope)
    return (queries, keys, v) if residual is None else (h, queries, keys, v)


@declare(QUANTIZED_NORM_ROPE_PROJECTIONS, stock=_stock_rotated, make_inputs=rotated_case,
         shapes=((1, 1, 64), (2, 1, 128), (1, 4, 256), (1, 1, 2048)), min_ndim=3, last_dim_multiple=64,
         description="residual add + RMSNorm + affine-quantized q/k/v projections + RoPE of q and k (4-bit, "
                     "group 64), for up to 8 rows (decoding)", tolerances=GPU_FORMULA_TOLERANCES)
def plan_quantized_norm_rope_projections(
        x: mx.array, weight: mx.array | None, projections: Sequence[Any], heads: int, kv_heads: int,
        dims: int, eps: float = 1e-5, residual: mx.array | None = None, *, group_size: int = 64,
        bits: int = 4, traditional: bool = False, base: float | None = 10000.0, scale: float = 1.0,
        offset: int | mx.array = 0, freqs: mx.array | None = None, input_scale: float = 1.0,
        biases: Sequence[mx.array] | None = None) -> Plan:
    """The launch :func:`quantized_norm_rope_projections` makes (validated)."""
    op = "quantized_norm_rope_projections"
    rotation = _rotation(op, x, projections, heads, kv_heads, dims, traditional=traditional, base=base,
                         scale=scale, offset=offset, freqs=freqs, input_scale=input_scale, biases=biases)
    names = ("queries", "keys", "values")
    return plan_quantized_rows(op, QUANTIZED_NORM_ROPE_PROJECTIONS, x, residual, weight, eps, projections,
                               names, False, group_size, bits, rotation)



@plan_quantized_norm_rope_projections.layer
def quantized_norm_rope_projections(
        x: mx.array, weight: mx.array | None, projections: Sequence[Any], heads: int, kv_heads: int,
        dims: int, eps: float = 1e-5, residual: mx.array | None = None, *, group_size: int = 64,
        bits: int = 4, traditional: bool = False, base: float | None = 10000.0, scale: float = 1.0,
        offset: int | mx.array = 0, freqs: mx.array | None = None, input_scale: float = 1.0,
        biases: Sequence[mx.array] | None = None) -> tuple[mx.array, ...]:
    """``n = rms_norm(x, weight, eps)`` (of ``x + residual`` when given), its products with the
    affine-quantized query, key and value weights (``projections``, ``(weight, scales, biases)``
    each), and the queries and keys rotated, in one launch, for up to ``MAX_ROWS`` rows of ``x``
    (``(B, L, K)``). Returns queries ``(B, heads, L, D)`` and keys ``(B, kv_heads, L, D)`` as
    :func:`~graphkern.kernels.rope_qk` gives them, and values ``(B, L, kv_heads * D)``, after
    ``h = x + residual`` when a residual is given. The RoPE arguments are
    :func:`~graphkern.kernels.rope`'s; ``biases`` (three 1-D arrays, Qwen 2's) are added to the
    query, key and value products as ``nn.Linear`` adds its bias, before the rotation.

    >>> w, s, b = mx.quantize(mx.ones((8, 64)), group_size=64, bits=4)
    >>> q, k, v = quantized_norm_rope_projections(mx.ones((1, 1, 64)), None, [(w, s, b)] * 3, 2, 2, 4,
    ...                                           eps=0.0, offset=0)   # position 0: no rotation
    >>> q.shape, k.shape, v.shape, q[0, 0, 0].tolist()
    ((1, 2, 1, 4), (1, 2, 1, 4), (1, 1, 8), [64.0, 64.0, 64.0, 64.0])
    """
    offset = launch_offset(offset, None)  # never in a shape: a few rows
    h, q, k, v = plan_quantized_norm_rope_projections.launch(
        x, weight, projections, heads, kv_heads, dims, eps, residual, group_size, bits, traditional, base,
        scale, offset, launch_freqs(freqs), input_scale, biases)
    found = (q.transpose(0, 2, 1, 3), k, v)
    return (h, *found) if residual is not None else found
