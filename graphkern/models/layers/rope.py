"""The patched RoPE layers: :class:`Rotary`, one call as the kernels take it, and
:class:`KernelRoPE` with a subclass for each of mlx-lm's other RoPE layers."""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from graphkern import kernels as gkk
from graphkern.launching.context import state
from graphkern.launching.fastpaths import BACKEND_VARIABLE, environ_get
from graphkern.models.layers.base import Held, KernelLayer, StandaloneLayer
from graphkern.models.routes import takes_stock

#: A RoPE call's offset when the caller gave none (the stock layer's default applies).
_NO_OFFSET: Any = object()


class Rotary(NamedTuple):
    """One RoPE call as the library kernels take it (``gkk.rope`` and ``gkk.rope_qk`` arguments)."""

    dims: int
    traditional: bool
    base: float | None
    freqs: mx.array | None = None
    scale: float = 1.0
    input_scale: float = 1.0


class KernelRoPE(StandaloneLayer):
    """``nn.RoPE`` on the ``rope`` kernel; ``offset`` is an int or an integer array, as for MLX.

    Subclasses stand in for mlx-lm's other RoPE layers: each says, in :meth:`rotary`, how the stock
    layer rotates a call of ``length`` positions at ``offset`` (None: the stock layer runs it).
    """

    kernel = "rope"

    def __call__(self, x: Any, offset: Any = _NO_OFFSET, *args: Any, **kwargs: Any) -> Any:
        # StandaloneLayer.__call__ with the offset named: mlx-lm passes it by keyword, which
        # would otherwise go into a dict and out of it again on every call
        stock = self._gk_auto_stock
        if stock is not None and not (args or kwargs) and state.plain and not environ_get(BACKEND_VARIABLE):
            return stock(self, x) if offset is _NO_OFFSET else stock(self, x, offset)
        if offset is not _NO_OFFSET:
            args = (offset, *args)
        if not state.stock_layers and takes_stock(self._gk_call_route, self.elementwise):
            return self.stock_call(x, *args, **kwargs)
        return KernelLayer.__call__(self, x, *args, **kwargs)

    def rotary(self, length: int, offset: int | mx.array) -> Rotary | None:
        return Rotary(self.dims, self.traditional, self.base, None, self.scale)

    def fixed_rotary(self) -> Rotary | None:
        """The :meth:`rotary` of every call where it depends on neither the call's length nor its
        offset (the layers of this module; not a subclass with a :meth:`rotary` of its own), so a
        decoding stack can ask once; None: ask at each call."""
        return self.rotary(1, 0) if type(self).rotary in _POSITION_FREE else None

    def _rotate(self, x: mx.array, offset: int | mx.array, rotary: Rotary | None) -> mx.array:
        if rotary is None:
            return self.original(x, offset)  # type: ignore[no-any-return]
        return gkk.rope(x, rotary.dims, traditional=rotary.traditional, base=rotary.base, scale=rotary.scale,
                        offset=offset, freqs=rotary.freqs, input_scale=rotary.input_scale)

    def forward(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return self._rotate(x, offset, self.rotary(x.shape[-2], offset))


class KernelFreqsRoPE(KernelRoPE):
    """mlx-lm's ``Llama3RoPE`` and ``ProportionalRoPE``: their frequencies (``_freqs``) given."""

    def rotary(self, length: int, offset: int | mx.array) -> Rotary | None:
        return Rotary(self.dims, self.traditional, None, self._freqs)


class KernelSuScaledRoPE(KernelRoPE):
    """mlx-lm's ``SuScaledRoPE`` (LongRoPE): the rotated features scaled by ``_scale`` first."""

    def rotary(self, length: int, offset: int | mx.array) -> Rotary | None:
        return Rotary(self.dim, False, None, self._freqs, 1.0, self._scale)


class KernelYarnRoPE(KernelRoPE):
    """mlx-lm's ``YarnRoPE``: the rotated features scaled by ``mscale`` (its inverse when
    ``inverse``, which also negates the frequencies), ``scale`` per call."""

    def __init__(self, original: nn.Module):
        super().__init__(original)
        negated = -self._freqs  # made once, here: stock negates them in every inverse call
        mx.eval(negated)
        self._gk_negated = Held(negated)

    def rotary(self, length: int, offset: int | mx.array, scale: float = 1.0,  # type: ignore[override]
               inverse: bool = False) -> Rotary | None:
        input_scale = (1.0 / self.mscale if inverse else self.mscale) if self.mscale != 1.0 else 1.0
        freqs = self._gk_negated.module if inverse else self._freqs
        return Rotary(self.dims, self.traditional, None, freqs, scale, input_scale)

    def forward(self, x: mx.array, offset: int | mx.array = 0, scale: float = 1.0,  # type: ignore[override]
                 inverse: bool = False) -> mx.array:
        return self._rotate(x, offset, self.rotary(x.shape[-2], offset, scale, inverse))


class KernelDynamicRoPE(KernelRoPE):
    """mlx-lm's ``DynamicNTKScalingRoPE``: the base grows with the sequence past
    ``max_position_embeddings``. Up to there it is constant and the kernel runs; past it every
    token has a base of its own, which on a GPU would compile a kernel a token, so the stock
    layer runs those calls (as it does calls with an array offset, which it cannot take)."""

    def rotary(self, length: int, offset: int | mx.array) -> Rotary | None:
        if offset.__class__ is not int:
            return None
        seq_len = max(length + offset, self.max_position_embeddings)  # type: ignore[operator]
        if seq_len > self.max_position_embeddings:
            return None
        base = self.base * ((self.factor * seq_len / self.max_position_embeddings) - (self.factor - 1)) ** (
            self.dims / (self.dims - 2))
        return Rotary(self.dims, self.traditional, base)


#: The :meth:`KernelRoPE.rotary` methods that read only the layer's own attributes.
_POSITION_FREE = frozenset({KernelRoPE.rotary, KernelFreqsRoPE.rotary, KernelSuScaledRoPE.rotary,
                            KernelYarnRoPE.rotary})
