"""Timing helpers shared by the benchmark scripts: warm-up, repeats, medians."""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from datetime import date
from typing import Any

import mlx.core as mx


def median_seconds(fn: Callable[[], Any], repeats: int = 7, warmup: int = 1, number: int = 1) -> float:
    """Median over ``repeats`` of the time of ``number`` calls, divided by ``number``."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def cupti_seconds(build: Callable[[], Any], repeats: int = 3) -> tuple[float, float]:
    """Medians over ``repeats`` of the GPU time of evaluating ``build()``'s arrays, as CUPTI (through
    ``torch.profiler``, which sees every kernel of the process, MLX's included) records it: the
    kernels' summed durations, and their span from the first start to the last end (a CUDA graph
    runs independent kernels side by side, which the sum counts twice). NaN without torch."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return float("nan"), float("nan")
    busy, span = [], []
    for _ in range(repeats):
        out = build()
        mx.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            mx.eval(out)
            mx.synchronize()
        kernels = [(e.start_ns(), e.duration_ns()) for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
                   if str(e.device_type()).endswith("CUDA")]
        busy.append(sum(d for _, d in kernels) / 1e9)
        span.append((max(s + d for s, d in kernels) - min(s for s, _ in kernels)) / 1e9 if kernels else 0.0)
    return statistics.median(busy), statistics.median(span)


def interleaved_samples(fns: dict[str, Callable[[], Any]], rounds: int = 7, number: int = 1,
                        warmup: int = 1, shuffle: bool = False,
                        clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per call of each function in each of ``rounds`` rounds of ``number`` calls, the
    functions taking turns within each round so that drift hits all alike. ``shuffle`` orders each
    round afresh (seeded), so that no function always runs right after the same other one (what
    one leaves behind, freed buffers of its sizes for one, can speed up or slow down the next).
    ``clock``: ``time.process_time`` counts this process's CPU time (all its threads), which other
    jobs on a shared machine disturb less than the wall clock; ``time.thread_time`` the calling
    thread's alone."""
    for fn in fns.values():  # warm-up: builds, compiles, NVRTC, caches
        for _ in range(warmup):
            fn()
    names = list(fns)
    order = random.Random(0)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        if shuffle:
            order.shuffle(names)
        for name in names:
            fn = fns[name]
            start = clock()
            for _ in range(number):
                fn()
            samples[name].append((clock() - start) / number)
    return samples


def interleaved_stats(fns: dict[str, Callable[[], Any]], rounds: int = 7, number: int = 1,
                      warmup: int = 1, shuffle: bool = False) -> dict[str, dict[str, float]]:
    """Median, min and max seconds per call of each function (see ``interleaved_samples``)."""
    return summary(interleaved_samples(fns, rounds, number, warmup, shuffle))


def summary(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Median, min and max of each function's samples."""
    return {name: {"median": statistics.median(v), "min": min(v), "max": max(v)}
            for name, v in samples.items()}


def paired_ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of ``a``'s time over ``b``'s in the same round: drift between rounds
    (clocks, other processes) cancels, which a ratio of the two medians does not ensure."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int = 7, number: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, timed in alternation (see ``interleaved_stats``)."""
    return {name: stats["median"] for name, stats in interleaved_stats(fns, rounds, number).items()}


def header(title: str) -> str:
    device = "cuda" if mx.cuda.is_available() else "metal" if mx.metal.is_available() else "cpu"
    return (f"# {title}\n# {date.today()} | mlx {getattr(mx, '__version__', '?')} | device {device} | "
            f"{platform.processor() or platform.machine()} | python {platform.python_version()}")


def forward_arguments(batch: int) -> argparse.ArgumentParser:
    """The options of a model forward benchmark: token batch and length, rounds, calls a sample."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=20)
    return parser
