"""benchmarks/block_projections.py: its two sides compute the same block, so the times it prints
compare like with like."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import block_projections  # noqa: E402

#: (hidden, attention outputs, intermediate): a Llama-like, a Phi-3-like (one fused qkv) and a
#: Gemma-2-like block (queries narrower than the hidden size).
SMALL = {"separate": (128, (128, 32, 32), 256), "fused": (128, (384,), 256),
         "narrow queries": (192, (128, 64, 64), 256)}


@pytest.mark.parametrize("geglu", [False, True], ids=["swiglu", "geglu"])
@pytest.mark.parametrize("weights", ["bf16", "4bit", "8bit"])
@pytest.mark.parametrize("layout", list(SMALL))
def test_the_fused_and_the_stock_block_agree(layout: str, weights: str, geglu: bool) -> None:
    hidden, outs, inner = SMALL[layout]
    bits = 0 if weights == "bf16" else int(weights[0])
    layers = [block_projections._layer(hidden, outs, inner, weights, mx.random.key(i)) for i in range(2)]
    x = mx.random.normal((2, hidden), key=mx.random.key(7)).astype(mx.bfloat16)
    r = (0.1 * mx.random.normal((2, hidden), key=mx.random.key(8))).astype(mx.bfloat16)
    ours = block_projections._stack(block_projections.block_ours(bits, geglu), x, r, layers)
    stock = block_projections._stack(block_projections.block_stock(bits, geglu), x, r, layers)
    assert [a.shape for a in ours] == [b.shape for b in stock]
    # bfloat16 outputs up to 5, after two blocks: within four ulp at that scale (1/64). The plain
    # kernels normalize in float32 where stock rounds the normalized rows to bfloat16.
    for a, b in zip(ours, stock):
        assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=2**-4, rtol=0).item()


def test_the_weights_bytes_count_every_array_read() -> None:
    layer = block_projections._layer(128, (384,), 256, "4bit", mx.random.key(0))
    packed = (384 + 2 * 256) * 128 // 2  # 4-bit words
    groups = (384 + 2 * 256) * (128 // block_projections.GROUP_SIZE) * 2 * 2  # bf16 scales and biases
    assert block_projections._nbytes(layer) == packed + groups


def test_a_launch_past_shared_memory_is_said_not_measured() -> None:
    assert block_projections.fits("llama-3.2-1b", "bf16", 1)
    assert not block_projections.fits("mistral-7b", "bf16", 8)  # 8 rows of 4096 bfloat16: 64 KiB
