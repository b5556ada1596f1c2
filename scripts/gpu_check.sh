#!/usr/bin/env bash
# Everything that proves the GPU half, in two parts that each fit one 10-minute device call:
#   bash scripts/gpu_check.sh tests   # every gpu-marked test (conformance, failures, precompiled,
#                                     # library kernels, patched mlx-lm models)
#   bash scripts/gpu_check.sh bench   # benchmarks/gpu_core.py and benchmarks/gpu_kernels.py
# Output goes to $OUT (the device tool brings it back) or ./gpu-results.
set -uo pipefail
part=${1:?usage: gpu_check.sh tests|bench}
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available())"
case "$part" in
  tests) python3 -m pytest -m gpu -q -p no:cacheprovider --tb=short tests 2>&1 | tee "$out/pytest.txt" ;;
  bench)
    python3 benchmarks/gpu_core.py --markdown "$out/gpu_core.md" 2>&1 | tee "$out/gpu_core.txt"
    python3 benchmarks/gpu_kernels.py --json "$out/gpu_kernels.json" 2>&1 | tee "$out/gpu_kernels.txt" ;;
  *) echo "unknown part '$part': use tests or bench" >&2; exit 2 ;;
esac
