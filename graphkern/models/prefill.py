"""How an evaluating patched decoder stack runs a prompt: on its kernels, on the stock layers, or
block by block.

MLX builds a whole forward lazily and only then runs it. On CUDA a prompt of a few hundred tokens
is bound by the host: building the graph and encoding MLX's command graphs takes longer than the
device's work. There the library kernels cost more than the stock ops they replace: each output
is a fresh allocation (MLX's stock ops write into an input they consume, a custom kernel cannot),
and allocations after ``mx.clear_cache()`` (which mlx-lm calls after every prompt) go to the
driver. So a short prompt runs the stock layers, on the patched layers' current weights
(``KernelDecoderStack``'s stock forward is built from the replaced layers holding them).

A long prompt is bound by the device, and the kernels' lower device time counts. There each
block's outputs go to ``mx.async_eval`` as soon as the block is built: the device runs block
``i`` while the host builds block ``i + 1``, instead of waiting for the whole forward. The values
are the same; only when the work starts changes. The host stays at most one block ahead
(:class:`BlockPipeline` waits for block ``i - 1`` once block ``i`` is started): MLX's allocator
gives an encoded block its buffers at once, so a host further ahead would hold the intermediates
of several blocks where stock's single graph holds one block's. Blocks with a mixture of experts do enough
device work to gain from this at fewer tokens.

All of this applies to evaluating calls only (no vjp: an evaluating model, or
``gk.without_vjp()``) outside graphkern traces, which always record the kernels. Decoding calls
(up to ``MAX_SEGMENT_TOKENS`` tokens) run the kernels' compiled segments, unless they hold more
token rows than the blocks' fused kernels take on a GPU (``graphkern.models.routes.stack_row_limit``):
those run the stock layers too. Inside a graph transformation (``mx.compile``, ``mx.vmap``, an
export) ``mx.async_eval`` refuses, and the forward goes on lazily. ``kernels_only()`` makes every
call run the kernels (``check_model`` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import mlx.core as mx

from graphkern.launching.autodiff import vjp_enabled
from graphkern.launching.backends import active_backend
from graphkern.launching.context import settings_changed, state
from graphkern.models.segments import MAX_SEGMENT_TOKENS

__all__ = ["PIPELINE_TOKENS", "SPARSE_PIPELINE_TOKENS", "STOCK_PROMPT_BACKENDS", "kernels_only",
           "BlockPipeline", "prompt_mode", "start_on_device", "stock_layers", "stock_layers_run"]

#: Prompts of at least this many tokens (batch times length) start each block on the device as
#: soon as it is built: below it a block's device work is too short to pay for a command graph of
#: its own (the measurements: benchmarks/RESULTS_generate.md).
PIPELINE_TOKENS = 512
#: The same for a stack with mixture-of-experts blocks, whose blocks do more device work each, so
#: that it outlasts the host's building of the next block at fewer tokens.
SPARSE_PIPELINE_TOKENS = 256
#: Backends where shorter prompts (past decoding's ``MAX_SEGMENT_TOKENS``) run the stock layers,
#: because there the host, not the device, bounds such a prompt (see the module's docstring).
STOCK_PROMPT_BACKENDS = frozenset({"cuda"})

PromptMode = Literal["kernels", "stock", "pipelined"]


def prompt_mode(tokens: mx.array, sparse: bool = False, decode_rows: int | None = None) -> PromptMode:
    """How an evaluating decoder stack (``sparse``: with mixture-of-experts blocks) runs a call on
    ``tokens`` (``(B, L)`` token ids or ``(B, L, D)`` embeddings): on the kernels, on the stock
    layers, or on the kernels with each block started on the device as soon as it is built. A
    decoding call of more token rows than ``decode_rows`` (the most its fused kernels take:
    ``graphkern.models.routes.stack_row_limit``; None: no limit) runs the stock layers.

    >>> from graphkern import without_vjp
    >>> with without_vjp():  # as an evaluating patched model runs its layers
    ...     prompt_mode(mx.zeros((1, 2048), mx.int32)), prompt_mode(mx.zeros((1, 1), mx.int32))
    ('pipelined', 'kernels')
    >>> prompt_mode(mx.zeros((1, 2048), mx.int32))  # a differentiable call
    'kernels'
    """
    if state.recorder is not None or vjp_enabled() or tokens.ndim < 2:
        return "kernels"
    length = tokens.shape[1]
    rows = tokens.shape[0] * length
    if rows >= (SPARSE_PIPELINE_TOKENS if sparse else PIPELINE_TOKENS):
        return "pipelined"
    if state.kernels_only:
        return "kernels"
    if decode_rows is not None and length <= MAX_SEGMENT_TOKENS and rows > decode_rows:
        return "stock"
    if length > MAX_SEGMENT_TOKENS and active_backend() in STOCK_PROMPT_BACKENDS:
        return "stock"
    return "kernels"


def stock_layers_run() -> bool:
    """Whether this thread is inside a forward that runs the stock layers (:func:`stock_layers`)."""
    return state.stock_layers


class stock_layers:  # noqa: N801 - used as a function is: ``with stock_layers():``
    """Every patched layer called on this thread runs the layer it replaced, for the duration.
    (A class, not a generator: a decoder stack enters it on every call that runs stock.)"""

    __slots__ = ("previous",)

    def __enter__(self) -> None:
        self.previous, state.stock_layers = state.stock_layers, True
        settings_changed()

    def __exit__(self, *exc: object) -> None:
        state.stock_layers = self.previous
        settings_changed()


@contextlib.contextmanager
def kernels_only() -> Iterator[None]:
    """Patched decoder stacks on this thread run their kernels at every prompt length.

    >>> from graphkern import without_vjp
    >>> with without_vjp(), kernels_only():
    ...     prompt_mode(mx.zeros((1, 100), mx.int32))
    'kernels'
    """
    previous, state.kernels_only = state.kernels_only, True
    try:
        yield
    finally:
        state.kernels_only = previous


def start_on_device(*arrays: mx.array | None) -> bool:
    """Start computing ``arrays`` (None entries are skipped) without waiting for them; False when
    MLX refuses because a graph transformation is tracing the call (nothing was started)."""
    try:
        mx.async_eval([a for a in arrays if a is not None])
    except ValueError:  # "[async_eval] Not allowed inside a graph transformation."
        return False
    return True


class BlockPipeline:
    """Starts each block of a prompt on the device as soon as it is built, with at most two blocks
    in flight: starting block ``i`` waits for block ``i - 1``, so the device always has the next
    block queued while the host builds the one after it.

    >>> pipeline = BlockPipeline()
    >>> pipeline.start(mx.ones(3) * 2), pipeline.start(mx.ones(3) + 1)
    (True, True)
    """

    __slots__ = ("_previous", "running")

    def __init__(self) -> None:
        self._previous: list[mx.array] = []
        self.running = True

    def start(self, *arrays: mx.array | None) -> bool:
        """Start ``arrays`` (None entries skipped), then wait for those started before; False
        from the first refusal on (a graph transformation is tracing the call: the forward goes
        on lazily)."""
        if not self.running:
            return False
        started = [a for a in arrays if a is not None]
        if not start_on_device(*started):
            self.running = False
            return False
        if self._previous:
            mx.eval(self._previous)  # already scheduled: this only waits for them
        self._previous = started
        return True
