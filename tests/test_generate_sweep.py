"""benchmarks/generate.py's sweep at its CPU smoke size: every architecture it measures builds, is
patched, decodes stock and patched (the kernels as their references), and agrees with stock."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import generate  # noqa: E402

pytestmark = pytest.mark.slow


def test_every_architecture_of_the_sweep_decodes_as_stock_in_float32(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every SWEEP preset at its CPU smoke size, float32 and 4-bit: 32 greedy tokens as stock's,
    and the first decoded token's logits within the model tolerance."""
    assert generate.main(["--sweep", "--quick", "--rounds", "1", "--tokens", "4", "--prefill", "8",
                          "--batches", "1", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("## sweep"):].splitlines()
    rows = [line for line in table if line.startswith("| ") and "quick size" in line]
    names = [r.split(" (quick size)")[0].lstrip("| ") for r in rows]
    assert names == [name for name in generate.SWEEP for _ in ("float32", "4-bit")]
    assert all(r.rstrip(" |").endswith("100%") for r in rows), rows
    agreements = [line for line in out.splitlines() if line.startswith("- greedy tokens agree")]
    assert len(agreements) == len(rows) and all("(within the model tolerance)" in a for a in agreements)
