#!/usr/bin/env bash
# Run plait on several machines: start this script once per node, with the same MASTER_ADDR/PORT.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/multinode.sh --tensor_parallel_size 2 ...
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/multinode.sh --tensor_parallel_size 2 ...
#
# Under Slurm (examples/slurm.sbatch) the node count, rank and master come from SLURM_* variables.
# Extra arguments go to `plait train`. Keep tp within a node: tp ranks are adjacent, so the chattiest
# group never crosses the network.
# On SIGTERM or SIGINT torchrun passes the signal to its workers, which finish the step, save a checkpoint
# and stop (README, "Stopping and resuming a run"); SHUTDOWN_TIMEOUT is how long torchrun lets them before
# it kills them (torchrun's own default is 30 s: too short to save a large model).
set -euo pipefail
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
exec "${PYTHON:-python3}" -m torch.distributed.run \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --shutdown_timeout "${SHUTDOWN_TIMEOUT:-600}" \
  -m plait train "$@"
