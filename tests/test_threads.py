"""Programs that run graphkern (or MLX alone) from their own threads exit cleanly.

MLX 0.32 keeps streams per thread; a process whose threads ended with theirs still there aborted
at exit ("terminate called without an active exception", rc 134) in most runs. A thread that used
graphkern releases its streams when it ends; ``gk.mlx_thread`` does it for any thread. Each
program runs ten times in a row in a fresh process, and each run must exit 0.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import mlx.core as mx
import pytest

import graphkern as gk

ROOT = Path(__file__).resolve().parent.parent
RUNS = 10

#: Eight threads each trace, inspect, wrap and decode (patched) a tiny model of their own.
GRAPHKERN_THREADS = """
import threading
import mlx.core as mx
import graphkern as gk
from graphkern.models.tiny import tiny_model
from mlx_lm.models.cache import make_prompt_cache

PROMPT = mx.array([[3, 17, 42, 5]])

def work(seed):
    model = tiny_model("llama", seed=seed)
    model.eval()
    gk.trace(model, PROMPT)
    gk.inspect(model, PROMPT)
    mx.eval(gk.wrap(model)(PROMPT))
    patched = tiny_model("llama", seed=seed)
    gk.patch(patched)
    patched.eval()
    cache = make_prompt_cache(patched)
    token = mx.argmax(patched(PROMPT, cache=cache)[:, -1:], axis=-1)
    for _ in range(3):
        token = mx.argmax(patched(token, cache=cache)[:, -1:], axis=-1)
    mx.eval(token)

threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("ok")
"""

#: Eight threads run MLX alone (a layer's random weights, a product): gk.mlx_thread releases them.
MLX_THREADS = """
import threading
import mlx.core as mx
import mlx.nn as nn
import graphkern as gk

@gk.mlx_thread()
def work():
    layer = nn.Linear(64, 64)
    mx.eval(layer(mx.ones((4, 64))))

threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("ok")
"""


def _runs(program: str) -> list[str]:
    """Run ``program`` ``RUNS`` times; what each failing run said."""
    failures = []
    for run in range(RUNS):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(program)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0 or done.stdout.strip() != "ok":
            failures.append(f"run {run}: rc {done.returncode}: {done.stderr.strip()[-300:]}")
    return failures


@pytest.mark.slow
def test_eight_threads_using_graphkern_exit_cleanly_ten_runs_in_a_row() -> None:
    pytest.importorskip("mlx_lm")
    assert _runs(GRAPHKERN_THREADS) == []


@pytest.mark.slow
def test_eight_threads_running_mlx_in_mlx_thread_exit_cleanly_ten_runs_in_a_row() -> None:
    assert _runs(MLX_THREADS) == []


def test_mlx_thread_leaves_the_main_threads_streams_alone() -> None:
    with gk.mlx_thread():
        mx.eval(mx.ones((2,)))
    assert (mx.ones((2,)) * 3).tolist() == [3.0, 3.0]  # the main thread runs MLX on


def test_a_thread_finishes_its_mlx_work_before_its_streams_go() -> None:
    seen: list[float] = []

    def work() -> None:
        with gk.mlx_thread():
            x = mx.ones((64, 64))
            for _ in range(5):
                x = x @ x / 64
            mx.async_eval(x)  # still running when the body ends
        seen.append(x.tolist()[0][0])

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [1.0]
