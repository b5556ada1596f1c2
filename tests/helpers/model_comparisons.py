"""What tests comparing a patched model with the stock one share (the CPU tests and tests/gpu).

``ATOL, RTOL``: the float32 logits tolerance of the CPU tests: rounding alone on the CPU; off it,
a GPU's float32 matrix products (TF32 on CUDA) round more, so the model tolerance applies.

``STOCK_EXPERTS_DIFFERENTIATE``: whether the stock mixture-of-experts models can be differentiated
here, to hold a patched one's gradients to: mlx 0.32.4's CUDA backend fails evaluating the
gradients of mlx-lm's ``SwitchGLU`` experts (cuGraphAddKernelNode: invalid argument).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from graphkern.kernels.declaration import LibraryKernel
from graphkern.models import MODEL_TOLERANCES

ATOL, RTOL = (1e-5, 1e-5) if mx.default_device() == mx.cpu else MODEL_TOLERANCES[mx.float32]
STOCK_EXPERTS_DIFFERENTIATE = not mx.cuda.is_available()
#: Tests holding gradients to the stock model's, which must be differentiable on this device.
NEEDS_STOCK_GRADIENTS = pytest.mark.skipif(
    not STOCK_EXPERTS_DIFFERENTIATE,
    reason="mlx 0.32.4's CUDA backend cannot differentiate the stock SwitchGLU experts, so there is no "
    "stock gradient to compare with")


def same_values(ours: mx.array, theirs: mx.array) -> bool:
    """Equal on the CPU, where both sides run the same float32 ops; within ``ATOL``/``RTOL`` on a
    GPU, where a library kernel and the stock op it replaces reduce in different orders."""
    if mx.default_device() == mx.cpu:
        return bool(mx.array_equal(ours, theirs).item())
    return bool(mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item())


def assert_same_gradients(expected: tuple[mx.array, Any], got: tuple[mx.array, Any], *,
                          loss_atol: float, atol: float, rtol: float) -> None:
    """``(loss, gradients)`` of ``nn.value_and_grad`` against the stock model's: the loss within
    ``loss_atol``, the same parameter names, each gradient within ``atol``/``rtol``."""
    (stock_loss, stock_grads), (loss, grads) = expected, got
    assert abs(loss.item() - stock_loss.item()) < loss_atol
    stock, ours = dict(tree_flatten(stock_grads)), dict(tree_flatten(grads))
    assert ours.keys() == stock.keys()
    for key in stock:
        assert mx.allclose(ours[key], stock[key], atol=atol, rtol=rtol).item(), key


def count_layer_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-item list counting the library layer launches made from now on (until ``monkeypatch``
    undoes it): the count of a forward that should, or should not, run the kernels."""
    count = [0]
    launch = LibraryKernel.launch

    def counted(self: LibraryKernel, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(LibraryKernel, "launch", counted)
    return count


def spy_on_kernels(monkeypatch: pytest.MonkeyPatch, names: Any) -> list[str]:
    """A list that records, from now on (until ``monkeypatch`` undoes it), the name of each call of
    the ``graphkern.kernels`` layer functions ``names``."""
    import graphkern.kernels as gkk

    calls: list[str] = []
    for name in names:
        real = getattr(gkk, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(gkk, name, spy)
    return calls


def batch_generate(model: Any, prompts: list[list[int]], max_tokens: int) -> dict[int, list[int]]:
    """The greedy tokens mlx-lm's ``BatchGenerator`` gives each of ``prompts`` decoded together
    (left-padded, an offset per sequence), by the generator's id for it."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, max_tokens=max_tokens, prefill_batch_size=len(prompts),
                               completion_batch_size=len(prompts))
    try:
        uids = generator.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        # mlx-lm 0.31 and later: next_generated; 0.30: next, which gives only generated tokens
        step = getattr(generator, "next_generated", None) or generator.next
        while responses := step():
            for response in responses:
                tokens[response.uid].append(response.token)
        return tokens
    finally:
        generator.close()


#: The prompt the decoding comparisons start from.
PROMPT = mx.array([[3, 17, 42, 5, 99, 1, 7, 64]])


def eval_twins(arch: str, dtype: mx.Dtype = mx.float32, **options: Any) -> tuple[Any, Any]:
    """A stock tiny ``arch`` model and a patched one (``gk.patch(**options)``) of the same weights,
    both in evaluation mode, as ``mlx_lm.load`` leaves a model."""
    import graphkern as gk
    from graphkern.models.tiny import tiny_model

    stock, patched = tiny_model(arch, dtype), tiny_model(arch, dtype)
    stock.eval()
    patched.eval()
    gk.patch(patched, **options)
    return stock, patched


def greedy_logits(model: Any, steps: int = 3, prompt: mx.array = PROMPT,
                  follow: list[mx.array] | None = None) -> list[mx.array]:
    """The logits of ``prompt`` and of ``steps`` greedy decoding steps after it, on a fresh cache.
    With ``follow`` (another run's logits) each step feeds that run's greedy token instead of this
    model's own, so two models' logits compare step by step even where a near tie parts their
    choices."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = [model(prompt, cache=cache)]
    for step in range(steps):
        source = logits[-1] if follow is None else follow[step]
        logits.append(model(mx.argmax(source[:, -1:], axis=-1), cache=cache))
    mx.eval(logits)
    return logits
