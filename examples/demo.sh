#!/usr/bin/env bash
# Set up distanom in .venv and run the 4-rank demo: a toy DDP job in which rank 2
# (the last rank, with fewer than 3) stalls on steps 60 and 120. CPU + gloo when
# there is no GPU for every rank.
# Then print the report and write runs/latest/report.html.
#   examples/demo.sh                 # 4 ranks, 160 steps
#   NPROC=2 STEPS=300 examples/demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
.ci/setup-env
export PATH="$PWD/.venv/bin:$PATH" OMP_NUM_THREADS=1
NPROC="${NPROC:-4}"
STALL_RANK=$(( NPROC > 2 ? 2 : NPROC - 1 ))
torchrun --standalone --nproc-per-node "$NPROC" -m distanom.launch \
    --run-dir runs --config configs/demo.yaml \
    examples/toy_train.py --steps "${STEPS:-160}" \
    --stall-rank "$STALL_RANK" --stall-steps 60,120 --stall-s 0.5
distanom report runs/latest
distanom report runs/latest --html runs/latest/report.html
