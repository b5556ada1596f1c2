"""The patched sparse mixture-of-experts block: the router on one ``moe_route`` launch, and the
experts' products of mlx-lm's switch layers made with fewer launches for a few tokens."""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from graphkern import kernels as gkk
from graphkern.launching.autodiff import vjp_enabled
from graphkern.launching.backends import active_backend
from graphkern.launching.launch_cache import track_function
from graphkern.models.layers.base import KernelLayer
from graphkern.models.patterns import is_class

_SWITCH = "mlx_lm.models.switch_layers"


@track_function("plan parts")
@functools.lru_cache(maxsize=64)
def _batch_rows(shape: tuple[int, ...]) -> mx.array:
    """``arange`` over a ``gather_mm`` operand's batch of ``shape``, what it makes for its
    ``lhs_indices`` when given none: made once per shape instead of one launch per product."""
    # from numpy, so the array holds its values already: a constant even when first made while
    # mx.compile traces a segment
    return mx.array(np.arange(math.prod(shape), dtype=np.uint32).reshape(shape))


#: Backends where an evaluating call sorts a few tokens' (token, expert) pairs by expert before
#: the experts' products, as mlx-lm does from 64 pairs on: CUDA's ``gather_mm`` on rows sorted by
#: expert is a grouped GEMM that reads each chosen expert's weights once, where unsorted rows read
#: them once per pair.
SORTED_EXPERTS_BACKENDS = frozenset({"cuda"})


def _switch_experts(linear: nn.Module) -> bool:
    """Whether ``linear`` is mlx-lm's ``SwitchLinear``, or its ``QuantizedSwitchLinear`` in affine
    mode without a global scale, and has no bias: experts whose products :func:`_switch_glu` makes."""
    if "bias" in linear:
        return False
    if is_class(type(linear), f"{_SWITCH}:SwitchLinear"):
        return True
    return (is_class(type(linear), f"{_SWITCH}:QuantizedSwitchLinear")
            and getattr(linear, "mode", "affine") == "affine"
            and getattr(linear, "global_scale", None) is None)


def _expert_outputs(mlp: nn.Module, x: mx.array, inds: mx.array) -> mx.array:
    """``mlp(x, inds)``: each token through its chosen experts, ``(..., k, hidden)``. For mlx-lm's
    ``SwitchGLU`` on plain or affine-quantized expert weights (:func:`_switch_experts`) and fewer
    than 64 pairs (its unsorted path) the products take their row indices from :func:`_batch_rows`,
    and on :data:`SORTED_EXPERTS_BACKENDS` the pairs of several tokens go sorted by expert;
    otherwise it is the stock call."""
    if (inds.size >= 64 or not is_class(type(mlp), f"{_SWITCH}:SwitchGLU")
            or not all(_switch_experts(mlp[name]) for name in ("up_proj", "gate_proj", "down_proj"))):
        return mlp(x, inds)  # type: ignore[no-any-return]
    k = inds.shape[-1]
    if inds.size > k and not vjp_enabled() and active_backend() in SORTED_EXPERTS_BACKENDS:
        flat = inds.flatten()
        order = mx.argsort(flat)
        pairs = x.reshape(-1, 1, x.shape[-1])[order // k]  # each pair's token row, in expert order
        rows = _batch_rows((flat.size,))
        out = _switch_glu(mlp, pairs, rows, rows, flat[order], sorted_indices=True)
        return out[mx.argsort(order)].reshape(*inds.shape, x.shape[-1])
    x = mx.expand_dims(x, (-2, -3))
    tokens = _batch_rows((*inds.shape[:-1], 1))  # each token's row, for all k of its experts
    return _switch_glu(mlp, x, tokens, _batch_rows(tuple(inds.shape)), inds).squeeze(-2)


def _switch_glu(mlp: nn.Module, x: mx.array, x_rows: mx.array, hidden_rows: mx.array,
                inds: mx.array, sorted_indices: bool = False) -> mx.array:
    """``SwitchGLU``'s three expert products: ``down(act(up(x), gate(x)))`` with ``x``'s rows
    ``x_rows`` and the hidden rows ``hidden_rows`` taken by the experts ``inds``."""
    def product(a: mx.array, linear: nn.Module, rows: mx.array) -> mx.array:
        if "scales" in linear:  # QuantizedSwitchLinear's product, as its own __call__ makes it
            return mx.gather_qmm(a, linear.weight, linear.scales, linear.get("biases"), rows, inds,
                                 transpose=True, group_size=linear.group_size, bits=linear.bits,
                                 mode=linear.mode, sorted_indices=sorted_indices)
        return mx.gather_mm(a, linear.weight.swapaxes(-1, -2), rows, inds, sorted_indices=sorted_indices)

    up = product(x, mlp.up_proj, x_rows)
    gate = product(x, mlp.gate_proj, x_rows)
    return product(mlp.activation(up, gate), mlp.down_proj, hidden_rows)


class KernelSparseMoE(KernelLayer):
    """mlx-lm's sparse mixture-of-experts block with its router's choice on one ``moe_route``
    launch: ``y = sum_j scores_j * expert_{inds_j}(x)``, where ``(inds, scores)`` are the top
    ``k`` of ``gate(x)`` and their softmax (Mixtral), or the top ``k`` of ``softmax(gate(x))``,
    divided by their sum when ``norm_topk_prob`` (Qwen 3 MoE). The experts are the stock
    ``switch_mlp``. A block given a ``sharding_group`` after patching (mlx-lm's ``shard``) runs its
    stock forward, which sums across the group's ranks.

    Args:
        original: the block (its ``gate`` and ``switch_mlp`` are shared).
        top_k: the name of its ``k`` attribute (``num_experts_per_tok``, ``top_k``).
        softmax_first: the softmax comes before the choice (Qwen's order).
        normalize: the name of its attribute saying whether the chosen weights are renormalized.
        cast: the weighted sum is cast to the experts' dtype (Qwen's forward casts it).
    """

    kernel = "moe_route"

    def __init__(self, original: nn.Module, top_k: str, softmax_first: bool = False,
                 normalize: str | None = None, cast: bool = False):
        super().__init__(original)
        object.__setattr__(self, "_gk_route", (top_k, softmax_first, normalize, cast))

    def forward(self, x: mx.array) -> mx.array:
        if getattr(self, "sharding_group", None) is not None:  # sharded since patched (Qwen's shard())
            return self.stock(x)  # type: ignore[no-any-return]  # sums across ranks
        top_k, softmax_first, normalize, cast = self._gk_route
        inds, scores = gkk.moe_route(self.gate(x), getattr(self, top_k), softmax_first=softmax_first,
                                     normalize=bool(normalize and getattr(self, normalize)))
        # the choice carries no gradient (gather_mm has none for its indices), as in mlx-lm's blocks
        y = _expert_outputs(self.switch_mlp, x, mx.stop_gradient(inds))
        out = (y * scores[..., None]).sum(axis=-2)
        return out.astype(y.dtype) if cast else out
