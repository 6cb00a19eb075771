#!/usr/bin/env bash
# distanom on one node: torchrun starts one process per GPU, each under distanom.launch.
#   launch/single_node.sh train.py --its --args
# Run directory: $RUN_DIR (default ./runs, where the job starts); each job gets its own
# runs/<run-id>/ and runs/latest points at it. One node needs nothing else: every rank
# writes into the same local folder.
set -euo pipefail
NPROC=${NPROC:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
if [ "$NPROC" -lt 1 ]; then NPROC=1; fi   # no GPU: one CPU process (gloo)
RUN_DIR=${RUN_DIR:-runs}

torchrun --standalone --nproc-per-node "$NPROC" \
    -m distanom.launch --run-dir "$RUN_DIR" ${DISTANOM_CONFIG:+--config "$DISTANOM_CONFIG"} \
    "$@"

# afterwards:
#   distanom report "$RUN_DIR/latest" --html report.html
