"""scripts/cuda_emulate.py: the library's CUDA bodies, as MLX generates them, run on the CPU (every
thread a fiber) against the kernels' references. The only check of the CUDA bodies' arithmetic that
needs no GPU; it needs a host C++ compiler."""

import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
import cuda_emulate  # noqa: E402 - a script, not a package module

from graphkern.debugging.tolerance import TOLERANCES, worst_errors  # noqa: E402
from graphkern.kernels.base import apply_plan  # noqa: E402
from graphkern.kernels.ops.quantized_projections import quantized_case  # noqa: E402
from graphkern.kernels.ops.quantized_rope_projections import rotated_case  # noqa: E402
from graphkern.kernels.registry import LIBRARY  # noqa: E402
from graphkern.launching.backends import using_backend  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(cuda_emulate.compiler() is None, reason="no host C++ compiler")]


def test_a_row_kernel_matches_its_reference() -> None:
    assert cuda_emulate.compare("rms_norm", (3, 96), mx.float32)[2]


@pytest.mark.parametrize("name", ["quantized_norm_projections", "quantized_norm_swiglu",
                                  "quantized_norm_rope_projections"])
@pytest.mark.parametrize("bits", [4, 8])
def test_rows_of_one_quantization_group_match_the_reference(name: str, bits: int) -> None:
    """Eight rows of 128 features in groups of 128, float32: where MLX's own CUDA product is wrong
    on Hopper, the kernels' bodies give the dequantized product."""
    key = mx.random.key(bits)
    if name == "quantized_norm_rope_projections":
        case = rotated_case((1, 8, 128), mx.float32, key, group_size=128, bits=bits)
    else:
        case = quantized_case((8, 128), mx.float32, key, gated=name.endswith("swiglu"), group_size=128,
                              bits=bits)
    with using_backend("cuda"):
        plan = LIBRARY[name].plan(*case.args, **case.kwargs)
    atol, rtol = TOLERANCES[mx.float32]
    assert worst_errors(cuda_emulate.emulate(plan), apply_plan(plan, "reference"), rtol=rtol, atol=atol)[2]
