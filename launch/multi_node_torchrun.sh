#!/usr/bin/env bash
# distanom on several nodes with plain torchrun and c10d rendezvous: run this on every
# node, with the same MASTER_ADDR (a host every node reaches) and RDZV_ID.
#   NNODES=2 MASTER_ADDR=node0 RDZV_ID=job42 launch/multi_node_torchrun.sh train.py --args
# torchrun numbers the ranks; distanom's group forms on torchrun's own store, so nothing
# else needs a port.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to a host every node reaches (the rendezvous host)}"
NNODES=${NNODES:-2}
NPROC=${NPROC:-8}
RDZV_ID=${RDZV_ID:-distanom-$USER}
RDZV_PORT=${RDZV_PORT:-29500}

# Run directory. With a filesystem every node sees (NFS, Lustre, ...), every node passes
# the same --run-dir and the run is one folder: RUN_DIR=/shared/$USER/runs. Without one,
# each node writes its own copy of the run under its own --run-dir (the default below, a
# local folder); collect the copies afterwards and report them as one run:
#   distanom report node0/runs/<run-id> node1/runs/<run-id>
RUN_DIR=${RUN_DIR:-runs}

torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$RDZV_PORT" --rdzv-id "$RDZV_ID" \
    -m distanom.launch --run-dir "$RUN_DIR" ${DISTANOM_CONFIG:+--config "$DISTANOM_CONFIG"} \
    "$@"
