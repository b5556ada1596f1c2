"""The ``--model`` commands on the GPU: trace, debug and bench of a tiny 4-bit and float32
checkpoint folder (written offline by ``graphkern.models.checkpoint``) run on the GPU backend.

Checks that a patched checkpoint traces with its kernels on the GPU backend, that its values
are all finite, and that ``bench`` prints its stock and patched runs and ratios (its figures, on a
model this small, are not a claim: see benchmarks/RESULTS_generate.md). Prints the bench output
(``pytest -s`` to see it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("mlx_lm")

from graphkern.cli import main  # noqa: E402
from graphkern.launching.backends import active_backend  # noqa: E402
from graphkern.models.checkpoint import write_checkpoint  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("gpu-checkpoints")
    return {"float": write_checkpoint(base / "tiny-llama"),
            "4bit": write_checkpoint(base / "tiny-llama-4bit", quantize=4)}


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_model_commands_run_on_the_gpu(folders: dict[str, Path], kind: str) -> None:
    folder = str(folders[kind])
    code, out, err = run("trace", "--model", folder, "--patch", "--prompt", "hi there")
    assert code == 0, err
    assert f"backend {active_backend()}" in out and "gk_rope_qk" in out
    code, out, err = run("debug", "--model", folder, "--patch")
    assert code == 0, out + err
    assert "all values finite" in out
    code, out, err = run("bench", "--model", folder, "--max-tokens", "16", "--rounds", "2")
    print(out)
    assert code == 0, err
    runs = [line for line in out.splitlines() if line.startswith("round ")]
    assert len(runs) == 4 and all("Generation: 16 tokens, " in r for r in runs)
    assert out.splitlines()[-1].startswith("patched / stock, median of 2 rounds")
