#!/usr/bin/env bash
# The one command to run on the device machine for the cupti backend:
#   bash bench/device_check_cupti.sh
# 1. environment facts (torch, CUDA, GPU, libcupti found, pydantic present or not);
# 2. the GPU tests: python3 -m pytest tests/gpu -q -m gpu (-s: every test prints what it saw);
# 3. the correctness demo (ResNet18 with an injected GPU sleep, trace written for Perfetto).
# Logs and files go to $OUT (or ./device_out). Exit status: non-zero if tests or demo failed.
# The overhead benchmark is separate (it takes ~8 minutes): python3 bench/overhead.py
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

{
  echo "== $(date -u +%FT%TZ) $(hostname)"
  python3 - <<'EOF'
import sys, torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name())
from distanom.tracers.cupti import library as cupti_lib
print("libcupti candidates", cupti_lib.libcupti_candidates())
from distanom.tracers.cupti import probe_cupti
print("probe_cupti():", probe_cupti())
try:
    import pydantic
    print("pydantic", pydantic.VERSION)
except ImportError:
    print("pydantic absent: tests and scripts use a plain namespace config")
EOF
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1
} 2>&1 | tee "$OUT/env.log"

timeout 480 python3 -m pytest tests/gpu -q -m gpu -s -rA -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
rc_tests=${PIPESTATUS[0]}

timeout 120 python3 bench/cupti_demo.py --out "$OUT" 2>&1 | tee "$OUT/demo.log"
rc_demo=${PIPESTATUS[0]}

echo "gpu tests rc=$rc_tests, demo rc=$rc_demo" | tee "$OUT/summary.txt"
[ "$rc_tests" -eq 0 ] && [ "$rc_demo" -eq 0 ]
