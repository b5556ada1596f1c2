"""Token ids against a model's token embedding, before the model runs on them.

MLX's gather (what ``nn.Embedding`` does with the ids) does not check its indices: an id past the
embedding's rows reads outside the weights, giving garbage or killing the process (SIGSEGV), where
a tokenizer that does not match the checkpoint's weights is the usual cause.

>>> import mlx.nn as nn
>>> model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
>>> check_token_ids(model, [1, 7], "run a prompt")
>>> check_token_ids(model, [1, 8], "run a prompt")
Traceback (most recent call last):
...
graphkern.errors.ModelError: run a prompt: token id 8 is past the 8 rows of the model's token embedding ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import mlx.core as mx
import mlx.nn as nn

from graphkern.errors import ModelError
from graphkern.nodes import Status

__all__ = ["check_token_ids", "embedding_rows"]


def embedding_rows(model: nn.Module) -> int | None:
    """The rows of ``model``'s token embedding: its largest ``nn.Embedding`` or
    ``nn.QuantizedEmbedding`` (a position embedding is smaller); None when it has none."""
    rows = [module.weight.shape[0] for _, module in model.named_modules()
            if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding))]
    return max(rows) if rows else None


def check_token_ids(model: nn.Module, tokens: mx.array | Sequence[int], operation: str) -> None:
    """Raise ``ModelError`` (for ``operation``) when a token id is negative or past the rows of
    ``model``'s token embedding; a model without one takes any ids."""
    rows = embedding_rows(model)
    ids = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.int64)
    if rows is None or ids.size == 0:
        return
    low, high = cast(int, mx.min(ids).item()), cast(int, mx.max(ids).item())
    if high >= rows:
        raise ModelError(operation, f"token id {high} is past the {rows} rows of the model's token "
                         "embedding (does the tokenizer belong to these weights?)", Status.INVALID_INPUT)
    if low < 0:
        raise ModelError(operation, f"token id {low} is negative", Status.INVALID_INPUT)
