"""Long calls (prefill): each block's work starts on the device while the next block is built.

MLX builds a whole forward lazily and only then runs it, so the device waits for the host to
build every layer and to encode the first of its command graphs, and then the host waits for the
device. In an evaluating model, a patched decoder stack hands each block's outputs to
``mx.async_eval`` as soon as the block is built: the device runs block ``i`` while the host builds
block ``i + 1``. The values are the same; only when the work starts changes. It also keeps fewer of
the forward's buffers alive at once, since each block's command graphs end sooner.

It applies to calls of at least :data:`PIPELINE_TOKENS` tokens, without vjp (an evaluating model or
``gk.without_vjp()``), outside graphkern traces. Inside a graph transformation (``mx.compile``,
``mx.vmap``, ``mx.export_function``) ``mx.async_eval`` refuses, and the forward goes on lazily.
"""

from __future__ import annotations

import mlx.core as mx

from graphkern.autodiff import vjp_enabled
from graphkern.context import state

__all__ = ["PIPELINE_TOKENS", "pipelines", "start_on_device"]

#: Calls of at least this many tokens start each block on the device as soon as it is built. On
#: an H200 it made 2048-token prompts of 16-layer models faster, but 256-token ones of the dense
#: models slower (a block's device work is then too short to pay for a command graph of its own).
PIPELINE_TOKENS = 512


def pipelines(x: mx.array) -> bool:
    """Whether a decoder stack called on hidden states ``x`` (``(B, L, D)``) starts each block on
    the device as it is built: at least :data:`PIPELINE_TOKENS` tokens, no vjp, no graphkern trace.

    >>> from graphkern import without_vjp
    >>> with without_vjp():  # as an evaluating patched model runs its layers
    ...     pipelines(mx.zeros((1, 2048, 8))), pipelines(mx.zeros((1, 256, 8)))
    (True, False)
    >>> pipelines(mx.zeros((1, 2048, 8)))  # a differentiable call
    False
    """
    return (state.recorder is None and not vjp_enabled() and x.ndim == 3
            and x.shape[1] >= PIPELINE_TOKENS)


def start_on_device(*arrays: mx.array | None) -> bool:
    """Start computing ``arrays`` (None entries are skipped) without waiting for them; False when
    MLX refuses because a graph transformation is tracing the call (nothing was started)."""
    try:
        mx.async_eval([a for a in arrays if a is not None])
    except ValueError:  # "[async_eval] Not allowed inside a graph transformation."
        return False
    return True
