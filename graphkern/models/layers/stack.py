"""The patched decoder stack: each block's last residual add handed to the next block's norm, decoding
linked through one compiled call a block, and a short prompt run on the stock layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern.launching.autodiff import vjp_enabled
from graphkern.launching.context import state
from graphkern.models import route_timing
from graphkern.models.layers.attention import KernelAttention
from graphkern.models.layers.base import Held, KernelLayer, run_segment, stock_tree
from graphkern.models.layers.block import KernelResidualBlock
from graphkern.models.layers.norms import KernelAddRMSNorm
from graphkern.models.layers.rope import Rotary
from graphkern.models.prefill import BlockPipeline, prompt_mode, stock_layers
from graphkern.models.route_timing import RouteTimer
from graphkern.models.routes import stack_row_limit
from graphkern.models.segments import MAX_SEGMENT_TOKENS, Views, segments_apply
from graphkern.tracing.guards import item_writes, same_items, writes


class KernelDecoderStack(KernelLayer):
    """A decoder (mlx-lm's ``Qwen3Model``, ``MixtralModel``...) whose loop over pre-norm blocks hands
    each block's last residual add to the next block's input RMSNorm, and the last one to the
    final norm: every add runs inside an ``add_rms_norm`` kernel, none on its own. ``norm`` is the
    final norm as a :class:`KernelAddRMSNorm`; ``create_mask`` the model file's
    ``create_attention_mask``. A layer that is not a chaining :class:`KernelResidualBlock` is called
    as in the stock loop, after the pending add. An evaluating call on a short prompt runs the stock
    layers, and so does a decoding call of more token rows than the blocks' fused kernels take on
    a GPU (``graphkern.models.routes.stack_row_limit``); on a long prompt each block but the last
    starts on the device as soon as it is built (``graphkern.models.prefill``). On a GPU a decoding
    call on the ``"auto"`` route runs whichever of the kernels and the stock layers was measured
    faster for its shape (``graphkern.models.route_timing``); on the ``"stock"`` route every call
    a graphkern trace does not record runs the stock layers.
    """

    kernel = "add_rms_norm"

    def __init__(self, original: nn.Module, norm: KernelAddRMSNorm, create_mask: Callable[..., Any]):
        super().__init__(original)
        self.norm = norm
        self._gk_create_mask = create_mask
        # link index -> (the two blocks, what the link reads), found again if a block is replaced;
        # set past Module.__setattr__, which would put a dict among the module's items
        object.__setattr__(self, "_gk_link_reads", {})
        object.__setattr__(self, "_gk_link_views", {})  # link index -> (its blocks' views, its own)

    def _embed(self, inputs: mx.array, cache: Any, input_embeddings: mx.array | None) -> tuple[mx.array, Any]:
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        return h, cache if cache is not None else [None] * len(self.layers)

    @property
    def sparse(self) -> bool:
        """Whether a block of this stack has a mixture of experts (mlx-lm's switch layers)."""
        found: bool | None = self.__dict__.get("_gk_sparse")
        if found is None:
            found = any(type(m).__module__.endswith(".switch_layers")
                        for layer in self.layers for _, m in layer.named_modules())
            object.__setattr__(self, "_gk_sparse", found)
        return found

    def _blocks(self, h: mx.array, cache: Any, mask_of: Callable[[nn.Module], Any],
                pipelined: bool) -> mx.array:
        """The blocks, each residual add left to the next norm; ``pipelined``: each block but
        the last starts on the device as soon as it is built."""
        if not pipelined and segments_apply(h):
            linked = self._linked_blocks(h, cache, mask_of)
            if linked is not None:
                return linked
        pending = None
        last = len(self.layers) - 1
        pipeline = BlockPipeline() if pipelined else None
        for index, (layer, c) in enumerate(zip(self.layers, cache)):
            if isinstance(layer, KernelResidualBlock) and layer.chains:
                h, pending = layer(h, mask_of(layer), c, residual=pending)
            else:
                if pending is not None:
                    h, pending = h + pending, None
                h = layer(h, mask_of(layer), c)
            # not the last block: a prefill that keeps only the cache never evaluates it
            if pipeline is not None and index < last:
                pipeline.start(h, pending)
        return self.norm(h) if pending is None else self.norm(h, pending)[1]  # type: ignore[no-any-return]

    def _linked_blocks(self, h: mx.array, cache: Any, mask_of: Callable[[nn.Module], Any]) -> mx.array | None:
        """Decoding through one compiled call a block: the first block's ``enter``, then for
        each block its attention and :meth:`link` (its ``leave`` and the next block's
        ``enter``), the last one's ``leave``. A block's two segments, apart, cost the host
        twice what one call costs. None (nothing run) unless every block is a chaining
        :class:`KernelResidualBlock` whose attention rotates with a kernel at this call."""
        # children by item, not attribute, on this path run at every token: Module.__getattr__
        # runs Python before it finds one, about a microsecond each
        layers = self["layers"]
        found = self._links_found(layers)
        if found is None:
            return None
        attentions, rotaries = found
        positions = []
        for attention, rotary, c in zip(attentions, rotaries, cache):
            position = attention.position(h, c, rotary)
            if position is None:
                return None
            positions.append(position)
        links = self.segments()
        x, queries, keys, values = run_segment(layers[0].segments(), "enter", layers[0].enter,
                                               h, None, *positions[0])
        steps = list(zip(layers, attentions, cache))
        for index, (layer, attention, c) in enumerate(steps[:-1]):
            attended = attention.attend(queries, keys, values, mask_of(layer), c)
            x, queries, keys, values = run_segment(links, ("link", index), self.link, x, attended,
                                                   *positions[index + 1])
        layer, attention, c = steps[-1]
        attended = attention.attend(queries, keys, values, mask_of(layer), c)
        h, pending = run_segment(layer.segments(), "leave", layer.leave, x, attended, False)
        return self.norm(h, pending)[1]  # type: ignore[no-any-return]

    def _links_found(self, layers: list[Any]) -> tuple[list[KernelAttention], list[Rotary | None]] | None:
        """The blocks' attentions and each one's fixed rotation (``KernelRoPE.fixed_rotary``), or
        None where the blocks do not link. Found again only after a module attribute or item was
        written (``graphkern.tracing.guards``) or the list of blocks changed: checking every block
        at every token would cost the host on every step it bounds."""
        counts = item_writes(), writes()
        held: Held | None = self.__dict__.get("_gk_links_found")
        if held is not None:
            seen, built, found = held.module
            if seen == counts and same_items(layers, built):
                return found  # type: ignore[no-any-return]
        attentions = [layer.get("self_attn") for layer in layers]
        links = bool(layers) and all(isinstance(layer, KernelResidualBlock) and layer.chains
                                     and isinstance(attention, KernelAttention)
                                     for layer, attention in zip(layers, attentions))
        found = None
        if links:
            found = attentions, [attention["rope"].fixed_rotary() for attention in attentions]
        object.__setattr__(self, "_gk_links_found", Held((counts, list(layers), found)))
        return found

    def link(self, index: int, x: mx.array, attended: mx.array, offset: mx.array,
             rotary: Rotary) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Block ``index``'s second segment, then block ``index + 1``'s first: ``(x + residual,
        queries, keys, values)`` of the next block (see :meth:`KernelResidualBlock.enter`)."""
        h, out = self.layers[index].leave(x, attended, False)
        return self.layers[index + 1].enter(h, out, offset, rotary)  # type: ignore[no-any-return]

    def segment_reads(self, name: Any) -> tuple[tuple[Any, ...], ...] | None:
        if not (isinstance(name, tuple) and name[0] == "link"):
            return None
        index = name[1]
        layers = self["layers"]  # an item: Module.__getattr__ would look in Python first
        leaving, entering = layers[index], layers[index + 1]
        known = self._gk_link_reads.get(index)
        if known is None or known[0] is not leaving or known[1] is not entering:
            known = leaving, entering, _link_reads(index, leaving, entering)
            self._gk_link_reads[index] = known
        return known[2]

    def segment_views(self, name: Any) -> Views:
        """What ``link(index, ...)`` takes in row ranges: block ``index``'s ``leave`` and the next
        block's ``enter`` (:meth:`KernelResidualBlock.segment_views`), as paths from the stack."""
        if not (isinstance(name, tuple) and name[0] == "link"):
            return ()
        index = name[1]
        layers = self["layers"]
        left, entered = layers[index].segment_views("leave"), layers[index + 1].segment_views("enter")
        known = self._gk_link_views.get(index)
        if known is None or known[0] is not left or known[1] is not entered:
            views = (*((("layers", index, *path), sizes) for path, sizes in left),
                     *((("layers", index + 1, *path), sizes) for path, sizes in entered))
            known = left, entered, views
            self._gk_link_views[index] = known
        return known[2]

    def forward(self, inputs: mx.array, cache: Any = None,
                 input_embeddings: mx.array | None = None) -> mx.array:
        tokens = inputs if input_embeddings is None else input_embeddings
        if self._gk_call_route == "stock" and state.recorder is None:
            mode = "stock"  # forced: no kernel at all, though a trace still records them
        else:
            mode = prompt_mode(tokens, self.sparse, self._decode_rows())
            if (mode == "kernels" and self._measures_routes(tokens)
                    and self.route_timer().route(tokens.shape[:2]) == "stock"):
                mode = "stock"  # measured faster for calls of this shape on this machine
        if mode == "stock":  # every patched layer in the stock forward runs the layer it replaced
            stack = self._stock_stack()
            with stock_layers():
                if input_embeddings is None:  # Phi-3's model takes no input_embeddings
                    return stack(inputs, cache)  # type: ignore[no-any-return]
                return stack(inputs, cache, input_embeddings)  # type: ignore[no-any-return]
        h, cache = self._embed(inputs, cache, input_embeddings)
        return self._blocks(h, cache, self._masks(h, cache), mode == "pipelined")

    def _measures_routes(self, tokens: mx.array) -> bool:
        """Whether this call is a decoding call whose route is measured
        (``graphkern.models.route_timing``): the ``"auto"`` route on a GPU, evaluating, a few
        tokens a row, outside graphkern's traces."""
        return (self._gk_call_route == "auto" and state.recorder is None and not state.kernels_only
                and tokens.ndim >= 2 and tokens.shape[1] <= MAX_SEGMENT_TOKENS and not vjp_enabled()
                and route_timing.measures_routes())

    def route_timer(self) -> RouteTimer:
        """This stack's measured choice between its kernels and its stock layers for decoding
        calls (``graphkern.models.route_timing``), made on first use."""
        timer: RouteTimer | None = self.__dict__.get("_gk_route_timer")
        if timer is None:
            timer = RouteTimer()
            object.__setattr__(self, "_gk_route_timer", timer)
        return timer

    def use_route(self, route: str) -> None:
        """As :meth:`KernelLayer.use_route`; the decoding routes measured so far are forgotten."""
        super().use_route(route)
        self.route_timer().forget()

    def _stock_stack(self) -> nn.Module:
        """This stack as the stock layers run it (:func:`stock_tree`): the replaced stack over the
        replaced blocks, each holding the patched one's current items, so its forward is stock's
        on today's weights and calls each replaced block straight rather than through the patched
        block's call (a few microseconds a block, on a step the host bounds). Made again when a
        module item was set since (``graphkern.tracing.guards.item_writes``), or this stack's list
        of blocks changed."""
        layers = self["layers"]  # an item: this runs at every call
        held: Held | None = self.__dict__.get("_gk_stock_stack")
        if held is not None:
            writes, built, twin = held.module
            if writes == item_writes() and same_items(layers, built):
                return twin  # type: ignore[no-any-return]
        twin = stock_tree(self)
        # counted after: the copies stock_tree makes set their items too
        object.__setattr__(self, "_gk_stock_stack", Held((item_writes(), list(layers), twin)))
        return twin  # type: ignore[no-any-return]

    def _decode_rows(self) -> int | None:
        """The most token rows a decoding call takes through the blocks' fused kernels
        (``graphkern.models.routes.stack_row_limit``), by the first block's weights; None for no
        limit, and for a stack with mixture-of-experts blocks, whose router kernel pays at every
        row count."""
        layers = self["layers"]  # items, not attributes: this runs at every token
        if not layers or self.sparse:
            return None
        block = layers[0]
        attention, norm = block.get("self_attn"), block.get("input_layernorm")
        if attention is None or norm is None or not isinstance(norm.get("weight"), mx.array):
            return None
        projection = attention.get("q_proj", attention.get("qkv_proj"))
        return stack_row_limit(self._gk_call_route, isinstance(projection, nn.QuantizedLinear),
                               norm["weight"].shape[-1])

    def _masks(self, h: mx.array, cache: Any) -> Callable[[nn.Module], Any]:
        """Each block's attention mask, by block."""
        mask = self._gk_create_mask(h, cache[0])
        return lambda layer: mask


def _link_reads(index: int, leaving: KernelResidualBlock,
                entering: KernelResidualBlock) -> tuple[tuple[Any, ...], ...] | None:
    """What ``KernelDecoderStack.link(index, ...)`` reads: block ``index``'s ``leave`` and the
    next block's ``enter``, as paths from the stack."""
    left, entered = leaving.segment_reads("leave"), entering.segment_reads("enter")
    if left is None or entered is None:
        return None
    return (*(("layers", index, *path) for path in left), *(("layers", index + 1, *path) for path in entered))


class KernelSlidingDecoderStack(KernelDecoderStack):
    """mlx-lm's ``LlamaModel``: a :class:`KernelDecoderStack` whose blocks take the full-attention
    mask, or the sliding-window one for a block with ``use_sliding`` (only where the model's config
    has sliding-window layers), as the stock loop gives them."""

    def _masks(self, h: mx.array, cache: Any) -> Callable[[nn.Module], Any]:
        fa_mask = self._gk_create_mask(h, cache[self.fa_idx])
        swa_mask = None
        if self.swa_idx is not None:
            swa_mask = self._gk_create_mask(h, cache[self.swa_idx], window_size=self.sliding_window)
        return lambda layer: swa_mask if layer.use_sliding else fa_mask
