"""How an evaluating patched decoder stack runs a prompt (graphkern.models.prefill): a long one
block by block, each started on the device as it is built; a short one on the stock layers, on
the backends that ask for it. The logits must not change; neither may reach training, graphkern
traces or decoding, and pipelining steps aside inside mx.compile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("mlx_lm")
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from model_comparisons import ATOL, RTOL, count_layer_launches  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.launching.backends import active_backend  # noqa: E402
from graphkern.models import KernelLayer, prefill  # noqa: E402
from graphkern.models.prefill import PIPELINE_TOKENS, SPARSE_PIPELINE_TOKENS, start_on_device  # noqa: E402
from graphkern.models.tiny import tiny_model  # noqa: E402

LONG = mx.random.randint(0, 64, (1, PIPELINE_TOKENS + 9), key=mx.random.key(3))


def _pair(arch: str = "llama") -> tuple[nn.Module, nn.Module]:
    stock, patched = tiny_model(arch), tiny_model(arch)
    gk.patch(patched)
    stock.eval()
    patched.eval()
    return stock, patched


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each block's start on the device returned, in order."""
    seen: list[bool] = []

    def counted(*arrays: Any) -> bool:
        seen.append(start_on_device(*arrays))
        return seen[-1]

    monkeypatch.setattr(prefill, "start_on_device", counted)
    return seen


def test_the_host_runs_at_most_one_block_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting block i waits for block i - 1 (MLX's allocator gives an encoded block its buffers
    at once, so a host further ahead would hold several blocks' intermediates)."""
    events: list[tuple[str, list[int]]] = []
    ids: dict[int, int] = {}

    class Spy:  # mx as the pipeline sees it: each start and each wait, by block
        def __getattr__(self, name: str) -> Any:
            return getattr(mx, name)

        def async_eval(self, arrays: list[mx.array]) -> None:
            events.append(("start", [ids.setdefault(id(a), len(ids)) for a in arrays]))
            mx.async_eval(arrays)

        def eval(self, arrays: list[mx.array]) -> None:
            events.append(("wait", [ids[id(a)] for a in arrays]))
            mx.eval(arrays)

    monkeypatch.setattr(prefill, "mx", Spy())
    pipeline = prefill.BlockPipeline()
    blocks = [mx.ones(4) * i for i in range(4)]
    assert all(pipeline.start(block, None) for block in blocks)
    assert events == [("start", [0]), ("start", [1]), ("wait", [0]), ("start", [2]), ("wait", [1]),
                      ("start", [3]), ("wait", [2])]


def test_after_a_refusal_the_pipeline_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def refused(*arrays: Any) -> bool:
        calls.append(len(arrays))
        return False

    monkeypatch.setattr(prefill, "start_on_device", refused)
    pipeline = prefill.BlockPipeline()
    assert (pipeline.start(mx.ones(2)), pipeline.start(mx.ones(2))) == (False, False)
    assert calls == [1] and not pipeline.running


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral"])
def test_a_long_call_starts_every_block_but_the_last_and_gives_stock_logits(arch: str,
                                                                            starts: list[bool]) -> None:
    stock, patched = _pair(arch)
    cache, stock_cache = make_prompt_cache(patched), make_prompt_cache(stock)
    ours, theirs = patched(LONG, cache=cache), stock(LONG, cache=stock_cache)
    assert starts == [True] * (len(patched.model.layers) - 1)
    assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()
    token = mx.argmax(theirs[:, -1:], axis=-1)  # the caches hold the same keys and values
    ours, theirs = patched(token, cache=cache), stock(token, cache=stock_cache)
    assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()


def test_short_calls_training_and_traces_build_lazily(starts: list[bool]) -> None:
    _, patched = _pair()
    mx.eval(patched(LONG[:, :PIPELINE_TOKENS - 1]))
    patched.train()
    loss_and_grad = nn.value_and_grad(patched, lambda m, x: m(x).astype(mx.float32).mean())
    loss, grads = loss_and_grad(patched, LONG)
    mx.eval(loss, grads)
    patched.eval()
    graph = gk.trace(patched, LONG)
    assert graph.kernels()  # the trace recorded the kernels, lazily
    assert starts == []


def test_inside_mx_compile_the_first_refusal_lets_the_forward_go_on_lazily(starts: list[bool]) -> None:
    stock, patched = _pair()
    compiled = mx.compile(lambda x: patched(x))
    first = compiled(LONG)
    assert starts == [False]  # refused once, then no more tries in that trace
    assert mx.allclose(first, stock(LONG), atol=ATOL, rtol=RTOL).item()
    assert mx.array_equal(compiled(LONG), first).item()  # the replay runs no Python
    assert starts == [False]


Threads = Callable[[Callable[[], Any]], tuple[list[Any], list[Any]]]


def test_two_threads_prefilling_one_model_get_the_same_logits(two_live_threads: Threads,
                                                              starts: list[bool]) -> None:
    _, patched = _pair()
    alone = patched(LONG, cache=make_prompt_cache(patched))
    mx.eval(alone)

    def prefill() -> mx.array:
        logits = patched(LONG, cache=make_prompt_cache(patched))
        mx.eval(logits)  # in this thread: MLX's streams belong to the thread that made them
        return logits

    results, _ = two_live_threads(prefill)
    assert all(mx.array_equal(r, alone).item() for r in results)
    assert starts == [True] * (3 * (len(patched.model.layers) - 1))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A count of library layer launches, and prompts on the stock layers on this machine's backend
    as they are on CUDA."""
    count = count_layer_launches(monkeypatch)
    monkeypatch.setattr(prefill, "STOCK_PROMPT_BACKENDS", frozenset({active_backend()}))
    return count


SHORT = LONG[:, :100]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral"])
def test_a_short_prompt_runs_the_stock_layers_and_decoding_the_kernels(arch: str, launches: list[int],
                                                                       starts: list[bool]) -> None:
    stock, patched = _pair(arch)
    cache, stock_cache = make_prompt_cache(patched), make_prompt_cache(stock)
    ours, theirs = patched(SHORT, cache=cache), stock(SHORT, cache=stock_cache)
    assert launches == [0] and starts == []
    assert mx.array_equal(ours, theirs).item()  # the stock forward itself, on the shared weights
    assert all(mx.array_equal(a, b).item()
               for c, d in zip(cache, stock_cache) for a, b in zip(c.state, d.state))
    token = mx.argmax(theirs[:, -1:], axis=-1)
    ours, theirs = patched(token, cache=cache), stock(token, cache=stock_cache)
    assert launches[0] > 0  # one token: the kernels
    assert mx.allclose(ours, theirs, atol=ATOL, rtol=RTOL).item()


def test_short_prompts_run_the_kernels_when_traced_trained_or_asked(launches: list[int]) -> None:
    stock, patched = _pair()
    graph = gk.trace(patched, SHORT)
    assert graph.kernels() and launches[0] > 0  # a trace shows what the kernels do
    launches[0] = 0
    with prefill.kernels_only():
        ours = patched(SHORT)
    assert launches[0] > 0 and mx.allclose(ours, stock(SHORT), atol=ATOL, rtol=RTOL).item()
    launches[0] = 0
    patched.train()
    mx.eval(nn.value_and_grad(patched, lambda m, x: m(x).astype(mx.float32).mean())(patched, SHORT))
    assert launches[0] > 0


def test_a_stack_of_experts_pipelines_from_fewer_tokens(launches: list[int], starts: list[bool]) -> None:
    prompt = LONG[:, :SPARSE_PIPELINE_TOKENS]
    _, dense = _pair("llama")
    stock, sparse = _pair("mixtral")
    assert sparse.model.sparse and not dense.model.sparse
    mx.eval(dense(prompt))
    assert starts == [] and launches == [0]  # a dense stack gives this prompt to the stock layers
    ours = sparse(prompt)
    assert starts == [True] * (len(sparse.model.layers) - 1) and launches[0] > 0
    assert mx.allclose(ours, stock(prompt), atol=ATOL, rtol=RTOL).item()


def test_a_short_prompt_calls_the_replaced_blocks_straight_and_follows_changes_to_the_stack(
        launches: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """On the stock layers the replaced stack calls the replaced blocks straight (no patched
    block's call in between), the very objects while nothing changed; a block put in the list
    later, and weights loaded into the patched model, are what the next stock forward runs."""
    stock, patched = _pair()
    calls: list[str] = []
    real = KernelLayer.__call__

    def spy(self: KernelLayer, *args: Any, **kwargs: Any) -> Any:
        calls.append(type(self).__name__)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KernelLayer, "__call__", spy)
    assert mx.array_equal(patched(SHORT), stock(SHORT)).item()
    assert len(calls) == 1 and calls[0].endswith("DecoderStack") and launches == [0]
    # nothing changed: the replaced blocks themselves, not copies (the stack's list is shared)
    assert patched.model._stock_stack().layers[0] is patched.model.layers[0].original
    for model in (stock, patched):  # the first block twice: the stock forward must follow
        model.model.layers[1] = model.model.layers[0]
    assert mx.array_equal(patched(SHORT), stock(SHORT)).item()
    scaled = [(name, 1.5 * p) for name, p in tree_flatten(stock.parameters())]
    for model in (stock, patched):
        model.load_weights(scaled)
    assert mx.array_equal(patched(SHORT), stock(SHORT)).item()
    assert patched.model._stock_stack().layers[0] is not patched.model.layers[0].original
