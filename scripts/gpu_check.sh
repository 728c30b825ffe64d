#!/usr/bin/env bash
# Everything that needs a CUDA GPU, as one run of at most about 8 minutes: the GPU tests, then the benchmark on
# the GPU (bf16, sdpa; flash_attention_2 too when flash_attn is installed), with torch.profiler tables of the
# batch-1 decode rows.
#
#   make gpu-check               # a GPU machine with this package installed
#   bash scripts/gpu_check.sh    # also a bare CUDA image with torch and transformers: the repo root goes on
#                                # PYTHONPATH and nothing is installed
#   DEVICE=cpu QUICK=1 bash scripts/gpu_check.sh   # runs the whole script on the CPU at toy sizes, as a check
#
# Results land in $OUT (default runs/gpu-check): env.txt, tests.txt, benchmarks-<device>.md, benchmark.log (the
# per-row lines and the profiles), and benchmarks-<device>-fa2.md / fa2.log. Every stage has its own time
# limit, and the benchmark rewrites its table after each row, so a slow stage still leaves what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-runs/gpu-check}"
QUICK_FLAG=()
[ -n "${QUICK:-}" ] && QUICK_FLAG=(--quick)
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export MINIMIND_TEST_DEVICE="$DEVICE"
failed=()

echo "== environment"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null \
    || echo "nvidia-smi: not found"
  "$PY" - <<'PY'
import platform
import torch, transformers
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"transformers {transformers.__version__}")
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
try:
    import flash_attn
    print("flash_attn", flash_attn.__version__)
except ImportError:
    print("flash_attn: not installed")
PY
} 2>&1 | tee "$OUT/env.txt"

echo "== tests on $DEVICE"
# The GPU tests, and the CPU model tests as a check of this machine's torch and transformers.
timeout 150 "$PY" -m pytest tests/model/test_cuda.py tests/model/test_modeling.py tests/compat -q -rs \
  -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt" || failed+=(tests)

echo "== benchmark on $DEVICE, sdpa"
timeout 270 "$PY" -m bench --device "$DEVICE" "${QUICK_FLAG[@]}" \
  --profile decode-dynamic-b1-64M decode-dynamic-b1-moe-top2 \
  --output "$OUT/benchmarks-$DEVICE.md" 2>"$OUT/benchmark.log" || failed+=(benchmark)

if "$PY" -c "import flash_attn" 2>/dev/null; then
  echo "== benchmark on $DEVICE, flash_attention_2"
  timeout 90 "$PY" -m bench --device "$DEVICE" "${QUICK_FLAG[@]}" --attn flash_attention_2 \
    --compile off --rows 'train-bf16-*' 'prefill-*' 'decode-dynamic-*' 'decode-static-b*' \
    --output "$OUT/benchmarks-$DEVICE-fa2.md" 2>"$OUT/fa2.log" || failed+=(flash_attention_2)
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu check: FAILED stages: ${failed[*]} (logs in $OUT)"
  exit 1
fi
echo "gpu check: all stages passed (results in $OUT)"
