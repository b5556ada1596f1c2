"""A mixture-of-experts router's choice: the top ``k`` of each row of gate logits and their weights.

mlx-lm's sparse blocks pick experts with four to six launches (a negation, ``argpartition``, a
gather, ``softmax`` and, for Qwen's, a sum and a division); here one warp takes a row, ``k`` rounds
of a warp arg-max pick the experts, and lane 0 writes them with their weights. Two orders of work,
as the models make them:

- ``softmax_first=False`` (Mixtral): the ``k`` largest logits, then ``softmax`` over those ``k``;
- ``softmax_first=True`` (Qwen 2/3 MoE, OLMoE): ``softmax`` over all experts (rounded to the dtype,
  as MLX's is), the ``k`` largest probabilities, divided by their sum when ``normalize``.

Experts come highest first; equal values go to the lower index (``argpartition`` leaves both order
and ties unspecified, so the set and the weights are what match mlx-lm). A NaN logit ranks as the
largest finite float, above every other finite one, so a broken router shows in the weights instead
of being passed over.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from graphkern.kernels.base import (
    Case,
    Plan,
    check_dtype,
    check_grid,
    output_spec,
    template_arg,
)
from graphkern.kernels.declaration import declare
from graphkern.kernels.headers import dual_header
from graphkern.nodes import Kernel, KernelError, Status

__all__ = ["MAX_EXPERTS", "MAX_TOP_K", "MOE_ROUTE", "moe_route", "moe_route_reference", "plan_moe_route"]

#: Most experts a row may have (32 a lane: one bit each in the lane's taken mask).
MAX_EXPERTS = 1024
#: Most experts a row may choose (each lane keeps the chosen ones in registers).
MAX_TOP_K = 32
#: Where a NaN logit ranks: as the largest finite float32 (both backends and the reference).
_NAN_RANK = 3.4028234663852886e38
#: Rows (warps) a block.
_WARPS = 4

_CUDA = r"""
namespace gk {

// (a, ia) ranks before (b, ib): a larger key, or an equal key at a lower index.
__device__ __forceinline__ bool ranks_before(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

template <typename T, int E, int K, bool SOFTMAX_FIRST, bool NORMALIZE>
__device__ __forceinline__ void moe_route_row(const T* g, unsigned int* inds, T* scores) {
  constexpr int PER = (E + 31) / 32;
  const float inf = __int_as_float(0x7f800000);
  const int lane = threadIdx.x & 31;
  float v[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? static_cast<float>(g[e]) : -inf;
  }
  if constexpr (SOFTMAX_FIRST) {  // exp is __expf, as MLX's softmax
    float m = -inf;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      m = fmaxf(m, v[i]);
    }
    m = block_reduce<32>(m, nullptr, Max{});
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      s += lane + 32 * i < E ? __expf(v[i] - m) : 0.0f;
    }
    const float inv = 1.0f / block_reduce<32>(s, nullptr, Sum{});
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      v[i] = lane + 32 * i < E ? round_to<T>(__expf(v[i] - m) * inv) : -inf;
    }
  }
  unsigned int taken = 0u;
  float chosen[K];
  int index[K];
#pragma unroll
  for (int j = 0; j < K; ++j) {
    float best = -inf;
    int at = E;  // past every expert: any untaken one ranks before it
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      const int e = lane + 32 * i;
      const float key = v[i] != v[i] ? 3.402823466e+38f : v[i];
      if (e < E && !((taken >> i) & 1u) && ranks_before(key, e, best, at)) {
        best = key;
        at = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, o);
      const int other_at = __shfl_xor_sync(0xffffffffu, at, o);
      if (ranks_before(other, other_at, best, at)) {
        best = other;
        at = other_at;
      }
    }
    float value = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      if (lane + 32 * i == at) {
        value = v[i];
        taken |= 1u << i;
      }
    }
    chosen[j] = __shfl_sync(0xffffffffu, value, at & 31);
    index[j] = at;
  }
  float w[K];
  if constexpr (SOFTMAX_FIRST) {
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      w[j] = chosen[j];
      s += chosen[j];
    }
    if constexpr (NORMALIZE) {
      s = round_to<T>(s);
#pragma unroll
      for (int j = 0; j < K; ++j) {
        w[j] /= s;
      }
    }
  } else {
    float m = chosen[0];
#pragma unroll
    for (int j = 1; j < K; ++j) {
      m = fmaxf(m, chosen[j]);
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      s += __expf(chosen[j] - m);
    }
    const float inv = 1.0f / s;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      w[j] = __expf(chosen[j] - m) * inv;
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < K; ++j) {
      inds[j] = static_cast<unsigned int>(index[j]);
      scores[j] = static_cast<T>(w[j]);
    }
  }
}

}  // namespace gk
"""

_CUDA_BODY = r"""
  long long rows = 1;
  for (int d = 0; d < gates_ndim - 1; ++d) {
    rows *= gates_shape[d];
  }
  const long long row = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  if (row < rows) {
    gk::moe_route_row<T, E, K, SOFTMAX_FIRST, NORMALIZE>(gates + row * E, inds + row * K, scores + row * K);
  }
"""

_METAL = r"""
namespace gk {

inline bool ranks_before(float a, int ia, float b, int ib) {
  return a > b || (a == b && ia < ib);
}

template <typename T, int E, int K, bool SOFTMAX_FIRST, bool NORMALIZE, typename PG, typename PI, typename PS>
inline void moe_route_row(PG g, PI inds, PS scores, int lane) {
  constexpr int PER = (E + 31) / 32;
  float v[PER];
  for (int i = 0; i < PER; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? static_cast<float>(g[e]) : -INFINITY;
  }
  if (SOFTMAX_FIRST) {
    float m = -INFINITY;
    for (int i = 0; i < PER; ++i) {
      m = metal::max(m, v[i]);
    }
    m = metal::simd_max(m);
    float s = 0.0f;
    for (int i = 0; i < PER; ++i) {
      s += lane + 32 * i < E ? metal::fast::exp(v[i] - m) : 0.0f;
    }
    const float inv = 1.0f / metal::simd_sum(s);
    for (int i = 0; i < PER; ++i) {
      v[i] = lane + 32 * i < E ? round_to<T>(metal::fast::exp(v[i] - m) * inv) : -INFINITY;
    }
  }
  uint taken = 0u;
  float chosen[K];
  int index[K];
  for (int j = 0; j < K; ++j) {
    float best = -INFINITY;
    int at = E;
    for (int i = 0; i < PER; ++i) {
      const int e = lane + 32 * i;
      const float key = metal::isnan(v[i]) ? 3.402823466e+38f : v[i];
      if (e < E && !((taken >> i) & 1u) && ranks_before(key, e, best, at)) {
        best = key;
        at = e;
      }
    }
    for (ushort o = 16; o > 0; o >>= 1) {
      const float other = metal::simd_shuffle_xor(best, o);
      const int other_at = metal::simd_shuffle_xor(at, o);
      if (ranks_before(other, other_at, best, at)) {
        best = other;
        at = other_at;
      }
    }
    float value = 0.0f;
    for (int i = 0; i < PER; ++i) {
      if (lane + 32 * i == at) {
        value = v[i];
        taken |= 1u << i;
      }
    }
    chosen[j] = metal::simd_shuffle(value, ushort(at & 31));
    index[j] = at;
  }
  float w[K];
  if (SOFTMAX_FIRST) {
    float s = 0.0f;
    for (int j = 0; j < K; ++j) {
      w[j] = chosen[j];
      s += chosen[j];
    }
    if (NORMALIZE) {
      s = round_to<T>(s);
      for (int j = 0; j < K; ++j) {
        w[j] /= s;
      }
    }
  } else {
    float m = chosen[0];
    for (int j = 1; j < K; ++j) {
      m = metal::max(m, chosen[j]);
    }
    float s = 0.0f;
    for (int j = 0; j < K; ++j) {
      s += metal::fast::exp(chosen[j] - m);
    }
    const float inv = 1.0f / s;
    for (int j = 0; j < K; ++j) {
      w[j] = metal::fast::exp(chosen[j] - m) * inv;
    }
  }
  if (lane == 0) {
    for (int j = 0; j < K; ++j) {
      inds[j] = uint(index[j]);
      scores[j] = static_cast<T>(w[j]);
    }
  }
}

}  // namespace gk
"""

_METAL_BODY = r"""
  size_t rows = 1;
  for (int d = 0; d < gates_ndim - 1; ++d) {
    rows *= gates_shape[d];
  }
  const size_t row = thread_position_in_grid.x / 32;
  if (row < rows) {
    gk::moe_route_row<T, E, K, SOFTMAX_FIRST, NORMALIZE>(gates + row * E, inds + row * K, scores + row * K,
                                                            int(thread_index_in_simdgroup));
  }
"""


def moe_route_reference(gates: mx.array, *, K: int, SOFTMAX_FIRST: bool = False,
                        NORMALIZE: bool = False) -> list[mx.array]:
    """Pure-MLX routing with the kernel's rounding and order (highest first, ties to the lower index)."""
    g = gates.astype(mx.float32)
    if SOFTMAX_FIRST:
        g = mx.softmax(g, axis=-1).astype(gates.dtype).astype(mx.float32)
    key = mx.where(mx.isnan(g), _NAN_RANK, g)
    # a stable sort of -key keeps equal keys in index order
    inds = mx.stop_gradient(mx.argsort(-key, axis=-1)[..., :K]).astype(mx.uint32)
    chosen = mx.take_along_axis(g, inds, axis=-1)
    if not SOFTMAX_FIRST:
        weights = mx.softmax(chosen, axis=-1)
    elif NORMALIZE:
        weights = chosen / chosen.sum(axis=-1, keepdims=True).astype(gates.dtype).astype(mx.float32)
    else:
        weights = chosen
    return [inds, weights.astype(gates.dtype)]


MOE_ROUTE = Kernel(
    "gk_moe_route",
    input_names=["gates"],
    output_names=["inds", "scores"],
    metal=_METAL_BODY,
    cuda=_CUDA_BODY,
    header=dual_header(_CUDA, _METAL),
    reference=moe_route_reference,
)


def _make_inputs(shape: Sequence[int], dtype: mx.Dtype, key: mx.array) -> Case:
    """Logits with distinct values in each row (a shuffled ramp, exact in every dtype), so the
    chosen experts do not depend on how ties break."""
    *lead, experts = shape
    order = mx.argsort(mx.random.uniform(shape=(*lead, experts), key=key), axis=-1)
    gates = ((order.astype(mx.float32) - experts / 2) / 8).astype(dtype)
    k = min(2 if experts <= 16 else 8, experts)
    return Case((gates, k), {"softmax_first": experts > 16, "normalize": experts > 16})


def _stock(gates: mx.array, k: int, softmax_first: bool = False,
           normalize: bool = False) -> tuple[mx.array, mx.array]:
    """mlx-lm's routing (Mixtral's, or Qwen 3 MoE's with ``softmax_first``), its experts sorted
    highest first as the kernel gives them."""
    if softmax_first:
        gates = mx.softmax(gates, axis=-1, precise=True)
        inds = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
    else:
        inds = mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k]
    inds = mx.take_along_axis(inds, mx.argsort(-mx.take_along_axis(gates, inds, axis=-1), axis=-1), axis=-1)
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if not softmax_first:
        scores = mx.softmax(scores, axis=-1, precise=True)
    elif normalize:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


@declare(MOE_ROUTE, stock=_stock, make_inputs=_make_inputs, shapes=((1, 8), (2, 3, 8), (5, 64), (4, 128)),
         description="mixture-of-experts router: top-k experts and their softmax weights")
def plan_moe_route(gates: mx.array, k: int, softmax_first: bool = False, normalize: bool = False) -> Plan:
    """The launch :func:`moe_route` makes (validated)."""
    op = "moe_route"
    check_dtype(op, gates, "gates")
    experts = gates.shape[-1]
    if not 1 <= experts <= MAX_EXPERTS:
        raise KernelError(op, f"gates has {experts} experts (its last dimension); supported: 1 to "
                          f"{MAX_EXPERTS}", Status.INVALID_INPUT)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= min(experts, MAX_TOP_K):
        raise KernelError(op, f"k must be an int from 1 to {min(experts, MAX_TOP_K)} (the experts, at most "
                          f"{MAX_TOP_K}), got {k!r}", Status.INVALID_INPUT)
    if normalize and not softmax_first:
        raise KernelError(op, "normalize divides probabilities by their sum: it needs softmax_first=True "
                          "(a softmax over the chosen logits already sums to 1)", Status.INVALID_INPUT)
    rows = gates.size // experts
    blocks = -(-rows // _WARPS)
    check_grid(op, blocks * 32 * _WARPS)
    shape = (*gates.shape[:-1], k)
    template = (template_arg("T", gates.dtype), template_arg("E", experts), template_arg("K", k),
                template_arg("SOFTMAX_FIRST", bool(softmax_first)),
                template_arg("NORMALIZE", bool(normalize)))
    return Plan(MOE_ROUTE, (gates,), (output_spec(shape, mx.uint32), output_spec(shape, gates.dtype)),
                (blocks * 32 * _WARPS, 1, 1), (32 * _WARPS, 1, 1), template)


@plan_moe_route.layer
def moe_route(gates: mx.array, k: int, *, softmax_first: bool = False,
              normalize: bool = False) -> tuple[mx.array, mx.array]:
    """The ``k`` experts each row of router logits ``gates`` picks, and their weights:
    ``(inds, scores)``, each of shape ``gates.shape[:-1] + (k,)``, ``inds`` as uint32.

    Mixtral's ``softmax(top_k(gates))`` by default; ``softmax_first=True`` takes the top ``k`` of
    ``softmax(gates)`` (Qwen MoE), divided by their sum when ``normalize``.

    >>> inds, scores = moe_route(mx.array([[0.0, 2.0, 1.0, 2.0]]), 2)
    >>> inds.tolist(), scores.tolist()
    ([[1, 3]], [[0.5, 0.5]])
    """
    inds, scores = plan_moe_route.launch(gates, k, softmax_first, normalize)
    return inds, scores
