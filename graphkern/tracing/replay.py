"""Run one MLX primitive again from what ``mx.export_function`` reported about it.

MLX's export callback gives each primitive's name, its state (``arguments``) and the shapes and
dtypes of its outputs, but Python cannot rebuild a primitive from them. Here each primitive that
models use is mapped to the public op that makes it, so a traced graph can be run node by node
(``graphkern.debugging.values``). A primitive with no mapping, or one whose replay does not give the shapes
and dtypes MLX reported, raises :class:`NotReplayable`: its node says so instead of guessing.

>>> import mlx.core as mx
>>> run("Reduce", [2, [1]], [mx.ones((2, 3))], [((2, 1), mx.float32)])
[array([[3],
       [3]], dtype=float32)]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..launching.launch_cache import memoized

__all__ = ["NotReplayable", "REPLAYED", "run"]

Spec = tuple[tuple[int, ...], mx.Dtype]
_Replay = Callable[[list[mx.array], list[Any], Sequence[Spec]], Any]


class NotReplayable(Exception):
    """This primitive cannot be run again from the trace (the message says why)."""


_UNARY: dict[str, Callable[[mx.array], mx.array]] = {
    "Abs": mx.abs, "ArcCos": mx.arccos, "ArcCosh": mx.arccosh, "ArcSin": mx.arcsin,
    "ArcSinh": mx.arcsinh, "ArcTan": mx.arctan, "ArcTanh": mx.arctanh, "Ceil": mx.ceil,
    "Conjugate": mx.conjugate, "Cos": mx.cos, "Cosh": mx.cosh, "Erf": mx.erf, "ErfInv": mx.erfinv,
    "Exp": mx.exp, "Expm1": mx.expm1, "Floor": mx.floor, "Imag": mx.imag, "Log1p": mx.log1p,
    "LogicalNot": mx.logical_not, "Negative": mx.negative, "Real": mx.real, "Round": mx.round,
    "Sigmoid": mx.sigmoid, "Sign": mx.sign, "Sin": mx.sin, "Sinh": mx.sinh, "Square": mx.square,
    "Tan": mx.tan, "Tanh": mx.tanh, "StopGradient": mx.stop_gradient,
    "Copy": lambda x: x,  # a copy holds the same values
}
_BINARY: dict[str, Callable[[mx.array, mx.array], mx.array]] = {
    "Add": mx.add, "ArcTan2": mx.arctan2, "Divide": mx.divide, "Greater": mx.greater,
    "GreaterEqual": mx.greater_equal, "Less": mx.less, "LessEqual": mx.less_equal,
    "LogAddExp": mx.logaddexp, "LogicalAnd": mx.logical_and, "LogicalOr": mx.logical_or,
    "Maximum": mx.maximum, "Minimum": mx.minimum, "Multiply": mx.multiply,
    "NotEqual": mx.not_equal, "Power": mx.power, "Remainder": mx.remainder,
    "Subtract": mx.subtract,
}
_BITWISE = [mx.bitwise_and, mx.bitwise_or, mx.bitwise_xor, mx.left_shift, mx.right_shift]
_LOGS = [mx.log2, mx.log10, mx.log]  # MLX's Log::Base: two, ten, e
_REDUCE: list[Callable[..., mx.array]] = [mx.all, mx.any, mx.sum, mx.prod, mx.min, mx.max]
_SCAN: list[Callable[..., mx.array]] = [mx.cummax, mx.cummin, mx.cumsum, mx.cumprod,
                                        mx.logcumsumexp]
_QUANTIZATION = ["affine", "mxfp4", "mxfp8", "nvfp4"]  # MLX's QuantizationMode, in order


def _shape(spec: Sequence[Spec]) -> tuple[int, ...]:
    return tuple(spec[0][0])


def _equal(ins: list[mx.array], args: list[Any], _: Sequence[Spec]) -> mx.array:
    a, b = ins
    same = mx.equal(a, b)
    return mx.logical_or(same, mx.logical_and(mx.isnan(a), mx.isnan(b))) if args and args[0] else same


def _slice(ins: list[mx.array], args: list[Any], _: Sequence[Spec]) -> mx.array:
    starts, ends, strides = args
    index = []
    for start, end, step in zip(starts, ends, strides):
        # MLX normalises a reversed slice that runs past index 0 to a negative end
        index.append(slice(start, None if step < 0 and end < 0 else end, step))
    return ins[0][tuple(index)]


def _slice_update(ins: list[mx.array], args: list[Any], _: Sequence[Spec]) -> mx.array:
    reduce_type, starts, ends, strides = args
    index = tuple(slice(s, None if st < 0 and e < 0 else e, st) for s, e, st in zip(starts, ends, strides))
    src, update = ins
    if reduce_type == 4:  # None: assign
        out = mx.array(src)  # a copy: item assignment rebinds the array object it is applied to
        out[index] = update
        return out
    at = src.at[index]
    ops = {0: at.maximum, 1: at.minimum, 2: at.add, 3: at.multiply}
    if reduce_type not in ops:
        raise NotReplayable(f"SliceUpdate with reduce type {reduce_type}")
    return ops[reduce_type](update)


def _gather(ins: list[mx.array], args: list[Any], out: Sequence[Spec]) -> mx.array:
    """``Gather(axes, slice_sizes)``: one index array per axis in ``axes``, a slice of
    ``slice_sizes`` at each gathered position; output = index shape + slice sizes."""
    axes, sizes = list(args[0]), list(args[1])
    source, indices = ins[0], ins[1:]
    if any(sizes[a] != 1 for a in axes):
        raise NotReplayable("Gather of slices wider than one element along an indexed axis")
    rest = [a for a in range(source.ndim) if a not in axes]
    moved = mx.transpose(source, axes + rest) if axes != list(range(len(axes))) else source
    index: list[Any] = list(indices) + [slice(0, sizes[a]) for a in rest]
    return mx.reshape(moved[tuple(index)] if index else moved, _shape(out))


def _pad(ins: list[mx.array], args: list[Any], _: Sequence[Spec]) -> mx.array:
    axes, low, high = args
    widths = [(0, 0)] * ins[0].ndim
    for axis, lo, hi in zip(axes, low, high):
        widths[axis] = (lo, hi)
    return mx.pad(ins[0], widths, constant_values=ins[1])


def _number_of_elements(ins: list[mx.array], args: list[Any], _: Sequence[Spec]) -> mx.array:
    axes, inverted, dtype = args
    count = 1
    for axis in axes:
        count *= ins[0].shape[axis]
    return mx.array(1.0 / count if inverted else count, dtype=dtype)


def _rms_norm(ins: list[mx.array], args: list[Any], _: Sequence[Spec]) -> mx.array:
    weight = ins[1] if len(ins) > 1 and ins[1].ndim else None  # a 0-d 1: no weight given
    return mx.fast.rms_norm(ins[0], weight, args[-1])


def _layer_norm(ins: list[mx.array], args: list[Any], _: Sequence[Spec]) -> mx.array:
    weight = ins[1] if len(ins) > 1 and ins[1].ndim else None
    bias = ins[2] if len(ins) > 2 and ins[2].ndim else None
    return mx.fast.layer_norm(ins[0], weight, bias, args[-1])


def _rope(ins: list[mx.array], args: list[Any], _: Sequence[Spec]) -> mx.array:
    dims, traditional, base, scale, forward = args[-5:]
    if not forward:
        raise NotReplayable("RoPE run backwards (a gradient)")
    freqs = ins[2] if len(ins) > 2 else None
    return mx.fast.rope(ins[0], int(dims), traditional=bool(traditional),
                        base=None if freqs is not None else float(base), scale=float(scale),
                        offset=ins[1], freqs=freqs)


def _attention(ins: list[mx.array], args: list[Any], out: Sequence[Spec]) -> mx.array:
    scale, causal, sinks = args[-5:-2]  # ..., scale, do_causal, has_sinks, logsumexp, force_fused
    if len(out) != 1:
        raise NotReplayable("ScaledDotProductAttention returning its log-sum-exp (a gradient)")
    q, k, v, *rest = ins
    sink = rest.pop() if sinks else None
    mask: Any = "causal" if causal else (rest[0] if rest else None)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=float(scale), mask=mask, sinks=sink)


def _quantized_matmul(ins: list[mx.array], args: list[Any], _: Sequence[Spec]) -> mx.array:
    group_size, bits, mode, transpose = args[:4]
    x, w, scales, *rest = ins
    return mx.quantized_matmul(x, w, scales, rest[0] if rest else None, transpose=bool(transpose),
                               group_size=int(group_size), bits=int(bits),
                               mode=_QUANTIZATION[int(mode)])


def _gather_qmm(ins: list[mx.array], args: list[Any], _: Sequence[Spec]) -> mx.array:
    group_size, bits, mode, transpose, _left, right = args[:6]
    x, w, scales, *rest = ins
    biases = rest[0] if len(rest) == 3 else None
    lhs, rhs = rest[-2], rest[-1]
    return mx.gather_qmm(x, w, scales, biases, lhs_indices=lhs, rhs_indices=rhs,
                         transpose=bool(transpose), group_size=int(group_size), bits=int(bits),
                         mode=_QUANTIZATION[int(mode)], sorted_indices=bool(right))


def _kept_dims(fn: Callable[..., mx.array]) -> _Replay:
    """A reduction MLX keeps its axes for: run it over the state's axes, then give the
    reported shape."""
    return lambda ins, args, out: mx.reshape(fn(ins[0], list(args[-1]), keepdims=True), _shape(out))


_TABLE: dict[str, _Replay] = {
    **{name: (lambda f: lambda ins, args, out: f(ins[0]))(fn) for name, fn in _UNARY.items()},
    **{name: (lambda f: lambda ins, args, out: f(ins[0], ins[1]))(fn) for name, fn in _BINARY.items()},
    "Equal": _equal,
    "Log": lambda ins, args, out: _LOGS[int(args[0])](ins[0]),
    "Sqrt": lambda ins, args, out: (mx.rsqrt if args and args[0] else mx.sqrt)(ins[0]),
    "BitwiseBinary": lambda ins, args, out: _BITWISE[int(args[0])](ins[0], ins[1]),
    "Select": lambda ins, args, out: mx.where(ins[0], ins[1], ins[2]),
    "DivMod": lambda ins, args, out: list(mx.divmod(ins[0], ins[1])),
    "AddMM": lambda ins, args, out: mx.addmm(ins[2], ins[0], ins[1], alpha=args[0], beta=args[1]),
    "Matmul": lambda ins, args, out: mx.matmul(ins[0], ins[1]),
    "GatherMM": lambda ins, args, out: mx.gather_mm(ins[0], ins[1], ins[2], ins[3],
                                                     sorted_indices=bool(args[1])),
    "QuantizedMatmul": _quantized_matmul,
    "GatherQMM": _gather_qmm,
    "Arange": lambda ins, args, out: mx.arange(args[0], args[1], args[2], dtype=out[0][1]),
    "ArgPartition": lambda ins, args, out: mx.argpartition(ins[0], int(args[0]), axis=int(args[1])),
    "ArgReduce": lambda ins, args, out: mx.reshape(
        (mx.argmin if args[0] == 0 else mx.argmax)(ins[0], axis=int(args[1]), keepdims=True),
        _shape(out)),
    "ArgSort": lambda ins, args, out: mx.argsort(ins[0], axis=int(args[0])),
    "AsType": lambda ins, args, out: ins[0].astype(args[0]),
    "AsStrided": lambda ins, args, out: mx.as_strided(ins[0], args[0], args[1], args[2]),
    "Broadcast": lambda ins, args, out: mx.broadcast_to(ins[0], _shape(out)),
    "Full": lambda ins, args, out: mx.broadcast_to(ins[0], _shape(out)),
    "BroadcastAxes": lambda ins, args, out: mx.broadcast_to(ins[0], _shape(out)),
    "Concatenate": lambda ins, args, out: mx.concatenate(ins, axis=int(args[0])),
    "Convolution": lambda ins, args, out: mx.conv_general(
        ins[0], ins[1], stride=list(args[0]), padding=(list(args[1]), list(args[2])),
        kernel_dilation=list(args[3]), input_dilation=list(args[4]), groups=int(args[5]),
        flip=bool(args[6])),
    "ExpandDims": lambda ins, args, out: mx.reshape(ins[0], _shape(out)),
    "Flatten": lambda ins, args, out: mx.reshape(ins[0], _shape(out)),
    "Unflatten": lambda ins, args, out: mx.reshape(ins[0], _shape(out)),
    "Reshape": lambda ins, args, out: mx.reshape(ins[0], _shape(out)),
    "Squeeze": lambda ins, args, out: mx.reshape(ins[0], _shape(out)),
    "Gather": _gather,
    "GatherAxis": lambda ins, args, out: mx.take_along_axis(ins[0], ins[1], axis=int(args[0])),
    "ScatterAxis": lambda ins, args, out: _scatter_axis(ins, args),
    "Hadamard": lambda ins, args, out: mx.hadamard_transform(ins[0], scale=float(args[0])),
    "LogSumExp": lambda ins, args, out: mx.logsumexp(ins[0], axis=-1, keepdims=True),
    "NumberOfElements": _number_of_elements,
    "Pad": _pad,
    "Partition": lambda ins, args, out: mx.partition(ins[0], int(args[0]), axis=int(args[1])),
    "RandomBits": lambda ins, args, out: _random_bits(ins[0], tuple(args[0]), int(args[1])),
    "Reduce": lambda ins, args, out: mx.reshape(
        _REDUCE[int(args[0])](ins[0], list(args[1]), keepdims=True), _shape(out)),
    "Scan": lambda ins, args, out: _SCAN[int(args[0])](ins[0], axis=int(args[1]),
                                                       reverse=bool(args[2]), inclusive=bool(args[3])),
    "Slice": _slice,
    "SliceUpdate": _slice_update,
    "DynamicSlice": lambda ins, args, out: mx.slice(ins[0], ins[1], list(args[0]), list(args[1])),
    "DynamicSliceUpdate": lambda ins, args, out: mx.slice_update(ins[0], ins[1], ins[2], list(args[0])),
    "Softmax": lambda ins, args, out: mx.softmax(ins[0], axis=-1, precise=bool(args[0])),
    "Sort": lambda ins, args, out: mx.sort(ins[0], axis=int(args[0])),
    "Split": lambda ins, args, out: mx.split(ins[0], list(args[0]), axis=int(args[1])),
    "Transpose": lambda ins, args, out: mx.transpose(ins[0], list(args[0])),
    "View": lambda ins, args, out: ins[0].view(args[0]),
    "Depends": lambda ins, args, out: ins[: len(out)],
    "RMSNorm": _rms_norm,
    "LayerNorm": _layer_norm,
    "RoPE": _rope,
    "ScaledDotProductAttention": _attention,
}

#: The MLX primitives :func:`run` can run again.
REPLAYED = frozenset(_TABLE)


def _random_bits(key: mx.array, shape: tuple[int, ...], width: int) -> mx.array:
    """``RandomBits(shape, 4)``: ``mx.random.split`` draws the same bits, two per subkey, for an
    even count (an odd count pairs its bits differently)."""
    count = math.prod(shape)
    if width != 4 or count % 2:
        raise NotReplayable(f"RandomBits of {count} {width}-byte values (only an even count of "
                            "4-byte values is drawn again)")
    return mx.reshape(mx.random.split(key, count // 2), shape)


def _scatter_axis(ins: list[mx.array], args: list[Any]) -> mx.array:
    reduce_type, axis = int(args[0]), int(args[1])
    if reduce_type != 1:  # Sum, None
        raise NotReplayable("ScatterAxis that adds")
    return mx.put_along_axis(ins[0], ins[1], ins[2], axis=axis)


@memoized("primitive names", maxsize=256)
def _why_not(name: str) -> str:
    if name == "CustomKernel":
        return "an MLX custom kernel launched outside graphkern (its source is not reachable from Python)"
    return f"graphkern cannot run the MLX primitive {name!r} again"


def run(name: str, arguments: list[Any], inputs: list[mx.array],
        outputs: Sequence[Spec]) -> list[mx.array]:
    """The outputs of the primitive ``name`` with state ``arguments`` on ``inputs``, lazily;
    ``outputs`` are the shapes and dtypes MLX reported. Raises :class:`NotReplayable`."""
    replay = _TABLE.get(name)
    if replay is None:
        raise NotReplayable(_why_not(name))
    try:
        result = replay(inputs, arguments, outputs)
    except NotReplayable:
        raise
    except Exception as exc:  # a state this mapping did not expect: say so on the node
        raise NotReplayable(f"running {name} again failed: {type(exc).__name__}: {exc}") from exc
    arrays = list(result) if isinstance(result, (list, tuple)) else [result]
    if len(arrays) != len(outputs):
        raise NotReplayable(f"{name} gave {len(arrays)} outputs again, MLX reported {len(outputs)}")
    checked = []
    for array, (shape, dtype) in zip(arrays, outputs):
        if tuple(array.shape) != tuple(shape):
            raise NotReplayable(f"{name} gave shape {tuple(array.shape)} again, MLX reported "
                                f"{tuple(shape)}")
        checked.append(array if array.dtype == dtype else array.astype(dtype))
    return checked
