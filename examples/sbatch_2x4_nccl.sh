#!/bin/bash
# 8 GPU peers on 2 nodes x 4 GPUs over NCCL: one Slurm job, one srun task per GPU, each task one rank of
# backend=torch (the app reads its rank from SLURM_PROCID of SLURM_STEP_NUM_TASKS and the master from the
# step's node list: dpsgd.backends.slurm; no torchrun needed). Each peer takes the GPU of its rank on its node
# (SLURM_LOCALID), and gloo's and NCCL's interface is the one on the route to the first node (dpsgd.netif).
#
#   sbatch examples/sbatch_2x4_nccl.sh                      # the default experiment on 8 GPUs
#   sbatch examples/sbatch_2x4_nccl.sh algorithm=allreduce model=resnet20 data=cifar10 precision=bf16
#
# Arguments are the app's overrides. Run it from the repository (or with the wheel installed: dpsgd-train).
# The run folder is outputs/slurm-JOBID unless you pass hydra.run.dir=DIR. Without a GPU (tests, a dry run on
# CPU): DPSGD_DEVICE=cpu DPSGD_DIST_BACKEND=gloo.
#SBATCH --job-name=dpsgd-2x4
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=4
#SBATCH --time=01:00:00
set -euo pipefail

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export DPSGD_RUN_DIR=${DPSGD_RUN_DIR:-outputs/slurm-${SLURM_JOB_ID}}  # one folder for every rank
PYTHON=${PYTHON:-python}

# Alternative with torchrun (its rendezvous on the first node), one launcher task per node:
#   head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
#   srun --ntasks-per-node=1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 4 \
#     --rdzv-backend c10d --rdzv-endpoint "$head:29500" -m experiments.train backend=torch device=cuda ...
# or with MPI (CUDA-aware MPI where the cluster has one): srun ... python -m experiments.train backend=mpi ...
srun --kill-on-bad-exit=1 "$PYTHON" -m experiments.train \
  backend=torch \
  backend.dist_backend="${DPSGD_DIST_BACKEND:-nccl}" \
  device="${DPSGD_DEVICE:-cuda}" \
  peers="$SLURM_NTASKS" \
  "$@"
