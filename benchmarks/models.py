"""A tiny mlx-lm llama: graphkern's wrapped+compiled forward vs the stock compiled forward.

Variants, all with the same weights and tokens, outputs evaluated, timed in alternation (medians):
  stock eager      model(tokens)
  stock compiled   mx.compile(model, inputs=model.state): how one compiles an mlx-lm model by hand
  wrapped          gk.wrap(model): traced once, then mx.compile with parameters as state
  wrapped+patched  wrap(patch(model)): RMSNorm, fused add+RMSNorm, RoPE and SwiGLU on library kernels
                   (CUDA kernels on an NVIDIA GPU; on CPU their pure-MLX references, so there it
                   measures graphkern's overhead and the references' cost, not GPU kernels)
Sizes: tiny and small (CPU-friendly), medium (a GPU-sized 8-layer model, hidden 1024).
Decoding (--decode N): per-token time of N steps after the prompt with an mlx-lm KV cache: stock
eager (how mlx-lm generates), wrap (new offsets run eagerly once a step was traced) and wrap with
trace_each_offset=True (a trace and an mx.compile per token).
Run: python benchmarks/models.py [--sizes tiny,small --length 32 --rounds 15 --number 20 --decode 32]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from _timing import forward_arguments, header, interleaved  # noqa: E402

from graphkern.models import patch, wrap  # noqa: E402
from graphkern.models.tiny import TINY_CONFIGS, tiny_model  # noqa: E402

#: Larger variants of the tiny llama config: small is still CPU-friendly, medium is for a GPU.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024},
    "medium": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
               "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000},
}


def _model(size: str) -> Any:
    saved = dict(TINY_CONFIGS["llama"])
    TINY_CONFIGS["llama"].update(SIZES[size])
    try:
        return tiny_model("llama")
    finally:
        TINY_CONFIGS["llama"].clear()
        TINY_CONFIGS["llama"].update(saved)


def bench(size: str, batch: int, length: int, rounds: int, number: int) -> dict[str, float]:
    stock_model, patched_model = _model(size), _model(size)  # same seed: same weights
    patch(patched_model)
    vocab = stock_model.args.vocab_size
    tokens = mx.random.randint(0, vocab, (batch, length), key=mx.random.key(1))
    variants = {
        "stock eager": stock_model,
        "stock compiled": mx.compile(stock_model, inputs=stock_model.state),
        "wrapped": wrap(stock_model),
        "wrapped+patched": wrap(patched_model),
    }
    reference = stock_model(tokens)
    for name, fn in variants.items():
        err = mx.abs(fn(tokens) - reference).max().item()  # TF32 matmuls, kernels: not bit-equal
        print(f"# {name}: max abs logit difference from stock eager {err:.2e} (logits up to "
              f"{mx.abs(reference).max().item():.1f})")
    def forward(fn: Any) -> Callable[[], None]:
        return lambda: mx.eval(fn(tokens))

    return interleaved({name: forward(fn) for name, fn in variants.items()}, rounds=rounds, number=number)


def decode(size: str, length: int, steps: int, rounds: int) -> dict[str, float]:
    """Seconds per decoded token (median over ``rounds`` generations of ``steps`` tokens each)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = _model(size)
    prompt = mx.random.randint(0, model.args.vocab_size, (1, length), key=mx.random.key(2))
    variants = {"stock eager": model, "wrapped": wrap(model),
                "wrapped, trace_each_offset": wrap(model, trace_each_offset=True)}

    def generation(call: Any) -> Callable[[], None]:
        def run() -> None:
            cache = make_prompt_cache(model)
            token = mx.argmax(call(prompt, cache=cache)[:, -1:], axis=-1)
            for _ in range(steps):
                token = mx.argmax(call(token, cache=cache)[:, -1:], axis=-1)
                mx.eval(token)
        return run

    times = interleaved({name: generation(call) for name, call in variants.items()}, rounds=rounds)
    return {name: seconds / steps for name, seconds in times.items()}


def main() -> None:
    parser = forward_arguments(batch=1)
    parser.add_argument("--sizes", default="tiny,small", help=f"comma-separated, of {sorted(SIZES)}")
    parser.add_argument("--decode", type=int, default=0, help="also time decoding this many tokens")
    args = parser.parse_args()
    device = "cuda" if mx.cuda.is_available() else "metal" if mx.metal.is_available() else "cpu"
    print(header(f"mlx-lm llama forward on {device}: graphkern wrap (+patch) vs stock mx.compile"))
    print(f"# tokens ({args.batch}, {args.length}); medians of {args.rounds} rounds")
    for size in args.sizes.split(","):
        number = args.number if size == "tiny" else max(2, args.number // 10)  # more work per call
        times = bench(size, args.batch, args.length, args.rounds, number)
        config = {**TINY_CONFIGS["llama"], **SIZES[size]}
        print(f"\n## {size}: hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, "
              f"vocab {config['vocab_size']} ({number} calls per sample)")
        stock = times["stock compiled"]
        for name, seconds in times.items():
            print(f"{name:>16}: {seconds * 1e6:9.1f} us/call   x{seconds / stock:.3f} of stock compiled")
        if args.decode:
            per_token = decode(size, args.length, args.decode, max(3, args.rounds // 3))
            print(f"decoding {args.decode} tokens after a {args.length}-token prompt (per token, "
                  "prompt included, one generation per sample):")
            for name, seconds in per_token.items():
                print(f"{name:>28}: {seconds * 1e6:9.1f} us/token   "
                      f"x{seconds / per_token['stock eager']:.3f} of stock eager")


if __name__ == "__main__":
    main()
