"""Models as users have them: checkpoint folders written by mlx-lm's own save functions (4-bit and
8-bit ones by its converter), loaded with ``mlx_lm.load``, then patched, generated from, wrapped and
traced. On the CPU a float32 patched model equals the stock one to the last bit, logits and greedy
tokens; in bfloat16 (scales and activations) the logits agree within the model tolerance
(``MODEL_TOLERANCES``: the kernels compute in float32 inside where stock rounds every op)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from model_comparisons import same_values

import graphkern as gk
from graphkern.debugging.tolerance import MODEL_TOLERANCES, within
from graphkern.models import prefill
from graphkern.models.checkpoint import write_checkpoint
from graphkern.nodes import dtype_name

mlx_lm = pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402

CASES = [("llama", None, mx.float32), ("llama", 4, mx.float32), ("llama", 8, mx.float32),
         ("qwen3", 4, mx.float32), ("mixtral", 4, mx.float32), ("llama", 4, mx.bfloat16),
         ("qwen3", 8, mx.bfloat16)]
IDS = [f"{a}-{b or 'float'}-{dtype_name(d)}" for a, b, d in CASES]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("checkpoints")
    return {name: write_checkpoint(base / name, arch, quantize=bits, dtype=dtype)
            for name, (arch, bits, dtype) in zip(IDS, CASES)}


def _greedy(model: object, prompt: mx.array, n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n)]


def _same(got: mx.array, expected: mx.array) -> bool:
    if expected.dtype == mx.float32:
        return same_values(got, expected)
    atol, rtol = MODEL_TOLERANCES[expected.dtype]
    return within(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize(("arch", "bits", "dtype"), CASES, ids=IDS)
def test_loaded_checkpoint_patches_wraps_and_traces(folders: dict, arch: str, bits: int | None,
                                                    dtype: mx.Dtype) -> None:
    model, tokenizer = mlx_lm.load(str(folders[f"{arch}-{bits or 'float'}-{dtype_name(dtype)}"]))
    if bits:
        assert any(type(m).__name__ == "QuantizedLinear" for _, m in model.named_modules())
    prompt = mx.array(tokenizer.encode("the quick brown fox jumps over the lazy dog"))
    stock_logits = model(prompt[None])
    stock_tokens = _greedy(model, prompt, 8)

    report = gk.patch(model)
    assert len(report) > 0 and not report.unmatched
    with prefill.kernels_only():
        assert _same(model(prompt[None]), stock_logits)
    if dtype == mx.float32:  # mlx-lm's own loop: prefill, then decode steps
        assert _greedy(model, prompt, 8) == stock_tokens

    wrapped = gk.wrap(model)
    assert _same(wrapped(prompt[None]), stock_logits)
    graph = gk.trace(model, prompt[None])
    assert graph.status == gk.Status.OK
    scopes = {graph.nx.nodes[n].get("scope", "") for n in graph.nodes("kernel")}
    for layer in range(len(model.model.layers)):
        assert any(s.startswith(f"model.layers.{layer}.") or s == f"model.layers.{layer}" for s in scopes)
    gk.unpatch(model)
    assert same_values(model(prompt[None]), stock_logits)
