"""Tiny mlx-lm checkpoint folders, written offline: what ``mlx_lm.load`` and the ``--model`` option
of the command line read, for tests, benchmarks and trying the commands without a download.

A folder holds the random weights of a :func:`~graphkern.models.tiny.tiny_model` (saved with
mlx-lm's ``save_model`` and ``save_config``), a word-level tokenizer trained on a few sentences
(``tokenizers``, saved as a Hugging Face tokenizer folder) with a short chat template, and, with
``quantize=4`` (or 8), the weights quantized by mlx-lm's own converter (``mlx_lm.convert``).

>>> folder = write_checkpoint("/tmp/tiny-llama-4bit", "llama", quantize=4)   # doctest: +SKIP
>>> model, tokenizer = mlx_lm.load(str(folder))                              # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from graphkern.models.tiny import TINY_CONFIGS, random_model
from graphkern.nodes import KernelError, Status

__all__ = ["CHAT_TEMPLATE", "write_checkpoint"]

_WRITE = "write a tiny mlx-lm checkpoint"

#: A chat template in the usual role-tag form (``<|user|> hi <|assistant|>``).
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

_SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
_SENTENCES = [
    "hi there , how are you today ?",
    "the quick brown fox jumps over the lazy dog .",
    "a kernel is a small program that runs on the gpu .",
    "graphs show where a value went wrong and why .",
    "tell me a story about a model that learned to count to ten .",
]


def _tokenizer(vocab_size: int) -> object:
    """A word-level ``PreTrainedTokenizerFast`` over :data:`_SENTENCES` (at most ``vocab_size`` ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    core.train_from_iterator(_SENTENCES, trainers.WordLevelTrainer(vocab_size=vocab_size,
                                                                   special_tokens=_SPECIAL))
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", chat_template=CHAT_TEMPLATE)


def write_checkpoint(path: str | os.PathLike[str], arch: str = "llama", quantize: int | None = None,
                     dtype: mx.Dtype = mx.float32, seed: int = 0,
                     config: dict[str, Any] | None = None) -> Path:
    """Write a tiny ``arch`` model (a key of ``TINY_CONFIGS``: two layers, hidden size 64) as an
    mlx-lm checkpoint folder at ``path`` and return its path. ``quantize`` (4 or 8 bits, groups of
    64) runs ``mlx_lm.convert`` on the float folder; ``dtype`` is the float weights' dtype;
    ``config`` overrides entries of the model's config (``{"num_hidden_layers": 8}``, or a real
    checkpoint's sizes) and the random weights follow it.

    The folder must not exist yet (as ``mlx_lm.convert`` wants). Needs mlx-lm and transformers.

    >>> folder = write_checkpoint(tmp / "llama")             # doctest: +SKIP
    >>> sorted(p.name for p in folder.iterdir())[:2]         # doctest: +SKIP
    ['README.md', 'config.json']
    """
    target = Path(path)
    if arch not in TINY_CONFIGS:
        raise KernelError(_WRITE, f"unknown architecture {arch!r}; known: {sorted(TINY_CONFIGS)}",
                          Status.INVALID_INPUT)
    if quantize not in (None, 4, 8):
        raise KernelError(_WRITE, f"quantize must be None, 4 or 8 (bits), got {quantize!r}",
                          Status.INVALID_INPUT)
    if target.exists():
        raise KernelError(_WRITE, f"{target} already exists; give a new folder", Status.INVALID_INPUT)
    try:
        from mlx_lm.convert import convert
        from mlx_lm.utils import save_config, save_model
    except ImportError as exc:
        raise KernelError(_WRITE, "mlx-lm is not installed (pip install 'graphkern[models]')",
                          Status.BACKEND_UNAVAILABLE) from exc
    config = {**TINY_CONFIGS[arch], **(config or {})}
    model = random_model(config, dtype, seed)
    tokenizer = _tokenizer(config["vocab_size"])
    float_folder = target if quantize is None else Path(tempfile.mkdtemp(prefix="graphkern-ckpt-"))
    try:
        float_folder.mkdir(parents=True, exist_ok=True)
        save_model(float_folder, model)
        save_config({**config, "eos_token_id": tokenizer.eos_token_id},  # type: ignore[attr-defined]
                     float_folder / "config.json")
        tokenizer.save_pretrained(float_folder)  # type: ignore[attr-defined]
        if quantize is not None:
            with contextlib.redirect_stdout(io.StringIO()):  # its "[INFO] Loading" lines
                convert(str(float_folder), str(target), quantize=True, q_bits=quantize, q_group_size=64)
    finally:
        if quantize is not None:
            shutil.rmtree(float_folder, ignore_errors=True)
    return target
