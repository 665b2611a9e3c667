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
