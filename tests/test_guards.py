"""What a trace read is guarded: a Python attribute of a module (``eps``, a head count, training
mode) or a scalar a compiled function closes over, changed after the trace, makes the next call
trace again instead of running the value baked into the old trace."""

from __future__ import annotations

import timeit
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest

import graphkern as gk
from graphkern.tracing import guards

pytest.importorskip("mlx_lm")
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from model_comparisons import ATOL, RTOL  # noqa: E402

from graphkern.models.tiny import tiny_model  # noqa: E402

PROMPT = mx.array([[3, 17, 42, 5, 99, 1, 7, 64]])
FACTOR = 2


def _close(a: mx.array, b: mx.array) -> bool:
    return bool(mx.allclose(a, b, atol=ATOL, rtol=RTOL).item())


# ----------------------------------------------------------------------------- gk.compile


def test_a_closed_over_scalar_changed_after_the_trace_is_seen() -> None:
    factor = 2
    cf = gk.compile(lambda x: x * factor)
    x = mx.ones((3,))
    assert cf(x).tolist() == [2.0] * 3
    assert cf(x).tolist() == [2.0] * 3  # the steady call
    factor = 3
    assert cf(x).tolist() == [3.0] * 3
    assert cf(x).tolist() == [3.0] * 3


def test_a_global_scalar_changed_after_the_trace_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    cf = gk.compile(lambda x: x * FACTOR)
    x = mx.ones((2,))
    assert cf(x).tolist() == [2.0, 2.0]
    monkeypatch.setitem(globals(), "FACTOR", 5)
    assert cf(x).tolist() == [5.0, 5.0]


def test_a_module_attribute_changed_after_the_trace_is_seen_on_every_path() -> None:
    norm = nn.RMSNorm(4)
    cf = gk.compile(norm)
    x = mx.arange(8, dtype=mx.float32).reshape(2, 4)
    for _ in range(3):  # the long way, then steady calls
        assert _close(cf(x), norm(x))
    norm.eps = 10.0
    assert _close(cf(x), norm(x))
    assert _close(cf(x), norm(x))


def test_training_mode_and_tuple_attributes_are_guarded() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shape = (2, 2)
            self.double = False

        def __call__(self, x: mx.array) -> mx.array:
            y = x.reshape(self.shape)
            return y * 2 if self.double or self.training else y

    module = Scaled()
    cf = gk.compile(module)
    x = mx.ones((4,))
    assert cf(x).tolist() == [[2.0, 2.0]] * 2  # training mode
    module.eval()
    assert cf(x).tolist() == [[1.0, 1.0]] * 2
    module.shape = (4, 1)
    assert cf(x).shape == (4, 1)
    module.double = True
    assert cf(x).tolist() == [[2.0]] * 4


def test_an_unchanged_attribute_set_again_keeps_the_trace() -> None:
    norm = nn.RMSNorm(4)
    cf = gk.compile(norm)
    x = mx.ones((2, 4))
    cf(x)
    first = cf.graph
    norm.eps = norm.eps  # a write of the same value: no retrace
    nn.Linear(2, 2).some_setting = 3  # another module's attribute
    cf(x)
    assert cf.graph is first and cf.stats()["misses"] == 1


def test_a_module_swapped_for_one_with_another_eps_or_class_is_seen() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.RMSNorm(4)

        def __call__(self, x: mx.array) -> mx.array:
            return self.norm(x) * 2

    class Doubled(nn.RMSNorm):
        def __call__(self, x: mx.array) -> mx.array:
            return super().__call__(x) * 2

    block = Block()
    cf = gk.compile(block)
    x = mx.arange(8, dtype=mx.float32).reshape(2, 4)
    for _ in range(2):
        assert _close(cf(x), block(x))
    block.norm = nn.RMSNorm(4, eps=10.0)  # the same arrays: only the eps tells it apart
    assert _close(cf(x), block(x))
    block.norm = Doubled(4, eps=10.0)  # the same attributes: only the class tells it apart
    assert _close(cf(x), block(x))
    graph = cf.graph
    block.norm = nn.RMSNorm(4, eps=10.0)
    block.norm = Doubled(4, eps=10.0)  # back to what was traced: no new trace
    assert _close(cf(x), block(x)) and cf.graph is graph


# ----------------------------------------------------------------------------- gk.wrap


def test_a_wrapped_models_attribute_changed_after_the_trace_is_seen() -> None:
    model = tiny_model("llama")
    wrapped = gk.wrap(model)
    assert _close(wrapped(PROMPT), model(PROMPT))
    model.model.norm.eps = 10.0
    assert _close(wrapped(PROMPT), model(PROMPT))
    assert wrapped.calls == {"compiled": 2, "eager": 0}


# ----------------------------------------------------------------------------- segments


def _decode(model: nn.Module, cache: Any, tokens: list[int]) -> list[mx.array]:
    return [model(mx.array([[t]]), cache=cache) for t in tokens]


@pytest.mark.parametrize("where", ["layers.0.input_layernorm", "layers.1.input_layernorm",
                                   "layers.1.post_attention_layernorm"])
def test_a_patched_layers_attribute_changed_after_it_decoded_is_seen(where: str) -> None:
    stock, patched = tiny_model("llama"), tiny_model("llama")
    gk.patch(patched)
    stock.eval()
    patched.eval()
    caches = make_prompt_cache(stock), make_prompt_cache(patched)
    assert _close(patched(PROMPT, cache=caches[1]), stock(PROMPT, cache=caches[0]))
    for ours, theirs in zip(_decode(patched, caches[1], [4, 9]), _decode(stock, caches[0], [4, 9])):
        assert _close(ours, theirs)
    for model in (stock, patched):
        module = model.model
        for key in where.split("."):
            module = module[int(key)] if key.isdigit() else module[key]
        module.eps = 10.0
    for ours, theirs in zip(_decode(patched, caches[1], [11, 2]), _decode(stock, caches[0], [11, 2])):
        assert _close(ours, theirs)


# ----------------------------------------------------------------------------- cost


def test_the_guard_costs_a_steady_call_little() -> None:
    """The check a steady call makes: a version compare, and the closure's scalars."""
    model = tiny_model("llama")
    guard = guards.AttributeGuard(lambda: guards.modules_under([model]), [])
    per_call = min(timeit.repeat(guard.changed, number=10_000, repeat=5)) / 10_000
    assert not guard.changed()
    assert per_call < 5e-6, f"{per_call * 1e6:.2f} us a call"


def test_a_callback_waits_for_the_next_module_item_write_and_runs_once() -> None:
    """``at_next_item_write``: not run by an attribute written, run once by the next item set
    (before it is set), not again."""
    seen: list[Any] = []
    linear = nn.Linear(2, 2)
    guards.at_next_item_write(lambda: seen.append(linear["weight"]))
    old = linear["weight"]
    linear.eps = 0.5  # an attribute, no item
    assert seen == []
    linear.weight = mx.zeros((2, 2))
    assert len(seen) == 1 and seen[0] is old
    del linear["bias"]
    assert len(seen) == 1
