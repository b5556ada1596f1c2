"""Tiny random-weight mlx-lm models, built from config dicts: no download, for tests and benchmarks.

Every config has hidden size 64, two layers and a vocabulary of 128; ``tiny_model`` seeds MLX's
random generator, so one (architecture, seed) always gives the same weights.

>>> model = tiny_model("llama")                                  # doctest: +SKIP
>>> model(mx.array([[1, 2, 3]])).shape                           # doctest: +SKIP
(1, 3, 128)
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from graphkern.errors import ModelError
from graphkern.nodes import Status

__all__ = ["DEEPSEEK_V3_CONFIG", "TINY_CONFIGS", "random_model", "tiny_model"]

_BASE: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 128,
}

#: ModelArgs dicts by architecture (``model_type`` is the mlx-lm module, after its remapping).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", **_BASE, "tie_word_embeddings": False},
    "mistral": {"model_type": "mistral", **_BASE, "rope_theta": 1e6, "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", **_BASE, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", **_BASE, "head_dim": 16, "max_position_embeddings": 512,
              "rope_theta": 1e6, "tie_word_embeddings": True},
    "gemma": {"model_type": "gemma", **_BASE, "head_dim": 16},
    "gemma2": {"model_type": "gemma2", **_BASE, "head_dim": 16, "query_pre_attn_scalar": 16.0},
    # its two layers one sliding-window (a window of 4, shorter than most prompts) and one global,
    # each with a RoPE of its own (the global one's scaled)
    "gemma3": {"model_type": "gemma3_text", **_BASE, "head_dim": 16, "query_pre_attn_scalar": 16.0,
               "sliding_window": 4, "sliding_window_pattern": 2, "rope_theta": 1e6,
               "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
               "max_position_embeddings": 512},
    "phi3": {"model_type": "phi3", **_BASE},
    "mixtral": {"model_type": "mixtral", **_BASE, "num_local_experts": 4, "num_experts_per_tok": 2},
}

#: A tiny DeepSeek V3 (multi-head latent attention, MoE routing; its RoPE turns 8 features of each
#: head): for ``random_model``, with ``rope_scaling`` added as wanted. Its attention has no fused
#: form, so it stays out of ``TINY_CONFIGS``.
DEEPSEEK_V3_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3", **_BASE, "num_key_value_heads": 4, "moe_intermediate_size": 32,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16,
    "max_position_embeddings": 512,
}


def tiny_model(arch: str, dtype: mx.Dtype = mx.float32, seed: int = 0) -> nn.Module:
    """A two-layer mlx-lm model of ``arch`` (a key of ``TINY_CONFIGS``) with random weights.

    Needs mlx-lm (``pip install graphkern[models]``).
    """
    if arch not in TINY_CONFIGS:
        raise ModelError("build a tiny mlx-lm model", f"unknown architecture {arch!r}; "
                          f"known: {sorted(TINY_CONFIGS)}", Status.INVALID_INPUT)
    return random_model(TINY_CONFIGS[arch], dtype, seed)


def random_model(config: dict[str, Any], dtype: mx.Dtype = mx.float32, seed: int = 0) -> nn.Module:
    """The mlx-lm model a ``config.json`` dict describes (``model_type`` picks the architecture),
    with random weights drawn after seeding MLX's generator, cast to ``dtype`` and evaluated.

    >>> config = {**TINY_CONFIGS["llama"], "num_hidden_layers": 4}      # doctest: +SKIP
    >>> len(random_model(config, mx.bfloat16).layers)                   # doctest: +SKIP
    4
    """
    try:
        from mlx_lm.utils import _get_classes
    except ImportError as exc:
        raise ModelError("build an mlx-lm model", "mlx-lm is not installed "
                          "(pip install 'graphkern[models]')", Status.BACKEND_UNAVAILABLE) from exc
    model_class, args_class = _get_classes(dict(config))
    importlib.import_module(model_class.__module__)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(dict(config)))
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model
