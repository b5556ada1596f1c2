#!/usr/bin/env bash
# Everything that proves the GPU half, in parts that each fit one 10-minute device call:
#   bash scripts/gpu_check.sh kernels  # library kernels but RoPE's: gpu tests, then gpu_kernels.py --quick
#   bash scripts/gpu_check.sh rope     # the RoPE kernels' gpu tests (every mlx-lm RoPE layer), values
#   bash scripts/gpu_check.sh core     # conformance, NVRTC failures, precompiled kernels; gpu_core.py
#   bash scripts/gpu_check.sh models   # patched mlx-lm models: gpu tests, then benchmarks/models.py
#   bash scripts/gpu_check.sh quantized  # the quantized projection kernels against stock MLX (GeGLU's aside)
#   bash scripts/gpu_check.sh quantized-geglu  # the quantized GeGLU kernels against stock MLX
#   bash scripts/gpu_check.sh quantized-models  # patched tiny quantized models against stock
#   bash scripts/gpu_check.sh model-commands    # quantized models of real width, and the
#                                               # checkpoint-folder CLI on the GPU
#   bash scripts/gpu_check.sh model-comparisons  # the CPU suite's patched-vs-stock model tests, run on the GPU
#   bash scripts/gpu_check.sh suite    # every test part above at once, each its own process and PTX
#                                      # cache, tests only (no benchmarks): the GPU suite in one call;
#                                      # suite models quantized: those parts only
#   bash scripts/gpu_check.sh generate # mlx-lm generation, stock against patched (the large models, both
#                                      # 16-bit dtypes, eager), then the host time a launch costs
#   bash scripts/gpu_check.sh sweep    # generation at every architecture's checkpoint dimensions, stock
#                                      # against patched (benchmarks/generate.py --sweep, 8 rounds);
#                                      # arguments after it go to it: sweep --preset phi-3-mini,gemma-2-2b
#   bash scripts/gpu_check.sh projections  # the decoding projection kernels with weights read from
#                                          # memory at checkpoint dimensions (benchmarks/block_projections.py);
#                                          # arguments after it go to it: projections --models phi-3-mini
#   bash scripts/gpu_check.sh bench    # the full kernel benchmark (all sizes); arguments after it go
#                                      # to it: bench --kernels swiglu,gelu --dtypes float32
#   bash scripts/gpu_check.sh tune     # launch-shape sweep of the row kernels (benchmarks/gpu_row_configs.py);
#                                      # arguments after it go to the sweep: tune --kernels softmax --dtypes float32
# Logs and results go to the folder $OUT names, else ./gpu-results. Each part's tests stop after
# GPU_PART_SECONDS (default 540, inside a 10-minute device call) and then list the tests that never ran.
set -uo pipefail
part=${1:?usage: gpu_check.sh kernels|rope|core|models|quantized|quantized-geglu|quantized-models|model-commands|model-comparisons|suite|generate|sweep|projections|bench|tune [benchmark arguments]}
shift
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# MLX keeps what NVRTC compiled under MLX_PTX_CACHE_DIR. With GRAPHKERN_PTX_ARCHIVE naming a tar.gz of
# an earlier run's, a fresh machine starts from it instead of compiling every kernel variant again,
# and this run's cache is written back to $out/ptx.tgz for the next machine
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/graphkern-ptx}
mkdir -p "$MLX_PTX_CACHE_DIR"
if [ -n "${GRAPHKERN_PTX_ARCHIVE:-}" ] && [ -f "$GRAPHKERN_PTX_ARCHIVE" ]; then
  tar xzf "$GRAPHKERN_PTX_ARCHIVE" -C "$MLX_PTX_CACHE_DIR" || echo "could not read $GRAPHKERN_PTX_ARCHIVE" >&2
fi
trap 'tar czf "$out/ptx.tgz" -C "$MLX_PTX_CACHE_DIR" . 2>/dev/null || true' EXIT
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, 'cuda', mx.cuda.is_available())"
# -v: one line a test as it ends, so a run the time limit cuts still says what passed; after it, the
# tests that were collected but never reported
gpu_tests() {
  local collected ran
  collected=$(mktemp) ran=$(mktemp)
  python3 -m pytest -m gpu -q --collect-only -p no:cacheprovider "$@" 2>/dev/null | grep '::' | sort > "$collected"
  timeout "${GPU_PART_SECONDS:-540}" python3 -m pytest -m gpu -v -p no:cacheprovider --tb=short "$@" 2>&1 \
    | tee "$ran"
  grep -oE '^[^ ]+::[^ ]+' "$ran" | sort -u | comm -23 "$collected" - > "$ran.missing"
  if [ -s "$ran.missing" ]; then
    echo
    echo "NEVER RAN ($(wc -l < "$ran.missing") of $(wc -l < "$collected") tests; the time limit cut the part):"
    cat "$ran.missing"
  fi
}
# the parts' benchmarks, unless GPU_TESTS_ONLY is set (the suite part sets it: its parts share the GPU)
benchmarks() { [ -z "${GPU_TESTS_ONLY:-}" ]; }
TEST_PARTS="kernels rope core models quantized quantized-geglu quantized-models model-commands model-comparisons"
case "$part" in
  kernels)
    gpu_tests tests/gpu/test_kernels_gpu.py -k "not rope" | tee "$out/pytest_kernels.txt" | tail -15
    benchmarks && python3 benchmarks/gpu_kernels.py --quick --json "$out/gpu_kernels.json" 2>&1 \
      | tee "$out/gpu_kernels.txt" ;;
  rope)
    gpu_tests tests/gpu/test_kernels_gpu.py -k rope tests/gpu/test_values_gpu.py \
      | tee "$out/pytest_rope_values.txt" | tail -15 ;;
  core)
    gpu_tests tests/gpu/test_conformance_gpu.py tests/gpu/test_failures_gpu.py \
      tests/gpu/test_precompiled_gpu.py | tee "$out/pytest_core.txt" | tail -15
    benchmarks && python3 benchmarks/gpu_core.py --markdown "$out/gpu_core.md" --json "$out/gpu_core.json" 2>&1 \
      | tee "$out/gpu_core.txt" | grep -v "^|" ;;
  models)
    gpu_tests tests/gpu/test_models_gpu.py | tee "$out/pytest_models.txt" | tail -15
    benchmarks && python3 benchmarks/models.py --sizes tiny,medium --length 128 --rounds 9 2>&1 | tee "$out/models.txt" ;;
  quantized)  # GeGLU's variants are a part of their own: together they would not finish in one call
    gpu_tests tests/gpu/test_quantized_gpu.py -k "not patched and not geglu" | tee "$out/pytest_quantized.txt" \
      | tail -15 ;;
  quantized-geglu)
    gpu_tests tests/gpu/test_quantized_gpu.py -k "not patched and geglu" | tee "$out/pytest_quantized_geglu.txt" \
      | tail -15 ;;
  quantized-models)
    gpu_tests tests/gpu/test_quantized_gpu.py -k "decodes_as_stock" | tee "$out/pytest_quantized_models.txt" | tail -15 ;;
  model-commands)
    gpu_tests tests/gpu/test_quantized_gpu.py tests/gpu/test_cli_model_gpu.py -k "real_width or model_commands" \
      | tee "$out/pytest_model_commands.txt" | tail -15 ;;
  model-comparisons)  # written for the CPU; on a GPU they hold to the model tolerances (tests/helpers/model_comparisons.py).
    # MLX multiplies float32 matrices in TF32 on CUDA unless told not to: the stock side of a float32
    # comparison then rounds to about 1e-3, past those tolerances, while the kernels accumulate in float32
    MLX_ENABLE_TF32=0 python3 -m pytest -v -p no:cacheprovider --tb=short tests/test_moe_route.py \
      tests/test_grad.py tests/test_fusions.py tests/test_segments.py 2>&1 \
      | tee "$out/pytest_model_comparisons.txt" | tail -15 ;;
  suite)  # parts named after it (suite models quantized) run alone
    scratch=$(mktemp -d)
    TEST_PARTS=${*:-$TEST_PARTS}
    for p in $TEST_PARTS; do
      # each part its own copy of the PTX cache: NVRTC writes a variant's files as it compiles them
      mkdir -p "$scratch/$p.ptx" && cp -r "$MLX_PTX_CACHE_DIR/." "$scratch/$p.ptx/"
      OUT="$scratch/$p" MLX_PTX_CACHE_DIR="$scratch/$p.ptx" GPU_TESTS_ONLY=1 GRAPHKERN_PTX_ARCHIVE= \
        bash "$0" "$p" > "$scratch/$p.log" 2>&1 &
    done
    wait
    # one file for every part's log (a device call brings back a few files): each part's whole
    # pytest log, then what the part itself printed (a crash's message)
    for p in $TEST_PARTS; do
      cp -rn "$scratch/$p.ptx/." "$MLX_PTX_CACHE_DIR/" 2>/dev/null
      { echo "==================== $p"; cat "$scratch/$p"/pytest_*.txt "$scratch/$p.log"; } > "$scratch/$p.all"
      echo "== $p: $(grep -E ' in [0-9.]+s' "$scratch/$p.all" | tail -1)"
      grep -E '^(FAILED|ERROR) |NEVER RAN' "$scratch/$p.all"
    done
    for p in $TEST_PARTS; do cat "$scratch/$p.all"; done > "$out/suite.txt" ;;
  generate)
    python3 benchmarks/generate.py --sizes large --dtypes bfloat16,float16 --modes eager --rounds 4 \
      --tokens 48 --prefill 256,2048 --breakdown --json "$out/generate.json" 2>&1 | tee "$out/generate.txt"
    python3 benchmarks/launch_cost.py 2>&1 | tee "$out/launch_cost.txt" ;;
  sweep)
    python3 benchmarks/generate.py --sweep --rounds 8 --tokens 32 --prefill 128 --dtypes bfloat16 \
      --json "$out/sweep.json" "$@" 2>&1 | tee "$out/sweep.txt" ;;
  projections)
    python3 benchmarks/block_projections.py --json "$out/block_projections.json" "$@" 2>&1 \
      | tee "$out/block_projections.txt" ;;
  bench)
    python3 benchmarks/gpu_kernels.py --json "$out/gpu_kernels_full.json" "$@" 2>&1 | tee "$out/gpu_kernels_full.txt" ;;
  tune)
    python3 benchmarks/gpu_row_configs.py --dtypes bfloat16,float32 "$@" 2>&1 | tee "$out/row_configs.txt" ;;
  *) echo "unknown part '$part': use kernels, rope, core, models, quantized, quantized-geglu, quantized-models, model-commands, model-comparisons, suite, generate, sweep, projections, bench or tune" >&2; exit 2 ;;
esac
