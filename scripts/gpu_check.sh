#!/usr/bin/env bash
# GPU check of the DFlash Triton kernels (a few minutes on one H200).
#
#   bash scripts/gpu_check.sh              # from anywhere; results table on stdout
#   OUT=/some/dir bash scripts/gpu_check.sh   # also writes $OUT/gpu_check.json and the logs
#   bash scripts/gpu_check.sh --dry-run    # CPU: the same steps in Triton's interpreter, tiny shapes
#   TEST_TIMEOUT=200 CHECK_TIMEOUT=240 bash scripts/gpu_check.sh   # seconds per step (default 900, 1200)
#
# Needs PyTorch with CUDA and Triton (preinstalled on the GPU machine); no TensorRT, no network.
# 1. tests/test_kernels.py compiled for the local GPU (DFLASH_TEST_KERNELS_ON_GPU=1, no interpreter):
#    every kernel == its PyTorch reference, AOT compile for sm_90/sm_100.
# 2. scripts/gpu_check.py: each kernel timed against the engine's PyTorch path and the
#    memory-bandwidth bound at Qwen3-8B drafter shapes, outputs checked against the references,
#    greedy generate() identical with kernels=triton and kernels=torch; prints one table.
# Paste that table into README.md ("GPU kernel check") with the date and GPU.
# The repo is used in place (PYTHONPATH), so no `pip install` is needed; missing optional Python
# packages (pytest, transformers, ...) skip the parts that need them, loudly.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
LOG=${OUT:-/tmp}/gpu_check_logs
mkdir -p "$LOG"
status=0
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not found"
DRY=$DRY "$PY" - <<'EOF' || { echo "error: torch/triton/CUDA not usable"; exit 2; }
import torch, triton
print(f"python ok; torch {torch.__version__} (CUDA {torch.version.cuda}); triton {triton.__version__}; "
      f"cuda available: {torch.cuda.is_available()}")
import os
assert os.environ.get("DRY") == "1" or torch.cuda.is_available(), "no CUDA device visible to torch"
EOF
missing=$("$PY" -c "
import importlib.util as u
print(' '.join(m for m in ('yaml', 'pytest', 'safetensors', 'transformers', 'click', 'rich') if u.find_spec(m) is None))")
[ -n "$missing" ] && echo "note: not installed here: $missing (parts that need them are skipped)"

echo "== 1. tests/test_kernels.py on the GPU"
gpu_env=(DFLASH_TEST_KERNELS_ON_GPU=1)
[ "$DRY" = 1 ] && gpu_env=(DFLASH_TEST_KERNELS_ON_GPU=0) && echo "DRY RUN: in Triton's CPU interpreter instead"
if "$PY" -c "import pytest" 2>/dev/null; then
    conftest_ok=$("$PY" -c "import sys; sys.path.insert(0, 'tests'); import conftest" 2>/dev/null && echo yes || echo no)
    extra=()
    [ "$conftest_ok" = no ] && extra=(--noconftest) && echo "note: tests/conftest.py cannot import here; running with --noconftest"
    env "${gpu_env[@]}" timeout "${TEST_TIMEOUT:-900}" "$PY" -m pytest -q -p no:cacheprovider "${extra[@]}" tests/test_kernels.py tests/test_lowp_linear.py \
        2>&1 | tee "$LOG/test_kernels_gpu.log" | tail -25
    rc=${PIPESTATUS[0]}
    echo "test_kernels.py on GPU: exit $rc"
    [ "$rc" -ne 0 ] && status=1
else
    echo "SKIPPED: pytest is not installed (gpu_check.py below still checks every kernel against its reference)"
fi

echo "== 2. kernel timings (scripts/gpu_check.py)"
dry=()
[ "$DRY" = 1 ] && dry=(--dry-run)
timeout "${CHECK_TIMEOUT:-1200}" "$PY" scripts/gpu_check.py "${dry[@]}" ${OUT:+--json "$OUT/gpu_check.json"} 2>&1 | tee "$LOG/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_check.py: exit $rc"
[ "$rc" -ne 0 ] && status=1

echo "== 3. FP8 vs bf16 linears at Qwen3-8B layer shapes (scripts/gpu_fp8_step.py; sm_89+)"
timeout "${CHECK_TIMEOUT:-1200}" "$PY" scripts/gpu_fp8_step.py "${dry[@]}" ${OUT:+--json "$OUT/gpu_fp8_step.json"} 2>&1 | tee "$LOG/gpu_fp8_step.log"
rc=${PIPESTATUS[0]}
echo "gpu_fp8_step.py: exit $rc"
[ "$rc" -ne 0 ] && status=1
exit $status
