"""Stock against patched generation, measured with mlx-lm's own loop (``stream_generate``).

Both models hold the same weight arrays; they take turns within each round, after one short
warm-up run each (the patched model traces its compiled segments on first use): stock first in
odd rounds, patched first in even ones, since a run right after the other model's can start
slower (an even number of rounds lets each lead as often). Each run reports what
``mlx_lm.generate --verbose`` prints: prompt and generation tokens per second and peak memory
(reset before the run). The end of sequence is ignored, as in ``mlx_lm.benchmark``, so every run
generates ``max_tokens``. Ratios are patched over stock, the median of the per-round ratios.

>>> result = measure_generation(stock, patched, tokenizer, [1, 2, 3], max_tokens=16)  # doctest: +SKIP
>>> result.ratio("generation_tps")                                                       # doctest: +SKIP
1.08
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from graphkern.models.tokens import check_token_ids
from graphkern.nodes import KernelError, Status

__all__ = ["AUTO_TOKENS", "WARMUP_TOKENS", "GenerationResult", "GenerationRun", "Plan", "RunDone",
           "measure_generation"]

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
        return (f"Prompt: {_tokens(self.prompt_tokens)}, {self.prompt_tps:.3f} tokens-per-sec  "
                f"Generation: {_tokens(self.generation_tokens)}, {self.generation_tps:.3f} tokens-per-sec  "
                f"Peak memory: {_memory(self.peak_memory)}")


def _tokens(n: int) -> str:
    return f"{n} token{'s' if n != 1 else ''}"


def _memory(gigabytes: float) -> str:
    """mlx-lm's ``0.123 GB``; below 10 MB in MB, which three decimals of GB would round to 0."""
    return f"{gigabytes:.3f} GB" if gigabytes >= 0.01 else f"{gigabytes * 1e3:.3f} MB"


@dataclass
class GenerationResult:
    """The rounds of a measurement: ``rounds[i] = {"stock": run, "patched": run}``."""

    rounds: list[dict[str, GenerationRun]] = field(default_factory=list)
    #: the tokens each run generated
    max_tokens: int = 0

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


def _run(model: Any, tokenizer: Any, prompt: Sequence[int], max_tokens: int,
         on_token: Callable[[], None] | None = None) -> GenerationRun:
    from mlx_lm.generate import stream_generate

    mx.reset_peak_memory()
    tokens: list[int] = []
    last = None
    for last in stream_generate(model, tokenizer, list(prompt), max_tokens=max_tokens):
        tokens.append(int(last.token))
        if on_token:
            on_token()
    if last is None:
        raise KernelError(_MEASURE, "stream_generate produced no token", Status.INVALID_INPUT)
    return GenerationRun(last.prompt_tokens, last.prompt_tps, last.generation_tokens,
                         last.generation_tps, last.peak_memory, tuple(tokens))


#: Tokens a warm-up run generates at most: enough to trace and compile the prompt's and the
#: decoding's paths, which is all a warm-up is for.
WARMUP_TOKENS = 4
#: The bounds of the tokens a run generates when ``max_tokens`` is chosen from a time budget.
AUTO_TOKENS = (8, 128)


@dataclass(frozen=True)
class RunDone:
    """One finished run, as ``measure_generation`` reports it to ``on_run``: ``round`` 0 is the
    warm-up; ``seconds`` the run's wall time."""

    round: int
    side: str
    run: GenerationRun
    seconds: float


@dataclass(frozen=True)
class Plan:
    """What the rounds will do, decided after the warm-up: ``max_tokens`` a run, and about how
    many seconds all the rounds take, from the stock warm-up's pace (prompt included)."""

    max_tokens: int
    rounds: int
    warmup_seconds: dict[str, float]
    estimate: float


def _tokens_for(budget: float, step: float, rounds: int) -> int:
    """The tokens a run may generate for ``rounds`` rounds of two runs to take ``budget`` seconds
    at ``step`` seconds a token, within :data:`AUTO_TOKENS`."""
    low, high = AUTO_TOKENS
    fit = int(budget / max(step, 1e-9) / (2 * rounds)) - 1  # a run's prompt costs about a token
    return max(low, min(high, fit))


def measure_generation(stock: Any, patched: Any, tokenizer: Any, prompt: Sequence[int],
                       max_tokens: int | None = 100, rounds: int = 3,
                       progress: Callable[[str], None] | None = None,
                       on_run: Callable[[RunDone], None] | None = None,
                       on_token: Callable[[], None] | None = None,
                       on_plan: Callable[[Plan], None] | None = None,
                       warmup_tokens: int = WARMUP_TOKENS, seconds: float = 60.0) -> GenerationResult:
    """Generate ``max_tokens`` after ``prompt`` (token ids) with ``stock`` and ``patched`` in turn,
    ``rounds`` times after one warm-up run each of ``min(max_tokens, warmup_tokens)`` tokens.

    ``max_tokens=None``: as many (within :data:`AUTO_TOKENS`) as let the whole measurement, the
    warm-up included, take about ``seconds``, from the pace of the stock warm-up run.
    ``progress`` is told each run as it starts, ``on_token`` each token as it comes, ``on_run``
    each run as it ends (:class:`RunDone`), ``on_plan`` the :class:`Plan` after the warm-up."""
    if rounds < 1 or (max_tokens is not None and max_tokens < 1) or not prompt:
        raise KernelError(_MEASURE, f"need rounds >= 1, max_tokens >= 1 and a prompt; got rounds={rounds}, "
                          f"max_tokens={max_tokens}, {len(prompt)} prompt tokens", Status.INVALID_INPUT)
    for model in (stock, patched):  # before MLX's unchecked gather reads past the embedding
        check_token_ids(model, prompt, _MEASURE)
    eos = set(tokenizer.eos_token_ids)
    tokenizer.eos_token_ids = set()  # every run makes max_tokens, as mlx_lm.benchmark does
    models = {"stock": stock, "patched": patched}

    def timed(index: int, name: str, tokens: int) -> tuple[GenerationRun, float]:
        if progress:
            progress(f"warm-up: {name}" if index == 0 else f"round {index} of {rounds}: {name}")
        start = time.perf_counter()
        run = _run(models[name], tokenizer, prompt, tokens, on_token)
        took = time.perf_counter() - start
        if on_run:
            on_run(RunDone(index, name, run, took))
        return run, took

    try:
        warm = max(1, warmup_tokens if max_tokens is None else min(max_tokens, warmup_tokens))
        warmup = {name: timed(0, name, warm)[1] for name in models}
        step = warmup["stock"] / (warm + 1)  # the prompt costs about a token
        if max_tokens is None:
            max_tokens = _tokens_for(seconds - sum(warmup.values()), step, rounds)
        plan = Plan(max_tokens, rounds, warmup, 2 * rounds * (max_tokens + 1) * step)
        if on_plan:
            on_plan(plan)
        result = GenerationResult(max_tokens=max_tokens)
        for index in range(1, rounds + 1):
            order = ("stock", "patched") if index % 2 else ("patched", "stock")
            runs = {name: timed(index, name, max_tokens)[0] for name in order}
            result.rounds.append({name: runs[name] for name in models})
        return result
    finally:
        tokenizer.eos_token_ids = eos
