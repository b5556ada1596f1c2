"""benchmarks/generate.py's sweep at its CPU smoke size: every preset architecture builds, is
patched, decodes stock and patched, and is reported with its agreement with stock."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import generate  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_sweep_reports_each_architecture_and_its_agreement(capsys: pytest.CaptureFixture[str]) -> None:
    names = "llama-3.2-1b,phi-3-mini,gemma-2-2b"
    assert generate.main(["--sweep", "--quick", "--preset", names, "--rounds", "1", "--tokens", "4",
                          "--prefill", "8", "--batches", "1", "--dtypes", "float32", "--sweep-bits", ""]) == 0
    out = capsys.readouterr().out
    table = out[out.index("## sweep"):].splitlines()
    rows = [line for line in table if line.startswith("| ") and "quick size" in line]
    assert [r.split(" (quick size)")[0].lstrip("| ") for r in rows] == names.split(",")
    # float32: greedy tokens as stock's, and the first logits within the model tolerance
    assert all(r.rstrip(" |").endswith("100%") for r in rows), rows
    agreements = [line for line in out.splitlines() if line.startswith("- greedy tokens agree")]
    assert len(agreements) == 3 and all("(within the model tolerance)" in a for a in agreements)
