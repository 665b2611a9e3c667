#!/usr/bin/env bash
# hierarchical="auto"'s link measurement on an emulated cluster: 2 hosts x 2 ranks at 1 Gbit/s (as root),
# RUNS runs of the same 4.2M-parameter job (docs/cluster/link_measurement.py), optionally with BUSY busy loops
# on the cores beside it; one JSON row per run on stdout (LINKROW lines), the log's WARNING lines on stderr.
#   docs/cluster/link_measurement.sh [RUNS=10] [BUSY=2] [TREE=$PWD] [CONTROLLER=gloo|mpi]
# TREE: the checkout whose package runs; gloo: Horovod's gloo controller and CPU ops (docs/cluster/
# link_measurement_gloo.py does what horovodrun --gloo does), mpi: plain mpirun as docs/cluster.md's runs.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
runs="${1:-10}"; busy="${2:-2}"; tree="${3:-$here}"; controller="${4:-gloo}"
py="${PYTHON:-$here/.venv/bin/python}"
prefix=tgl
"$here/launch/netns-cluster.sh" up 2 --rate 1gbit --prefix "$prefix" --subnet 10.78.0 >&2
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; "$here/launch/netns-cluster.sh" down --prefix "$prefix" >&2; }
trap cleanup EXIT
for ((b = 0; b < busy; b++)); do /bin/sh -c 'while :; do :; done' & pids+=($!); done
for ((r = 0; r < runs; r++)); do
  if [ "$controller" = gloo ]; then
    "$here/launch/netns-cluster.sh" exec "$prefix-h0" env "PATH=$(dirname "$py"):$PATH" OMP_NUM_THREADS=1 \
      "PYTHONPATH=$tree" "$py" "$here/docs/cluster/link_measurement_gloo.py" "$prefix-h0:2,$prefix-h1:2" 10.78.0.1 \
      -- "$py" "$here/docs/cluster/link_measurement.py" | grep '^LINKROW' | sed "s/^LINKROW /{\"run\": $r, \"row\": /; s/\$/}/"
    continue
  fi
  "$here/launch/netns-cluster.sh" exec "$prefix-h0" env "PATH=$(dirname "$py"):$PATH" \
    mpirun --allow-run-as-root -np 4 -H "$prefix-h0:2,$prefix-h1:2" --bind-to none --map-by slot \
      --mca plm_rsh_agent "$here/launch/netns-rsh" --mca pml ob1 --mca btl tcp,self,vader \
      --mca btl_vader_single_copy_mechanism none \
      --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
      -x OMP_NUM_THREADS=1 -x OMPI_MCA_mpi_yield_when_idle=1 -x "PYTHONPATH=$tree" -x PATH \
      "$py" "$here/docs/cluster/link_measurement.py" | grep '^LINKROW' | sed "s/^LINKROW /{\"run\": $r, \"row\": /; s/\$/}/"
done
