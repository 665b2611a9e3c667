# Shared body of the sbatch scripts (sourced; not a job script itself).
# Runs the training command on every task of the allocation through launch/terngrad-launch with the
# cluster's network profile, and keeps each job's logs in logs/<job name>-<job id>/.
#   LAUNCHER=srun|mpirun|horovodrun   how ranks start (default srun, with PMIx)
#   TERNGRAD=0                        fp32 baseline (the script needs no change)
#   IFACE=eth1                        interface to pin (default: detected)
#   TERNGRAD_REPO=/path/to/checkout   where launch/ lives (default: the directory sbatch ran in)
run_job() {
  local profile="$1"; shift
  if [ "$#" -eq 0 ]; then echo "usage: sbatch [options] $0 TRAIN_COMMAND [ARGS...]" >&2; exit 2; fi
  local launcher="${LAUNCHER:-srun}"
  local logdir="$REPO/logs/${SLURM_JOB_NAME:-job}-${SLURM_JOB_ID:-0}"
  mkdir -p "$logdir"
  local per_node="${SLURM_NTASKS_PER_NODE:-1}"
  per_node="${per_node%%(*}"                     # "4(x2)" -> "4"
  local hosts
  hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/\$/:$per_node/" | paste -sd, -)
  local args=(-np "${SLURM_NTASKS:-1}" --network "$profile" --launcher "$launcher")
  [ "$launcher" = srun ] || args+=(-H "$hosts")
  [ -z "${IFACE:-}" ] || args+=(--iface "$IFACE")
  [ "${TERNGRAD:-1}" != 0 ] || args+=(--no-terngrad)
  {
    echo "job ${SLURM_JOB_ID:-?} '${SLURM_JOB_NAME:-?}': nodes ${SLURM_JOB_NODELIST:-?} (${SLURM_JOB_NUM_NODES:-?}), ${SLURM_NTASKS:-1} tasks, profile $profile, launcher $launcher"
    echo "command: $(printf '%q ' "$@")"
  } | tee "$logdir/job.log"
  set +e
  "$REPO/launch/terngrad-launch" "${args[@]}" -- "$@" 2>&1 | tee "$logdir/train.log"
  local rc=${PIPESTATUS[0]}
  set -e
  echo "exit code $rc" | tee -a "$logdir/job.log"
  return "$rc"
}

# PyTorch DDP jobs (slurm/ddp-terngrad.sbatch): no terngrad-launch, no MPI; ranks meet by torch.distributed's
# env rendezvous at the first node of the allocation.
#   LAUNCHER=torchrun (default)  one srun task per node runs torchrun --nnodes N --nproc_per_node <tasks per node>
#                                --rdzv_backend c10d --rdzv_endpoint <first node>:<port>; the command runs with
#                                torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
#   LAUNCHER=srun                one srun task per rank; RANK=SLURM_PROCID, WORLD_SIZE=SLURM_NTASKS,
#                                LOCAL_RANK=SLURM_LOCALID, MASTER_ADDR=<first node>, MASTER_PORT exported
#   MASTER_PORT=...              (default 20000 + job id mod 20000)
#   TORCHRUN="python -m torch.distributed.run"   (default: the command's python when it starts with one, else
#                                torchrun from PATH)
#   IFACE=eth1                   pins gloo and NCCL to an interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)
run_ddp_job() {
  if [ "$#" -eq 0 ]; then echo "usage: sbatch [options] $0 python TRAIN_SCRIPT [ARGS...]" >&2; exit 2; fi
  local launcher="${LAUNCHER:-torchrun}"
  local logdir="$REPO/logs/${SLURM_JOB_NAME:-job}-${SLURM_JOB_ID:-0}"
  mkdir -p "$logdir"
  local nodes="${SLURM_JOB_NUM_NODES:-1}"
  local per_node="${SLURM_NTASKS_PER_NODE:-1}"
  per_node="${per_node%%(*}"                     # "4(x2)" -> "4"
  local head
  head=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-$(hostname)}" | head -n 1)
  export MASTER_ADDR="$head" MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  [ -z "${IFACE:-}" ] || export GLOO_SOCKET_IFNAME="$IFACE" NCCL_SOCKET_IFNAME="$IFACE"
  local cmd
  case "$launcher" in
    torchrun)
      local trun
      if [ -n "${TORCHRUN:-}" ]; then read -r -a trun <<< "$TORCHRUN"
      elif [[ "$(basename "$1")" == python* ]]; then trun=("$1" -m torch.distributed.run); shift
      else trun=(torchrun); fi
      cmd=(srun --ntasks="$nodes" --ntasks-per-node=1 --kill-on-bad-exit=1 "${trun[@]}" --nnodes "$nodes"
           --nproc_per_node "$per_node" --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT"
           --rdzv_id "${SLURM_JOB_ID:-0}" "$@") ;;
    srun)
      # shellcheck disable=SC2016  # expanded by each task's shell, not here
      cmd=(srun --kill-on-bad-exit=1 /bin/sh -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID \
LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE%%(*} exec "$@"' ddp-rank "$@") ;;
    *) echo "LAUNCHER must be torchrun or srun for DDP jobs, got '$launcher'" >&2; exit 2 ;;
  esac
  {
    echo "job ${SLURM_JOB_ID:-?} '${SLURM_JOB_NAME:-?}': nodes ${SLURM_JOB_NODELIST:-?} ($nodes), $per_node ranks per node, DDP, launcher $launcher, rendezvous $MASTER_ADDR:$MASTER_PORT"
    echo "command: $(printf '%q ' "${cmd[@]}")"
  } | tee "$logdir/job.log"
  set +e
  "${cmd[@]}" 2>&1 | tee "$logdir/train.log"
  local rc=${PIPESTATUS[0]}
  set -e
  echo "exit code $rc" | tee -a "$logdir/job.log"
  return "$rc"
}
