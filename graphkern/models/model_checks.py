"""``check_model``: a patched model's logits against the stock model's, per dtype.

For each dtype the model is cast, run stock, patched with the selected kernels and run again,
eagerly and as a wrapped compiled graph; the worst difference against per-dtype tolerances is
reported in a ``graphkern.debugging.kernel_checks.CheckReport`` (one case per dtype and mode). The
model is left as it was: same dtype, same parameter arrays, same patched layers. ``gk.check()``
hands ``nn.Module`` targets here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from graphkern.debugging.kernel_checks import CheckCase, CheckReport
from graphkern.debugging.precision import main_float_dtype
from graphkern.debugging.progress import Progress, progress_line
from graphkern.debugging.tolerance import MODEL_TOLERANCES, checked_errors
from graphkern.errors import ModelError
from graphkern.kernels.base import FLOAT_DTYPES
from graphkern.launching.backends import active_backend
from graphkern.models.patching import patch, patched_layers, unpatch
from graphkern.models.prefill import kernels_only
from graphkern.models.wrapping import wrap
from graphkern.nodes import Status, dtype_name

__all__ = ["MODEL_TOLERANCES", "check_model", "model_dtype"]

_CHECK = "check a patched model against the stock model"

def _vocab_size(model: nn.Module) -> int | None:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None) or getattr(model, "vocab_size", None)
    if isinstance(size, int):
        return size
    embeddings = [m for _, m in model.named_modules() if isinstance(m, nn.Embedding)]
    return embeddings[0].weight.shape[0] if embeddings else None


def _default_inputs(model: nn.Module, seed: int) -> mx.array:
    vocab = _vocab_size(model)
    if vocab is None:
        raise ModelError(_CHECK, f"{type(model).__name__} has no token embedding to draw random "
                          "inputs for; pass inputs=", Status.INVALID_INPUT)
    return mx.random.randint(0, vocab, (2, 16), key=mx.random.key(seed))


def _cast(inputs: Any, dtype: mx.Dtype) -> Any:
    if isinstance(inputs, mx.array):
        return inputs.astype(dtype) if inputs.dtype in FLOAT_DTYPES else inputs
    return [_cast(i, dtype) for i in inputs]


def _call(fn: Any, inputs: Any) -> list[mx.array]:
    out = fn(*inputs) if isinstance(inputs, (list, tuple)) else fn(inputs)
    outputs = list(out) if isinstance(out, (list, tuple)) else [out]
    mx.eval(outputs)
    return outputs


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype most of ``model``'s parameters are in (a quantized model: its scales'),
    the dtype it computes in; float32 for a model without floating parameters."""
    leaves = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return main_float_dtype(array for _, array in leaves) or mx.float32


def check_model(model: nn.Module, inputs: Any = None, *, kernels: str | Sequence[str] = "default",
                dtypes: Sequence[mx.Dtype] | None = None, seed: int = 0, compiled: bool = True,
                tolerances: dict[mx.Dtype, tuple[float, float]] | None = None,
                progress: bool | None = None) -> CheckReport:
    """Compare ``model`` patched with ``kernels`` against the stock model, for each dtype.

    ``inputs``: the model's input (an array, or a list of positional arguments); by default random
    tokens of shape (2, 16) when the model has a token embedding. Float inputs are cast to each
    dtype. ``dtypes``: by default the one dtype the model's weights are in (:func:`model_dtype`: a
    quantized model's scales'); others by name (each is a full forward, stock and patched; MLX's
    float16/bfloat16 forward of a quantized model is slow on the CPU). ``compiled`` adds a case
    running the patched model through ``wrap``. A dtype where no layer gets patched, or where a
    run fails, is a failed case with the reason; so is one where the stock or the patched model's
    outputs hold a NaN or an Inf (named: which output, how many values). ``progress``: a line on
    stderr naming the dtype and run in progress (None: when stderr is a terminal).

    >>> import mlx.core as mx, mlx.nn as nn
    >>> model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8), nn.GELU())
    >>> report = check_model(model, mx.ones((2, 8)), dtypes=[mx.float32])
    >>> report.ok, [c.layout for c in report.cases]
    (True, ['eager', 'compiled'])
    """
    tolerances = {**MODEL_TOLERANCES, **(tolerances or {})}
    dtypes = list(dtypes) if dtypes is not None else [model_dtype(model)]
    unknown = [dtype_name(d) for d in dtypes if d not in tolerances]
    if unknown:
        raise ModelError(_CHECK, f"no tolerance for {unknown}; pass tolerances=", Status.INVALID_INPUT)
    inputs = _default_inputs(model, seed) if inputs is None else inputs
    shape = tuple(inputs.shape) if isinstance(inputs, mx.array) else tuple(inputs[0].shape)
    name = f"{type(model).__module__.rsplit('.', 1)[-1]}.{type(model).__name__}"

    with progress_line(progress, "check_model") as line:
        return _check(model, inputs, kernels, dtypes, compiled, tolerances, name, shape, line)


def _check(model: nn.Module, inputs: Any, kernels: str | Sequence[str], dtypes: list[mx.Dtype],
           compiled: bool, tolerances: dict[mx.Dtype, tuple[float, float]], name: str, shape: tuple[int, ...],
           line: Progress) -> CheckReport:
    already = sorted(set(patched_layers(model).values()))
    unpatch(model)
    saved = model.parameters()
    report = CheckReport()
    try:
        for dtype in dtypes:
            atol, rtol = tolerances[dtype]
            model.set_dtype(dtype)
            x = _cast(inputs, dtype)
            modes = ["eager", "compiled"] if compiled else ["eager"]
            try:
                line.phase(f"{dtype_name(dtype)}: stock model")
                stock = _call(model, x)
                if not patch(model, kernels):
                    raise ModelError(_CHECK, f"no layer of {name} matches the kernels {kernels!r}",
                                      Status.INVALID_INPUT)
                for mode in modes:
                    line.phase(f"{dtype_name(dtype)}: patched model, {mode}")
                    with kernels_only():  # the kernels at every length, where a model may run stock layers
                        out = _call(model if mode == "eager" else wrap(model), x)
                    max_abs, max_rel, passed, why = checked_errors(out, stock, rtol=rtol, atol=atol,
                                                                   sides=("patched", "stock"))
                    report.cases.append(CheckCase(name, shape, dtype_name(dtype), mode, active_backend(),
                                                  max_abs, max_rel, atol, rtol, passed, why))
            except Exception as exc:  # a failing run is a failed case, reported with its reason
                message = (str(exc).splitlines() or [""])[0][:160]
                for mode in modes[len([c for c in report.cases if c.dtype == dtype_name(dtype)]):]:
                    report.cases.append(CheckCase(name, shape, dtype_name(dtype), mode, active_backend(),
                                                  float("nan"), float("nan"), atol, rtol, False,
                                                  f"{type(exc).__name__}: {message}"))
            finally:
                unpatch(model)
                model.update(saved)
    finally:
        model.update(saved)
        if already:
            patch(model, already)
    return report

