"""The tolerance of CPU tests that compare a patched float32 model with the stock one: rounding
alone on the CPU; off it, a GPU's float32 matrix products (TF32 on CUDA) round more, so the
model tolerance applies when these tests run on a GPU."""

from __future__ import annotations

import mlx.core as mx

from graphkern.models import MODEL_TOLERANCES

ATOL, RTOL = (1e-5, 1e-5) if mx.default_device() == mx.cpu else MODEL_TOLERANCES[mx.float32]
