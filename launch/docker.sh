#!/usr/bin/env bash
# distanom in the Docker image built from the top-level Dockerfile (a CUDA PyTorch image
# with distanom installed): one container per node, all of its GPUs.
#   docker build -t distanom .                  # once, from the repository root
#   launch/docker.sh train.py --its --args      # the current folder is mounted at /work
# Run directory: /work/runs inside the container, i.e. ./runs on the host (a mounted
# folder, so the run outlives the container). Anything else: RUN_DIR, a path inside
# /work or another folder mounted with DOCKER_ARGS="-v /data/runs:/runs" RUN_DIR=/runs.
set -euo pipefail
IMAGE=${IMAGE:-distanom}
NPROC=${NPROC:-8}
RUN_DIR=${RUN_DIR:-runs}

# Several nodes: run this on every node with NNODES, MASTER_ADDR (a host every node
# reaches) and RDZV_ID set; --network host lets torchrun's rendezvous and NCCL reach the
# other nodes. A folder every node mounts at the same path (-v /shared/runs:/runs,
# RUN_DIR=/runs) holds one run; without one, each node keeps its own copy under its own
# ./runs: collect them and run `distanom report node0/runs/<run-id> node1/runs/<run-id>`.
if [ "${NNODES:-1}" -gt 1 ]; then
    : "${MASTER_ADDR:?set MASTER_ADDR for a multi-node run}"
    rdzv=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${RDZV_PORT:-29500}"
          --rdzv-id "${RDZV_ID:-distanom-$USER}")
else
    rdzv=(--standalone)
fi

# --ipc host: NCCL and DataLoader workers need more shared memory than Docker's 64 MB
# shellcheck disable=SC2086  # DOCKER_ARGS is a list of words on purpose
docker run --rm --gpus all --ipc host --network host ${DOCKER_ARGS:-} \
    -v "$PWD:/work" -w /work "$IMAGE" \
    torchrun "${rdzv[@]}" --nproc-per-node "$NPROC" \
    -m distanom.launch --run-dir "$RUN_DIR" "$@"

# afterwards, with distanom installed on the host or in the image:
#   docker run --rm -v "$PWD:/work" -w /work distanom distanom report runs/latest
