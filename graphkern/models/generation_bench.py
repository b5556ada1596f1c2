"""Stock against patched generation, measured with mlx-lm's own loop (``stream_generate``).

Both models hold the same weight arrays; they take turns within each round, after one warm-up
run each (the patched model traces its compiled segments on first use). Each run reports what
``mlx_lm.generate --verbose`` prints: prompt and generation tokens per second and peak memory
(reset before the run). The end of sequence is ignored, as in ``mlx_lm.benchmark``, so every run
generates ``max_tokens``. Ratios are patched over stock, the median of the per-round ratios.

>>> result = measure_generation(stock, patched, tokenizer, [1, 2, 3], max_tokens=16)  # doctest: +SKIP
>>> result.ratio("generation_tps")                                                       # doctest: +SKIP
1.08
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from graphkern.models.tokens import check_token_ids
from graphkern.nodes import KernelError, Status

__all__ = ["GenerationResult", "GenerationRun", "measure_generation"]

_MEASURE = "measure stock against patched generation"


@dataclass(frozen=True)
class GenerationRun:
    """One ``stream_generate`` run's figures, as mlx-lm reports them (peak memory in GB)."""

    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    tokens: tuple[int, ...]

    def verbose_line(self) -> str:
        """``mlx_lm.generate --verbose``'s three lines, on one."""
        return (f"Prompt: {self.prompt_tokens} tokens, {self.prompt_tps:.3f} tokens-per-sec  "
                f"Generation: {self.generation_tokens} tokens, {self.generation_tps:.3f} tokens-per-sec  "
                f"Peak memory: {_memory(self.peak_memory)}")


def _memory(gigabytes: float) -> str:
    """mlx-lm's ``0.123 GB``; below 10 MB in MB, which three decimals of GB would round to 0."""
    return f"{gigabytes:.3f} GB" if gigabytes >= 0.01 else f"{gigabytes * 1e3:.3f} MB"


@dataclass
class GenerationResult:
    """The rounds of a measurement: ``rounds[i] = {"stock": run, "patched": run}``."""

    rounds: list[dict[str, GenerationRun]] = field(default_factory=list)

    def ratio(self, figure: str) -> float:
        """Patched over stock for ``figure`` (``prompt_tps``, ``generation_tps``, ``peak_memory``):
        the median of the per-round ratios."""
        ratios = [getattr(r["patched"], figure) / getattr(r["stock"], figure) for r in self.rounds
                  if getattr(r["stock"], figure) > 0]
        return statistics.median(ratios) if ratios else float("nan")

    def same_tokens(self) -> tuple[int, int]:
        """(how many of the first round's generated tokens agree, how many there are)."""
        first = self.rounds[0]
        stock, patched = first["stock"].tokens, first["patched"].tokens
        return sum(a == b for a, b in zip(stock, patched)), len(stock)


def _run(model: Any, tokenizer: Any, prompt: Sequence[int], max_tokens: int) -> GenerationRun:
    from mlx_lm.generate import stream_generate

    mx.reset_peak_memory()
    tokens: list[int] = []
    last = None
    for last in stream_generate(model, tokenizer, list(prompt), max_tokens=max_tokens):
        tokens.append(int(last.token))
    if last is None:
        raise KernelError(_MEASURE, "stream_generate produced no token", Status.INVALID_INPUT)
    return GenerationRun(last.prompt_tokens, last.prompt_tps, last.generation_tokens,
                         last.generation_tps, last.peak_memory, tuple(tokens))


def measure_generation(stock: Any, patched: Any, tokenizer: Any, prompt: Sequence[int],
                       max_tokens: int = 100, rounds: int = 3,
                       progress: Callable[[str], None] | None = None) -> GenerationResult:
    """Generate ``max_tokens`` after ``prompt`` (token ids) with ``stock`` and ``patched`` in turn,
    ``rounds`` times after one warm-up run each; ``progress`` is told each run as it starts."""
    if rounds < 1 or max_tokens < 1 or not prompt:
        raise KernelError(_MEASURE, f"need rounds >= 1, max_tokens >= 1 and a prompt; got rounds={rounds}, "
                          f"max_tokens={max_tokens}, {len(prompt)} prompt tokens", Status.INVALID_INPUT)
    for model in (stock, patched):  # before MLX's unchecked gather reads past the embedding
        check_token_ids(model, prompt, _MEASURE)
    eos = set(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = set()  # every run makes max_tokens, as mlx_lm.benchmark does
    try:
        models = {"stock": stock, "patched": patched}
        for name, model in models.items():
            if progress:
                progress(f"warm-up: {name}")
            _run(model, tokenizer, prompt, max_tokens)
        result = GenerationResult()
        for index in range(rounds):
            runs = {}
            for name, model in models.items():
                if progress:
                    progress(f"round {index + 1} of {rounds}: {name}")
                runs[name] = _run(model, tokenizer, prompt, max_tokens)
            result.rounds.append(runs)
        return result
    finally:
        tokenizer.eos_token_ids = eos
