"""mlx-lm generation, stock model against the same model patched onto graphkern's kernels.

What a user runs: random-weight mlx-lm models (llama, qwen3, mixtral) at two sizes, generated with
mlx-lm's own loops: ``mlx_lm.generate.generate_step`` at batch 1 and ``BatchGenerator`` at batch 8
(where stock cannot run through it, as Gemma 2's attention cannot take its padding mask, both twins
decode 8 equal prompts through one KV cache instead, and the run says so).
Each model is run stock and patched (``gk.patch`` on a second model object sharing the weights),
both eagerly (how mlx-lm generates) and through ``gk.wrap``, taking turns within each round
(patched first in odd rounds, stock first in even ones; an odd ``--rounds`` gets one round more,
so that each side leads as often: a run after the other side's work can start slower, and with
three rounds patched would lead two):

  decode b1 / b8   tokens per second after the first token (batch 8 counts all 8 sequences)
  ttft P           time to the first token of a P-token prompt (prefill), milliseconds: the
                   median of TTFT_REPEATS calls a round
  peak memory      MLX's peak memory over a batch-1 generation from the longest prompt, weights
                   included (MB); its ratio is patched over stock

``--breakdown`` adds, per decoding step at each batch size, GPU kernel launches (all of them, and
graphkern's), GPU busy time against wall time, wall time per launch, and the kernels taking the
most GPU time by name (stock's beside patched's: where a patched model's GPU time goes): CUPTI's
kernel records through ``torch.profiler``, as ``gpu_kernels.py`` reads them; a batch-1 step's
host time taken apart (building its graph, handing it to the device, waiting: ``host_phases``);
and, for the longest prompt, the time to the first token taken apart (building the prefill's
graph, evaluating it, mlx-lm's ``mx.clear_cache()``, the first step) with the prefill's peak
memory.

``--twin`` adds a third model to every round: a second object of stock's class holding stock's
weights, not patched (``shared_twin``). Its rows (mode ``twin``) give twin over stock, what two
identical models differ by on this host in this run: a patched ratio inside that spread says
nothing. The twin leads the rounds patched does not, so each pair takes turns leading.

``--preset`` takes models at the dimensions of real checkpoints instead (``PRESETS``: Llama 3.2 1B and
3.1 8B, Mistral 7B, Qwen 2.5 1.5B, Qwen3 0.6B and 30B-A3B, Phi-3 mini, Gemma 2 2B, Gemma 3 1B, Mixtral
8x7B; ``--layers N`` keeps the first N blocks where memory or time demands, said in the output);
``--sweep`` runs every one of them (``SWEEP``), 16-bit and 4-bit, and ends on a table of ratios and
token agreement; for each it also compares the first decoded token's logits with stock's and, in
16-bit, each model's with the same step in float32 (a patched model no further from it than
``NO_WORSE`` times stock is). The patched model decodes on its default route, which on a GPU
measures its first decoding calls of each shape on the kernels and on the stock layers and keeps
the faster (``graphkern.models.route_timing``; here within the warm-up round): each run prints what
it chose, and the table's last column the choice at batch 1. ``--route kernel|stock`` sets the
patched model's route instead (``gk.set_route``): the kernels at every row count their limits allow,
or the stock layers, for measuring a route the measurement did not choose. ``--quantize 4|8 --group-size N``
quantizes the random-weight model as mlx-lm's converter does (``nn.quantize``: embeddings and
output layer included).

    python benchmarks/generate.py                                   # the default grid
    python benchmarks/generate.py --models llama --sizes large --dtypes bfloat16 --breakdown
    python benchmarks/generate.py --preset llama-3.2-1b --quantize 4 --dtypes bfloat16
    python benchmarks/generate.py --sizes tiny --rounds 1           # a CPU smoke run
    python benchmarks/generate.py --preset qwen3-30b-a3b --quantize 4 --quick   # a preset's CPU smoke run
    python benchmarks/generate.py --sweep --rounds 6 --tokens 32 --prefill 128   # every architecture
    python benchmarks/generate.py --sweep --quick --batches 1                    # the sweep's CPU smoke run
    python benchmarks/generate.py --preset gemma-2-2b --quantize 4 --batches 8 --twin  # and its noise
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
from _timing import header  # noqa: E402

import graphkern as gk  # noqa: E402
from graphkern.models import WrappedModel  # noqa: E402
from graphkern.models.patching import default_kernels, kernel_names  # noqa: E402
from graphkern.models.tiny import random_model  # noqa: E402

SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256},
    "small": {"hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 2816,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000},
    "large": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 5632,
              "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000},
}
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    "qwen3": {"model_type": "qwen3", "rms_norm_eps": 1e-6, "rope_theta": 1e6, "head_dim": 128,
              "max_position_embeddings": 32768, "tie_word_embeddings": True},
    "mixtral": {"model_type": "mixtral", "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "num_local_experts": 8, "num_experts_per_tok": 2},
}
_LLAMA3 = {"model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "head_dim": 64,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 131072}
_QWEN3 = {"rms_norm_eps": 1e-6, "rope_theta": 1e6, "head_dim": 128, "vocab_size": 151936,
          "max_position_embeddings": 40960}
#: Real checkpoints' config.json dimensions (random weights).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {**_LLAMA3, "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
                     "tie_word_embeddings": True,
                     "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama-3.1-8b": {**_LLAMA3, "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
                     "head_dim": 128, "tie_word_embeddings": False,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "qwen3-0.6b": {**_QWEN3, "model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 28,
                   "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
                   "tie_word_embeddings": True},
    "qwen3-30b-a3b": {**_QWEN3, "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
                      "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                      "tie_word_embeddings": False},
    "mixtral-8x7b": {"model_type": "mixtral", "rms_norm_eps": 1e-5, "rope_theta": 1e6, "hidden_size": 4096,
                     "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "vocab_size": 32000, "num_local_experts": 8,
                     "num_experts_per_tok": 2},
}
PRESETS |= {
    "mistral-7b": {"model_type": "mistral", "rms_norm_eps": 1e-5, "rope_theta": 1e6, "hidden_size": 4096,
                   "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32768,
                   "tie_word_embeddings": False},
    "qwen2.5-1.5b": {"model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1e6, "hidden_size": 1536,
                     "num_hidden_layers": 28, "intermediate_size": 8960, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "phi-3-mini": {"model_type": "phi3", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_size": 3072,
                   "num_hidden_layers": 32, "intermediate_size": 8192, "num_attention_heads": 32,
                   "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 4096,
                   "original_max_position_embeddings": 4096, "tie_word_embeddings": False},
    "gemma-2-2b": {"model_type": "gemma2", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_size": 2304,
                   "num_hidden_layers": 26, "intermediate_size": 9216, "num_attention_heads": 8,
                   "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000,
                   "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                   "final_logit_softcapping": 30.0},
    "gemma-3-1b": {"model_type": "gemma3_text", "rms_norm_eps": 1e-6, "hidden_size": 1152,
                   "num_hidden_layers": 26, "intermediate_size": 6912, "num_attention_heads": 4,
                   "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
                   "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
                   "rope_theta": 1e6, "rope_local_base_freq": 10000.0},
}
#: ``--sweep``: every mlx-lm architecture ``gk.patch`` touches, at a published checkpoint's
#: dimensions, with the blocks kept (None: all) where memory and one device call's time demand.
SWEEP: dict[str, int | None] = {
    "llama-3.2-1b": None, "llama-3.1-8b": 8, "mistral-7b": 8, "qwen2.5-1.5b": None, "qwen3-0.6b": None,
    "phi-3-mini": 16, "gemma-2-2b": None, "gemma-3-1b": None, "mixtral-8x7b": 4, "qwen3-30b-a3b": 8,
}
#: ``--quick``: a preset's architecture and options at a size a CPU runs in seconds.
QUICK = {"hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512, "moe_intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024}
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def config(arch: str, size: str) -> dict[str, Any]:
    cfg = {**ARCHS[arch], **SIZES[size]}
    if arch == "qwen3" and size == "tiny":
        cfg["head_dim"] = 16
    return cfg


def preset_config(name: str, layers: int | None, quick: bool) -> tuple[dict[str, Any], str]:
    """A preset's config (``layers`` blocks of it; ``quick``: at the QUICK size) and its label."""
    cfg = dict(PRESETS[name])
    if quick:
        cfg |= {k: v for k, v in QUICK.items() if k in cfg or k != "moe_intermediate_size"}
        # Gemma 3's model reads the cache of its first global layer: keep one
        cfg["num_hidden_layers"] = max(QUICK["num_hidden_layers"], cfg.get("sliding_window_pattern", 0))
    total = cfg["num_hidden_layers"]
    if layers is not None:
        cfg["num_hidden_layers"] = min(layers, total)
    label = f"{name}{' (quick size)' if quick else ''}, {cfg['num_hidden_layers']} of {total} layers"
    return cfg, label


def patch_selection(without: Sequence[str] = (), extra: Sequence[str] = ()) -> str | list[str]:
    """``patch(kernels=...)`` for the default kernels less ``without``, plus ``extra`` (opt-in
    kernels such as ``quantized_matvec``); ``"default"`` for neither."""
    if not without and not extra:
        return "default"
    return sorted((set(default_kernels()) | set(extra)) - set(without))


def twin_models(cfg: dict[str, Any], dtype: mx.Dtype, bits: int | None = None,
                group_size: int = 64, without: Sequence[str] = (), route: str = "auto",
                extra: Sequence[str] = ()) -> tuple[Any, Any]:
    """The stock model and a patched one sharing its weight arrays, in evaluation mode; ``bits``:
    both quantized as mlx-lm's converter quantizes (``nn.quantize``, every layer that has a
    quantized form: embeddings and output layer included); ``without`` / ``extra``: kernels the
    patch leaves out of its default / adds to it (:func:`patch_selection`); ``route``: the patched
    model's route."""
    import mlx.nn as nn

    stock = random_model(cfg, dtype)
    if bits is not None:
        nn.quantize(stock, group_size=group_size, bits=bits)
        mx.eval(stock.parameters())
    patched = shared_twin(stock, bits, group_size)
    gk.patch(patched, kernels=patch_selection(without, extra), route=route)
    stock.eval()  # as mlx_lm.load leaves a model
    patched.eval()
    return stock, patched


def shared_twin(stock: Any, bits: int | None = None, group_size: int = 64) -> Any:
    """A second model object of ``stock``'s class holding ``stock``'s weight arrays (quantized as
    ``stock`` was: ``bits``, ``group_size``), in evaluation mode and not patched."""
    import mlx.nn as nn

    twin = type(stock)(stock.args)  # lazy weights: replaced below before they are ever evaluated
    if bits is not None:
        nn.quantize(twin, group_size=group_size, bits=bits)
    twin.update(stock.parameters())
    twin.eval()
    return twin


def weight_megabytes(model: Any) -> float:
    """The weights a decoded token reads, MB: every parameter but the token embedding's table (one
    row of it is read; all of it where it is the output layer too), and of a mixture of experts'
    expert weights (mlx-lm's ``switch_mlp``) the share of experts a token takes. Over a step's
    time, the rate a decoding step reads its weights at: near the GPU's memory bandwidth, no
    kernel makes the step much faster."""
    from mlx.utils import tree_flatten

    args = model.args
    experts = getattr(args, "num_local_experts", None) or getattr(args, "num_experts", None)
    share = getattr(args, "num_experts_per_tok", 1) / experts if experts else 1.0
    tied = "lm_head" not in model
    total = 0.0
    for path, array in tree_flatten(model.parameters()):
        if "embed_tokens" in path and not tied:
            continue
        total += array.nbytes * (share if "switch_mlp" in path else 1.0)
    return total / 1e6


# ----------------------------------------------------------------------------- one measurement


def _cache_for(model: Any) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model.model if isinstance(model, WrappedModel) else model)


def steps_b1(model: Any, prompt: mx.array, tokens: int, batch: int = 1) -> Iterator[Any]:
    """``generate_step``'s decoding of ``prompt``, a token a ``next`` (``batch``: 1, taken so
    every ``steps_*`` loop is called alike)."""
    from mlx_lm.generate import generate_step

    yield from generate_step(prompt, model, max_tokens=tokens, prompt_cache=_cache_for(model))


def steps_batch(model: Any, prompt: mx.array, tokens: int, batch: int) -> Iterator[Any]:
    """mlx-lm's ``BatchGenerator`` decoding ``batch`` copies of ``prompt``, a step a ``next``."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, max_tokens=tokens, prefill_batch_size=batch,
                               completion_batch_size=batch)
    try:
        generator.insert([prompt.tolist()] * batch, max_tokens=[tokens] * batch)
        while generated := generator.next_generated():
            yield generated
    finally:
        generator.close()


def steps_together(model: Any, prompt: mx.array, tokens: int, batch: int) -> Iterator[Any]:
    """As ``steps_batch``, for a model mlx-lm's ``BatchGenerator`` cannot run (its attention
    cannot take the padding mask): ``batch`` copies of ``prompt`` through one KV cache, greedy
    steps pipelined as ``generate_step`` pipelines them."""
    cache = _cache_for(model)
    token = mx.argmax(model(mx.broadcast_to(prompt, (batch, prompt.size)), cache=cache)[:, -1], axis=-1)
    mx.async_eval(token)
    for _ in range(tokens - 1):
        following = mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)
        mx.async_eval(following)
        mx.eval(token)
        yield token
        token = following
    mx.eval(token)
    yield token


def timed(steps: Iterator[Any]) -> tuple[float, float]:
    """(seconds to the first step of ``steps``, seconds per later step)."""
    start = time.perf_counter()
    next(steps)
    first = time.perf_counter()
    count = sum(1 for _ in steps)
    end = time.perf_counter()
    return first - start, (end - first) / max(count, 1)


def generate_b1(model: Any, prompt: mx.array, tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds per later token) of ``generate_step``."""
    return timed(steps_b1(model, prompt, tokens))


def batch_decoding(stock: Any, prompt: mx.array, batch: int) -> tuple[Callable[..., Iterator[Any]], str]:
    """How to decode ``batch`` copies of ``prompt`` on both twins: ``steps_b1`` at one row,
    ``steps_batch`` and no note where stock runs through ``BatchGenerator``, else
    ``steps_together`` and why."""
    if batch == 1:
        return steps_b1, ""
    try:
        timed(steps_batch(stock, prompt[:4], 2, batch))
    except ValueError as exc:
        return steps_together, (f"decode b{batch}: one KV cache, equal prompts; mlx-lm's "
                                f"BatchGenerator fails on stock ({exc})"[:240])
    return steps_batch, ""


def peak_memory_mb(run: Callable[[], object]) -> float:
    """MLX's peak memory (weights included, MB) over ``run``, from a cleared pool."""
    mx.clear_cache()
    mx.reset_peak_memory()
    run()
    return mx.get_peak_memory() / 2**20


# ----------------------------------------------------------------------------- the grid

#: A time to first token is one prefill (milliseconds) and varies with the host from call to
#: call; each round takes the median of this many.
TTFT_REPEATS = 5


def measure(label: str, cfg: dict[str, Any], dtype_name: str, args: argparse.Namespace) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    stock, patched = twin_models(cfg, dtype, args.quantize, args.group_size, args.without, args.route,
                                 args.extra)
    vocab = cfg["vocab_size"]
    variants: dict[str, Any] = {"stock": stock, "patched": patched}
    if "wrap" in args.modes:
        variants |= {"stock wrap": gk.wrap(stock), "patched wrap": gk.wrap(patched)}
    if "eager" not in args.modes:
        variants = {k: v for k, v in variants.items() if "wrap" in k}
    elif args.twin:  # first: it leads the rounds patched does not, so each pair takes turns leading
        variants = {"twin": shared_twin(stock, args.quantize, args.group_size), **variants}
    prompts = {p: mx.random.randint(0, vocab, (p,), key=mx.random.key(p)) for p in args.prefill}
    short = prompts[min(args.prefill)]
    decoders = {batch: batch_decoding(stock, short, batch) for batch in args.batches}
    notes = [note for _, note in decoders.values() if note]
    tasks: dict[str, Callable[[Any], float]] = {
        f"decode b{batch}": lambda m, b=batch, steps=steps: b / timed(steps(m, short, args.tokens, b))[1]
        for batch, (steps, _) in decoders.items()}
    for length, prompt in prompts.items():
        tasks[f"ttft {length}"] = lambda m, p=prompt: 1e3 * statistics.median(
            generate_b1(m, p, 2)[0] for _ in range(TTFT_REPEATS))
    longest = prompts[max(args.prefill)]
    tasks["peak memory"] = lambda m: peak_memory_mb(lambda: generate_b1(m, longest, args.tokens))
    samples: dict[tuple[str, str], list[float]] = {}
    errors: dict[tuple[str, str], str] = {}
    for round_index in range(args.rounds + 1):  # round 0 warms up: kernels compile, traces run
        # patched first in odd rounds, stock first in even ones (``balanced_rounds``): neither a
        # host drifting within a round nor leading a round favours a side over a pair of rounds
        order = list(variants.items())[::-1 if round_index % 2 else 1]
        for task, run in tasks.items():
            for name, model in order:
                if (task, name) in errors:
                    continue
                try:
                    value = run(model)
                except Exception as exc:  # a variant that cannot run is reported, the rest go on
                    errors[(task, name)] = f"{type(exc).__name__}: {exc}"[:160]
                    continue
                if round_index:
                    samples.setdefault((task, name), []).append(value)
    rows = []
    for task in tasks:
        # (mode, the stock side, the side set against it): a twin row is twin over stock
        for mode, base, other in (("eager", "stock", "patched"), ("wrap", "stock wrap", "patched wrap"),
                                  ("twin", "stock", "twin")):
            if base not in variants or other not in variants:
                continue
            s, p = samples.get((task, base)), samples.get((task, other))
            row = {"task": task, "mode": mode,
                   "stock": statistics.median(s) if s else None,
                   "patched": statistics.median(p) if p else None,
                   "errors": [errors[k] for k in ((task, base), (task, other)) if k in errors]}
            if s and p:  # per round, so drift between rounds cancels
                pairs = [b / a for a, b in zip(s, p)]
                # decode: patched speed over stock; peak memory: patched over stock; ttft: stock over patched
                ratios = pairs if task.startswith(("decode", "peak")) else [1 / r for r in pairs]
                row["speedup"] = statistics.median(ratios)
                row["speedup_range"] = [min(ratios), max(ratios)]
                row["speedup_rounds"] = ratios
            rows.append(row)
    weights = f"{args.quantize}-bit, group {args.group_size}" if args.quantize else dtype_name
    result = {"model": label, "dtype": dtype_name, "weights": weights, "rows": rows,
              "weight_mb": weight_megabytes(stock), "routes": measured_routes(patched), "notes": notes}
    if args.agreement:
        result["agreement"] = token_agreement(stock, patched, short, args.agreement)
        result["first_logits"] = first_logits(stock, patched, short, dtype)
    if args.breakdown:
        twins = (("stock", stock), ("patched", patched))
        result["breakdown"] = {f"{name}, batch {b}": breakdown(steps(model, short, args.tokens, b))
                               for b, (steps, _) in decoders.items() for name, model in twins}
        result["host_phases"] = {name: host_phases(model, short, args.tokens) for name, model in twins}
        longest = max(args.prefill)
        result["prefill_breakdown"] = {f"{name}, {longest} tokens": prefill_breakdown(model, prompts[longest])
                                       for name, model in twins}
    return result


def token_agreement(stock: Any, patched: Any, prompt: mx.array, tokens: int) -> float:
    """The share of ``tokens`` greedy tokens (``generate_step``) the patched model gives as stock
    does, position by position."""
    from mlx_lm.generate import generate_step

    runs = [[int(t) for t, _ in generate_step(prompt, m, max_tokens=tokens, prompt_cache=_cache_for(m))]
            for m in (stock, patched)]
    return sum(a == b for a, b in zip(*runs)) / max(len(runs[0]), 1)


def first_logits(stock: Any, patched: Any, prompt: mx.array, dtype: mx.Dtype) -> dict[str, Any]:
    """The logits of the first decoded token (stock's greedy choice after ``prompt``), patched
    against stock: the largest difference, whether it is within the model tolerance of ``dtype``
    (``MODEL_TOLERANCES``), and stock's gap between its two best tokens (random weights give flat
    logits, so greedy agreement in 16-bit turns on differences far inside the tolerance). A
    decoding step, not the prompt: a short prompt runs the stock layers.

    In 16-bit, also each model's distance from the same step computed in float32 (stock's layers,
    the same weights, every floating-point parameter and activation in float32): 16-bit rounding
    alone can move a logit past the tolerance, and what matters is that the patched model is no
    further from that truth than stock is (``no_worse``: at most ``NO_WORSE`` times stock's)."""
    from mlx_lm.models.cache import make_prompt_cache

    from graphkern.models import MODEL_TOLERANCES

    models = [stock, patched] + ([] if dtype == mx.float32 else [_float32_twin(stock)])
    caches = [make_prompt_cache(m) for m in models]
    token = mx.argmax(stock(prompt[None], cache=caches[0])[:, -1:], axis=-1)
    for m, c in zip(models[1:], caches[1:]):
        m(prompt[None], cache=c)
    logits = [m(token, cache=c)[0, -1].astype(mx.float32) for m, c in zip(models, caches)]
    a, b = logits[:2]
    atol, rtol = MODEL_TOLERANCES[dtype]
    second, best = mx.sort(a)[-2:].tolist()
    found = {"max_diff": mx.abs(a - b).max().item(), "within": mx.allclose(b, a, atol=atol, rtol=rtol).item(),
             "top2_gap": best - second}
    if len(logits) == 3:
        truth = logits[2]
        stock_err, patched_err = (float(mx.abs(x - truth).max().item()) for x in (a, b))
        found.update(stock_vs_float32=stock_err, patched_vs_float32=patched_err,
                     no_worse=patched_err <= NO_WORSE * stock_err)
    return found


#: How much further from the float32 truth than stock a patched 16-bit model's logits may be.
NO_WORSE = 1.5


def _float32_twin(model: Any) -> Any:
    """A copy of ``model`` (stock's layers) whose floating-point parameters are float32: its
    quantized weights as they are, their scales and biases, norms and embeddings in float32."""
    import copy

    from mlx.utils import tree_map

    twin = copy.deepcopy(model)
    twin.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                         twin.parameters()))
    twin.eval()
    return twin


def measured_routes(model: Any) -> dict[str, dict[str, Any]]:
    """The decoding routes the patched model's stack measured and chose (``"auto"`` route on a
    GPU: ``graphkern.models.route_timing``), by call shape: ``"bB"`` for B rows of one token,
    ``"bB, L tokens"`` for more."""
    from graphkern.models.route_timing import decode_route_choices

    return {f"b{shape[0]}" + (f", {shape[1]} tokens" if shape[1] > 1 else ""): choice
            for stack in decode_route_choices(model).values() for shape, choice in stack.items()}


def routes_line(result: dict[str, Any]) -> str:
    """What a run prints of the routes its patched model chose (empty: none measured)."""
    def one(shape: str, c: dict[str, Any]) -> str:
        times = ", ".join(f"{r} {c[r + '_ms']:.3f} ms" for r in ("kernels", "stock")
                          if c[r + "_ms"] is not None)
        return f"{shape}: {c['route'] or 'still measuring'} ({times} a call)"

    routes = result.get("routes") or {}
    return "- decoding routes measured: " + "; ".join(one(k, c) for k, c in routes.items()) if routes else ""


def agreement_line(result: dict[str, Any]) -> str:
    """What a sweep prints of one model's agreement with stock."""
    first = result.get("first_logits")
    line = f"- greedy tokens agree: {result['agreement']:.0%}"
    if first:
        line += (f"; the first decoded token's logits differ by {first['max_diff']:.3g} "
                 f"({'within' if first['within'] else 'PAST'} the model tolerance), stock's two best "
                 f"{first['top2_gap']:.3g} apart")
        if "no_worse" in first:
            line += (f"; from the float32 step: stock {first['stock_vs_float32']:.3g}, patched "
                     f"{first['patched_vs_float32']:.3g} ({'within' if first['no_worse'] else 'MORE than'} "
                     f"{NO_WORSE}x stock's)")
    return line


# ----------------------------------------------------------------------------- per-token breakdown


@contextlib.contextmanager
def _kernel_records() -> Iterator[list[Any]]:
    """CUPTI's kernel records of the block, through torch.profiler (empty without torch/CUDA)."""
    found: list[Any] = []
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        yield found
        return
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield found
    found.extend(e for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
                 if e.device_type().name == "CUDA")


#: The kernels ``--breakdown`` lists by GPU time a decoded token, longest first.
TOP_KERNELS = 12


def breakdown(steps: Iterator[Any]) -> dict[str, Any]:
    """Per decoding step of ``steps`` (one of the ``steps_*`` loops) after the first two: launches,
    graphkern launches, GPU busy and wall time (us), and under ``"kernels"`` the ``TOP_KERNELS``
    kernel names by their GPU time (us, launches)."""
    next(steps)
    next(steps)
    count = 0
    with _kernel_records() as records:
        start = time.perf_counter()
        for _ in steps:
            count += 1
        wall = time.perf_counter() - start
    count = max(count, 1)
    if not records:
        return {"wall_us": 1e6 * wall / count}
    kernels = [r for r in records if "memcpy" not in r.name().lower() and "memset" not in r.name().lower()]
    ours = sum(1 for r in kernels if "gk_" in r.name())
    busy = sum(r.duration_ns() for r in kernels) / 1e3
    launches = len(kernels) / count
    by_name: dict[str, list[float]] = {}
    for r in kernels:
        entry = by_name.setdefault(r.name()[:80], [0.0, 0.0])
        entry[0] += r.duration_ns() / 1e3 / count
        entry[1] += 1 / count
    top = sorted(by_name.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return {"launches": launches, "graphkern_launches": ours / count, "gpu_busy_us": busy / count,
            "wall_us": 1e6 * wall / count, "wall_us_per_launch": 1e6 * wall / count / launches,
            "kernels": {name: {"us": us, "launches": n} for name, (us, n) in top}}


def host_phases(model: Any, prompt: mx.array, steps: int) -> dict[str, float]:
    """A batch-1 greedy decoding step's time taken apart, unpipelined so the parts add up to the
    step (us, medians over ``steps`` steps after a warm-up): building its graph (the forward and
    the choice of token), handing it to the device (``mx.async_eval``: encoding every launch),
    and waiting for the token. ``generate_step`` overlaps the wait with building the next step,
    so where build and hand-over together outlast the wait, they are what a token costs."""
    from mlx_lm.generate import generation_stream

    cache = _cache_for(model)
    rows = []
    with mx.stream(generation_stream):
        token = mx.argmax(model(prompt[None], cache=cache)[:, -1:], axis=-1)
        mx.eval(token)
        for index in range(steps + 4):  # four steps warm up
            start = time.perf_counter()
            token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
            built = time.perf_counter()
            mx.async_eval(token)
            handed = time.perf_counter()
            mx.eval(token)
            done = time.perf_counter()
            if index >= 4:
                rows.append((built - start, handed - built, done - handed))
    names = ("build_us", "hand_over_us", "wait_us")
    return {name: 1e6 * statistics.median(column) for name, column in zip(names, zip(*rows))}


def prefill_breakdown(model: Any, prompt: mx.array, repeats: int = TTFT_REPEATS) -> dict[str, float]:
    """``generate_step``'s way to the first token of ``prompt`` (one prefill chunk: up to 2049
    tokens) taken apart, medians of ``repeats`` calls: building the prefill's graph, evaluating the
    KV cache, ``mx.clear_cache()`` (which mlx-lm calls after each chunk, so the next prompt allocates
    afresh), the first step (ms); and the prefill's peak memory, weights included (MB)."""
    from mlx_lm.generate import generation_stream

    rows = []
    for _ in range(repeats + 1):  # the first call warms up
        cache = _cache_for(model)
        with mx.stream(generation_stream):
            mx.reset_peak_memory()
            start = time.perf_counter()
            model(prompt[:-1][None], cache=cache)
            built = time.perf_counter()
            mx.eval([c.state for c in cache])
            evaluated = time.perf_counter()
            peak = mx.get_peak_memory() / 2**20
            mx.clear_cache()
            cleared = time.perf_counter()
            mx.eval(mx.argmax(model(prompt[-1:][None], cache=cache)[:, -1, :], axis=-1))
            stepped = time.perf_counter()
        rows.append((built - start, evaluated - built, cleared - evaluated, stepped - cleared,
                     stepped - start, peak))
    names = ("build_ms", "evaluate_ms", "clear_cache_ms", "first_step_ms", "total_ms", "peak_mb")
    medians = [statistics.median(column) for column in zip(*rows[1:])]
    return {name: value * (1e3 if name.endswith("_ms") else 1) for name, value in zip(names, medians)}


# ----------------------------------------------------------------------------- output


def _cell(value: float | None, task: str) -> str:
    if value is None:
        return "failed"
    if task.startswith("peak"):
        return f"{value:.0f} MB"
    return f"{value:.1f} tok/s" if task.startswith("decode") else f"{value:.1f} ms"


def format_result(result: dict[str, Any]) -> str:
    twin = any(row.get("mode") == "twin" for row in result["rows"])
    lines = [f"\n## {result['model']}, {result['dtype']}, weights {result['weights']}",
             f"| task | mode | stock | patched{' (mode twin: the twin)' if twin else ''} | ratio (speed: "
             "patched / stock; memory: patched / stock) | rounds' range | each round (patched leads the "
             "1st, 3rd...) |",
             "|---|---|---:|---:|---:|---:|---|"]
    for row in result["rows"]:
        speed = f"{row['speedup']:.3f}x" if "speedup" in row else "-"
        spread = "{:.3f}-{:.3f}x".format(*row["speedup_range"]) if "speedup_range" in row else "-"
        each = ", ".join(f"{r:.3f}" for r in row.get("speedup_rounds", ())) or "-"
        lines.append(f"| {row['task']} | {row['mode']} | {_cell(row['stock'], row['task'])} | "
                     f"{_cell(row['patched'], row['task'])} | {speed} | {spread} | {each} |")
        lines += [f"|  | error | {e} | | | | |" for e in row["errors"]]
    if routes_line(result):
        lines.append(routes_line(result))
    lines += [f"- {note}" for note in result.get("notes", [])]
    for name, b in result.get("breakdown", {}).items():
        lines.append(f"- per decoding step, {name}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in b.items() if k != "kernels"))
        lines += [f"  - {k['us']:8.1f} us, {k['launches']:5.1f} launches: {kernel}"
                  for kernel, k in b.get("kernels", {}).items()]
    for name, b in result.get("host_phases", {}).items():
        lines.append(f"- a decoding step's host time, batch 1, {name}: " + ", ".join(
            f"{k} {v:.1f}" for k, v in b.items()))
    for name, b in result.get("prefill_breakdown", {}).items():
        lines.append(f"- to the first token, {name}: " + ", ".join(
            f"{k} {v:.2f}" for k, v in b.items()))
    return "\n".join(lines)


def sweep_table(results: list[dict[str, Any]]) -> str:
    """One line a model and weights: each task's median ratio (patched over stock: above 1 is
    faster), its lowest round, the greedy token agreement, and the rate stock's decoding at batch
    1 reads the weights at (``weight_megabytes``, GB/s)."""
    tasks = [_column(row) for row in results[0]["rows"]] if results else []
    lines = ["\n## sweep: ratio (lowest round)",
             "| model | weights | " + " | ".join(tasks)
             + " | tokens agree | stock b1 weights GB/s | b1 route |",
             "|---|---|" + "---:|" * (len(tasks) + 2) + "---|"]
    for result in results:
        cells = []
        for row in result["rows"]:
            if "speedup" in row:
                cells.append(f"{row['speedup']:.3f}x ({row['speedup_range'][0]:.2f})")
            else:
                cells.append("failed")
        agree = result.get("agreement")
        b1 = next((row["stock"] for row in result["rows"]
                   if row["task"] == "decode b1" and row["stock"]), None)
        rate = "-" if b1 is None or "weight_mb" not in result else f"{result['weight_mb'] * b1 / 1e3:.0f}"
        b1_route = (result.get("routes") or {}).get("b1", {}).get("route") or "-"
        lines.append(f"| {result['model']} | {result['weights']} | " + " | ".join(cells)
                     + f" | {'-' if agree is None else f'{agree:.0%}'} | {rate} | {b1_route} |")
    return "\n".join(lines)


def _column(row: dict[str, Any]) -> str:
    """A row's column in the sweep's table: its task, and its mode where not eager (``twin``)."""
    mode = row.get("mode", "eager")
    return row["task"] if mode == "eager" else f"{row['task']} {mode}"


def balanced_rounds(rounds: int) -> int:
    """``rounds`` timed rounds, one more where odd: the sides take turns leading a round, and
    only an even count lets each lead as often (a run right after the other side's work, or after
    the previous task's, can start slower, which with three rounds would fall on patched twice).

    >>> balanced_rounds(3), balanced_rounds(4)
    (4, 4)
    """
    return rounds + rounds % 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,qwen3,mixtral")
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--modes", default="eager,wrap", help="eager, wrap or both")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prefill", help="prompt lengths for ttft (default 256,2048; --quick: 32)")
    parser.add_argument("--tokens", type=int, help="tokens generated per decode run (default 64; --quick: 8)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="timed rounds after the warm-up one; an odd count gets one more "
                        "(balanced_rounds)")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--preset", help="models at real checkpoints' dimensions instead of --models and "
                        f"--sizes: {', '.join(PRESETS)}")
    parser.add_argument("--layers", type=int, help="keep the first N blocks of a preset")
    parser.add_argument("--quantize", type=int, choices=(4, 8), help="quantize the weights (nn.quantize)")
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    parser.add_argument("--quick", action="store_true",
                        help="a preset at a CPU's size: 2 blocks of 256, one round of 8 tokens (or "
                        "--tokens) after a 32-token prompt (or --prefill), batch 1")
    parser.add_argument("--sweep", action="store_true",
                        help="every architecture gk.patch touches at a checkpoint's dimensions (SWEEP), "
                        "16-bit and --sweep-bits: decode b1 and b8, ttft, token agreement")
    parser.add_argument("--sweep-bits", default="4", help="the quantized runs of the sweep (comma list; "
                        "empty: none)")
    parser.add_argument("--agreement", type=int, default=0,
                        help="also compare this many greedy tokens of stock and patched")
    parser.add_argument("--twin", action="store_true",
                        help="also time a second, unpatched model object sharing stock's weights (rows "
                        "of mode 'twin': twin over stock, what two identical models differ by here)")
    parser.add_argument("--without", default="", help="kernels the patch leaves out of its default "
                        "(comma list of patch(kernels=...) names): what the others alone make of a model")
    parser.add_argument("--with", dest="extra", default="", help="opt-in kernels the patch adds to its "
                        "default (comma list: quantized_matvec)")
    parser.add_argument("--route", default="auto", choices=("auto", "kernel", "stock"),
                        help="the patched model's route (gk.patch(route=...)); auto measures")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    unknown = sorted(set((args.preset or "").split(",")) - set(PRESETS) - {""})
    if unknown:
        parser.error(f"unknown presets {unknown}; known: {', '.join(PRESETS)}")
    args.tokens = args.tokens or (8 if args.quick else 64)
    args.prefill = args.prefill or ("32" if args.quick else "256,2048")
    if args.quick:  # a smoke run: one round, its ratios are not figures
        args.rounds = 1
        args.batches = args.batches if args.sweep else "1"
    else:
        args.rounds = balanced_rounds(args.rounds)
    args.modes = args.modes.split(",")
    args.without = [k for k in args.without.split(",") if k]
    args.extra = [k for k in args.extra.split(",") if k]
    unknown_kernels = sorted(set(args.without + args.extra) - set(kernel_names()))
    if unknown_kernels:
        parser.error(f"unknown kernels {unknown_kernels}; known: {', '.join(kernel_names())}")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.prefill = [int(p) for p in args.prefill.split(",")]
    if args.sweep:
        return run_sweep(args)
    print(header("mlx-lm generation: stock vs patched onto graphkern kernels"), flush=True)
    print(f"# rounds {args.rounds}, {args.tokens} tokens a decode run; speed ratio = patched "
          "tokens/s over stock (decode) or stock time over patched (ttft), median over rounds, "
          "and the lowest and highest round" + _patch_options(args))
    if args.preset:
        models = [preset_config(name, args.layers, args.quick) for name in args.preset.split(",")]
    else:
        models = [(config(arch, size), f"{arch} {size}") for arch in args.models.split(",")
                  for size in args.sizes.split(",")]
    results = []
    for cfg, label in models:
        for dtype_name in args.dtypes.split(","):
            result = measure(label, cfg, dtype_name, args)
            results.append(result)
            print(format_result(result), flush=True)
            mx.clear_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def _patch_options(args: argparse.Namespace) -> str:
    """What the headers say of ``--without``, ``--with`` and ``--route``."""
    route = f"; patched on the {args.route} route" if args.route != "auto" else ""
    return ((f"; patched without {', '.join(args.without)}" if args.without else "")
            + (f"; patched with {', '.join(args.extra)}" if args.extra else "") + route)


def run_sweep(args: argparse.Namespace) -> int:
    """``--sweep``: each SWEEP preset (``--preset`` narrows it), in the first of ``--dtypes`` and
    quantized to each of ``--sweep-bits``, stock and patched taking turns within each round."""
    names = args.preset.split(",") if args.preset else list(SWEEP)
    args.modes, args.breakdown = ["eager"], False
    args.agreement = args.agreement or 32
    dtype_name = args.dtypes.split(",")[0]
    bits = [None, *(int(b) for b in args.sweep_bits.split(",") if b)]
    print(header("mlx-lm generation sweep: stock vs patched onto graphkern kernels"), flush=True)
    print(f"# rounds {args.rounds}, {args.tokens} tokens a decode run, prompts {args.prefill}, "
          f"{args.agreement} greedy tokens compared; ratio = patched speed over stock, median over rounds"
          + _patch_options(args))
    results = []
    for name in names:
        cfg, label = preset_config(name, args.layers or SWEEP.get(name), args.quick)
        for quantize in bits:
            args.quantize = quantize
            try:
                result = measure(label, cfg, dtype_name, args)
            except Exception as exc:  # one architecture that cannot run is reported, the rest go on
                print(f"\n## {label}: failed: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            results.append(result)
            print(format_result(result), "\n" + agreement_line(result), flush=True)
            mx.clear_cache()
    print(sweep_table(results), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
