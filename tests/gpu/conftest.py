"""Setup for the GPU suite (tests/gpu): a device summary, and a CPU dry run of the tests' logic.

With ``GRAPHKERN_GPU_DRYRUN=1`` the ``gpu`` skip of tests/conftest.py is lifted, so these tests run
on a machine without a GPU: kernels then run their references, CUDA-only checks skip themselves,
and what is left checks the tests' own Python before device time is spent on them.
"""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

DRYRUN = os.environ.get("GRAPHKERN_GPU_DRYRUN") == "1"
CUDA = mx.cuda.is_available()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not DRYRUN or CUDA:
        return
    for item in items:
        item.own_markers = [m for m in item.own_markers
                            if not (m.name == "skip" and "no GPU backend" in str(m.kwargs.get("reason")))]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    try:
        info = mx.device_info()
    except Exception as exc:  # only a report line
        info = {"error": repr(exc)}
    name = info.get("device_name", info)
    terminalreporter.write_line(f"graphkern GPU suite: mlx {mx.__version__}, cuda={CUDA}, "
                                f"device={name}, dryrun={DRYRUN}")


@pytest.fixture
def cuda_only() -> None:
    """Skip a test whose subject only exists on MLX's CUDA backend (NVRTC logs, PTX)."""
    if not CUDA:
        pytest.skip("needs MLX's CUDA backend")


@pytest.fixture
def on_cpu_dryrun() -> bool:
    """Whether this run is the CPU's dry run, where a test at a real model's widths may take a
    narrower model (the CPU's float16 products of such widths take minutes, and the dry run checks
    the test's logic, not the kernels)."""
    return DRYRUN and not CUDA


@pytest.fixture(autouse=True)
def prompts_on_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite checks the kernels: patched stacks run them at every prompt length, where an
    evaluating model on CUDA would give prompts shorter than PIPELINE_TOKENS to the stock layers
    (graphkern.models.prefill). A test of that routing sets the backends back itself."""
    from graphkern.models import prefill

    monkeypatch.setattr(prefill, "STOCK_PROMPT_BACKENDS", frozenset())
