"""``--model PATH``, ``--prompt TEXT``, ``--tokens IDS`` and ``--patch`` for the commands that run a model.

An mlx-lm checkpoint (a folder, or a Hugging Face Hub id where the hub is reachable) is loaded as
``mlx_lm.load`` loads it; the prompt goes through the model's chat template and tokenizer as
``mlx_lm.generate`` does. ``--tokens 1,2,3`` gives token ids instead, and needs no tokenizer.
``trace``, ``debug``, ``view`` and ``bench`` share these options (``bench`` takes no ``--tokens``:
it generates text).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from graphkern.cli.errors import BadInput

__all__ = ["Checkpoint", "ModelRun", "load_checkpoint", "model_and_tokens", "model_options", "prompt_tokens"]

#: The prompt when none is given (``mlx_lm.generate``'s default).
DEFAULT_PROMPT = "hello"

_MODEL_OPTIONS = [
    click.option("--model", "model_path", metavar="PATH",
                 help="An mlx-lm checkpoint folder (or a Hugging Face Hub id), loaded with mlx_lm.load."),
    click.option("--prompt", metavar="TEXT",
                 help=f"With --model: the prompt, through the model's chat template and tokenizer "
                      f"(default {DEFAULT_PROMPT!r})."),
    click.option("--tokens", "token_ids", metavar="IDS",
                 help="With --model: token ids instead of a prompt, e.g. 1,2,3 (needs no tokenizer)."),
    click.option("--patch", "patch_model", is_flag=True,
                 help="With --model: patch the model onto graphkern's kernels first (gk.patch)."),
]


def model_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--model``, ``--prompt``, ``--tokens`` and ``--patch`` to a command."""
    for option in reversed(_MODEL_OPTIONS):
        fn = option(fn)
    return fn


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model, its tokenizer, where it came from and its config."""

    model: Any
    tokenizer: Any
    path: str
    config: dict[str, Any]

    @property
    def name(self) -> str:
        """The folder's (or hub id's) last part: ``Llama-3.2-1B-Instruct-4bit``."""
        return os.path.basename(os.path.normpath(self.path)) or self.path

    def describe(self) -> str:
        """One line: name, architecture, layers, quantization and weights' dtype."""
        quant = self.config.get("quantization") or {}
        bits = f"{quant['bits']}-bit" if quant.get("bits") else self.weights_dtype()
        layers = self.config.get("num_hidden_layers", "?")
        return f"{self.name} ({self.config.get('model_type', '?')}, {layers} layers, {bits})"

    def weights_dtype(self) -> str:
        """The dtype of the model's floating-point weights (the first one met)."""
        import mlx.core as mx
        from mlx.utils import tree_flatten

        from graphkern.nodes import dtype_name

        for _, value in tree_flatten(self.model.parameters()):  # type: ignore[str-unpack]
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
                return dtype_name(value.dtype)
        return "?"

    def twin(self) -> Any:
        """A second model object holding this one's very weight arrays (no second copy), in
        evaluation mode: the stock side when this one is patched, or the patched one."""
        from pathlib import Path

        from mlx_lm.utils import load_model

        other, _ = load_model(Path(self.local_path()), lazy=True)  # lazy: its own arrays never load
        other.update(self.model.parameters())
        other.eval()
        return other

    def tokens_for(self, prompt: str | None, token_ids: str | None = None) -> Any:
        """:func:`prompt_tokens` for this checkpoint (or ``token_ids``, ``"1,2,3"``, as they are),
        each id checked against the model's token embedding first (MLX's gather does not check:
        an id past it crashes the process)."""
        from graphkern.models.tokens import check_token_ids
        from graphkern.nodes import KernelError

        if token_ids is not None:
            tokens = parse_token_ids(token_ids)
            option = f"--tokens {token_ids}"
        else:
            tokens = prompt_tokens(self.tokenizer, prompt)
            option = f"--prompt {DEFAULT_PROMPT if prompt is None else prompt!r}"
        try:
            check_token_ids(self.model, tokens, "run a prompt")
        except KernelError as exc:
            raise BadInput(f"{option} with --model {self.path}: {exc.description}") from None
        return tokens

    def local_path(self) -> str:
        from mlx_lm.utils import _download

        return str(_download(self.path))


def _looks_like_path(text: str) -> bool:
    """A hub id is ``owner/name``: anything else (absolute, ``./``, ``~``, more parts) is a folder."""
    return (os.path.isabs(text) or text.startswith((".", "~")) or text.count("/") != 1
            or os.sep != "/" and os.sep in text)


def _check_folder(path: str, expanded: str) -> None:
    """What is wrong with ``--model path`` as a local checkpoint folder, said before mlx_lm.load
    says it less clearly (a hub id that is no local path passes)."""
    try:
        os.stat(expanded)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadInput(f"--model {path}: a symlink loop (its links lead back to themselves, never "
                           "to a folder)") from None
        if exc.errno == errno.EACCES:
            raise BadInput(f"--model {path}: cannot be read: permission denied") from None
        if _looks_like_path(path) or os.path.islink(expanded):
            raise BadInput(f"--model {path}: no such folder (give an mlx-lm checkpoint folder, or a "
                           "Hugging Face Hub id such as mlx-community/Llama-3.2-1B-Instruct-4bit)") from None
        return
    if not os.path.isdir(expanded):
        raise BadInput(f"--model {path}: not a folder (give the checkpoint's folder, which holds "
                       "config.json and *.safetensors)")
    if not os.access(expanded, os.R_OK | os.X_OK):
        raise BadInput(f"--model {path}: the folder cannot be read: permission denied")
    config = os.path.join(expanded, "config.json")
    if not os.path.isfile(config):
        raise BadInput(f"--model {path}: no config.json in the folder; is it an mlx-lm checkpoint "
                       "(config.json, *.safetensors, tokenizer files)?")
    if not os.access(config, os.R_OK):
        raise BadInput(f"--model {path}: its config.json cannot be read: permission denied")


#: Files a Hugging Face tokenizer is loaded from; a folder with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def has_tokenizer_files(folder: str) -> bool:
    """Whether ``folder`` holds any of :data:`TOKENIZER_FILES` (or a ``*.tiktoken`` file)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return True  # let the tokenizer's own loading say what is wrong
    return any(name in TOKENIZER_FILES or name.endswith(".tiktoken") for name in names)


#: What to do without a tokenizer, for the commands that take ``--tokens``.
NO_TOKENIZER_HINT = "run the model on token ids instead of a prompt: --tokens 1,2,3"


def load_checkpoint(path: str, tokenizer: bool = True,
                    no_tokenizer_hint: str = NO_TOKENIZER_HINT) -> Checkpoint:
    """The model and tokenizer of a checkpoint, loaded as ``mlx_lm.load`` loads them, with errors
    that say what to fix (exit status 2 on the command line). ``tokenizer=False`` loads the model
    alone (``Checkpoint.tokenizer`` is then None), for token ids given as they are;
    ``no_tokenizer_hint`` ends the error of a folder without a tokenizer.

    >>> ckpt = load_checkpoint("models/tiny-llama-4bit")           # doctest: +SKIP
    >>> ckpt.describe()                                              # doctest: +SKIP
    'tiny-llama-4bit (llama, 2 layers, 4-bit)'
    """
    try:
        from mlx_lm.utils import _download, load_model, load_tokenizer
    except ImportError:
        raise BadInput("--model needs mlx-lm: pip install 'graphkern[models]'") from None
    expanded = os.path.expanduser(path)
    _check_folder(path, expanded)
    try:
        local = _download(expanded)
        model, config = load_model(local)
    except Exception as exc:
        if not os.path.exists(expanded):
            raise BadInput(f"--model {path}: no such folder, and it could not be downloaded from "
                           f"the Hugging Face Hub ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else 'no detail'})") from None
        raise BadInput(f"--model {path}: mlx_lm.load failed: {type(exc).__name__}: {exc}") from None
    loaded = None
    if tokenizer:
        if not has_tokenizer_files(str(local)):
            raise BadInput(f"--model {path}: the folder has no tokenizer (no tokenizer.json or "
                           f"tokenizer.model), so a prompt cannot be turned into tokens; {no_tokenizer_hint}")
        try:
            loaded = load_tokenizer(local, eos_token_ids=config.get("eos_token_id", None))
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
            raise BadInput(f"--model {path}: its tokenizer could not be loaded ({type(exc).__name__}: "
                           f"{first}); {no_tokenizer_hint}") from None
    return Checkpoint(model, loaded, path, config)


def parse_token_ids(text: str) -> Any:
    """``--tokens 1,2,3`` as a (1, L) int32 array (ids checked against the embedding later)."""
    import mlx.core as mx

    parts = [part.strip() for part in text.replace(" ", ",").split(",") if part.strip()]
    try:
        ids = [int(part) for part in parts]
    except ValueError:
        raise BadInput(f"--tokens {text}: give token ids as integers separated by commas, "
                       "e.g. 1,2,3") from None
    if not ids:
        raise BadInput(f"--tokens {text!r}: give at least one token id, e.g. 1,2,3")
    if any(not -2**31 <= i < 2**31 for i in ids):
        raise BadInput(f"--tokens {text}: token ids are int32 (below 2147483648)")
    return mx.array([ids], dtype=mx.int32)


def prompt_tokens(tokenizer: Any, prompt: str | None) -> Any:
    """``prompt`` as a (1, L) int32 array of token ids, as ``mlx_lm.generate`` makes them: through
    the chat template when the tokenizer has one, else encoded with its special tokens."""
    import mlx.core as mx

    text = DEFAULT_PROMPT if prompt is None else utf8_text("--prompt", prompt)
    chat = bool(getattr(tokenizer, "has_chat_template", False))
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=not chat)
    if not ids:
        raise BadInput(f"--prompt {prompt!r} gives no tokens")
    return mx.array([ids], dtype=mx.int32)


def utf8_text(option: str, text: str) -> str:
    """``text`` when it is UTF-8; an argument that is not reaches Python with its bytes as lone
    surrogates (``surrogateescape``), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        what = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"character U+{char:04X}"
        raise BadInput(f"{option}: not UTF-8 text ({what} at character {exc.start}); give the "
                       "text in UTF-8") from None
    return text


_WHAT = {"MODULE:CALLABLE": "a .py file or module and a callable in it, with -i SHAPE:DTYPE for each "
                            "argument",
         "FILE.json": "a graph written by --json"}


def check_model_options(target: str | None, model_path: str | None, prompt: str | None,
                        patch_model: bool, inputs: tuple[str, ...] = (),
                        what: str = "MODULE:CALLABLE", token_ids: str | None = None) -> None:
    """Exactly one of ``target`` (a ``what``) and ``--model``; ``--prompt``/``--tokens``/``--patch``
    only with ``--model``, and not both ``--prompt`` and ``--tokens``; ``-i`` only with a target."""
    if target and model_path:
        raise BadInput(f"give either {what} or --model PATH, not both")
    if not target and not model_path:
        raise BadInput(f"give {what} ({_WHAT[what]}) or --model PATH (an mlx-lm checkpoint folder)")
    if not model_path and (prompt is not None or token_ids is not None or patch_model):
        option = "--prompt" if prompt is not None else "--tokens" if token_ids is not None else "--patch"
        raise BadInput(f"{option} goes with --model PATH")
    if prompt is not None and token_ids is not None:
        raise BadInput("give either --prompt TEXT or --tokens IDS, not both")
    if model_path and inputs:
        raise BadInput("-i/--input is for MODULE:CALLABLE; with --model the input is --prompt TEXT "
                       "(or --tokens IDS)")


@dataclass
class ModelRun:
    """A loaded checkpoint ready to run: the prompt's tokens, the ``Patched`` records (``--patch``)
    and, when asked for, the stock model as a second object on the same weights."""

    checkpoint: Checkpoint
    tokens: Any
    patched: list[Any]
    stock: Any = None

    def describe(self) -> str:
        """``model q4 (llama, 2 layers, 4-bit), prompt 3 tokens`` and, when patched, what was
        (:func:`patched_line`)."""
        count = self.tokens.shape[1]
        line = f"model {self.checkpoint.describe()}, prompt {count} token{'s' if count != 1 else ''}"
        return line + (f"\n{patched_line(self.patched)}" if self.patched else "")


def model_and_tokens(model_path: str, prompt: str | None, patch_model: bool,
                     step: Callable[[str], None] = lambda text: None, stock_twin: bool = False,
                     token_ids: str | None = None) -> ModelRun:
    """Load ``model_path``, tokenize ``prompt`` (or take ``token_ids`` as they are, loading no
    tokenizer) and patch the model when asked; ``stock_twin`` also keeps an unpatched model
    object on the same weights."""
    step(f"loading {model_path}")
    ckpt = load_checkpoint(model_path, tokenizer=token_ids is None)
    run = ModelRun(ckpt, ckpt.tokens_for(prompt, token_ids), [])
    if stock_twin:
        run.stock = ckpt.twin()
    if patch_model:
        from graphkern.models import patch
        from graphkern.nodes import KernelError

        step("patching")
        try:
            run.patched = patch(ckpt.model)
        except KernelError as exc:
            raise BadInput(f"--patch: {exc}") from None
    return run


def patched_line(patched: list[Any]) -> str:
    """What ``gk.patch`` replaced: ``patched 7 layers: add_rms_norm 3, rope_qk 2, swiglu 2``, then
    what each of those kernels computes, in words; with a block among them, a line on the fused
    kernels a block runs when it decodes (the names a trace of it then shows)."""
    from graphkern.kernels.registry import in_words

    counts: dict[str, int] = {}
    for record in patched:
        counts[record.kernel] = counts.get(record.kernel, 0) + 1
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    head = f"patched {len(patched)} layer{'s' if len(patched) != 1 else ''}"
    lines = [head + (f": {kinds}" if kinds else "")]
    width = max((len(k) for k in counts), default=0)
    lines += [f"  {k:<{width}}  {in_words(k)}" for k in sorted(counts) if in_words(k)]
    if any(str(record.rule).startswith("pre-norm block") for record in patched):
        # a GeGLU feed-forward (Gemma's, patched as gelu) decodes through norm_geglu
        geglu = "gelu" in counts and "swiglu" not in counts
        gated, activation = ("geglu", "gelu") if geglu else ("swiglu", "swiglu")
        lines.append("  an evaluating block runs a call of up to 16 tokens (a short prompt, decoding) with "
                     "its norms fused into the products after them: a trace then shows gk_norm_projections "
                     f"and gk_norm_{gated} (or gk_quantized_*) where the block's add_rms_norm and "
                     f"{activation} were")
    return "\n".join(lines)
