#!/usr/bin/env bash
# One DDP run of examples/transformers_lm.py (--recipe nanogpt, GPT-2 4 x 128, 1000 steps, as docs/adam/run_lm.sh)
# on 2 emulated nodes x 2 ranks: two torchrun launches of 2 ranks (--nnodes 2, rendezvous on loopback), each
# node's ranks reporting their node's name to TernGrad (HOROVOD_TERNGRAD_HOST), so the node-aware exchange runs
# (HOROVOD_TERNGRAD_GBPS=1 prices an Ethernet link, as terngrad-launch's ethernet profile does):
#   docs/adam/run_lm_nodes.sh TAG SEED [transformers_lm.py arguments...]
# Writes docs/adam/runs/TAG.s<SEED>.json and .log (node 0's); skips a run whose JSON exists.
set -euo pipefail
cd "$(dirname "$0")/../.."
tag=$1 seed=$2; shift 2
out=docs/adam/runs/$tag.s$seed
[ -f "$out.json" ] && exit 0
port=$((29500 + RANDOM % 1000))
common=(examples/transformers_lm.py --frontend ddp --recipe nanogpt --n-layer 4 --steps 1000 --log-every 100
        --seed "$seed" --json "$out.json")
node() {
  HOROVOD_TERNGRAD_HOST=node$1 HOROVOD_TERNGRAD_GBPS=${HOROVOD_TERNGRAD_GBPS:-1} OMP_NUM_THREADS=1 \
    .venv/bin/torchrun --nnodes 2 --node_rank "$1" --nproc_per_node 2 --master_addr 127.0.0.1 \
    --master_port "$port" "${common[@]}" "${@:2}"
}
node 1 "$@" > "$out.node1.log" 2>&1 &
other=$!
node 0 "$@" > "$out.log" 2>&1 || { echo "FAILED: $tag seed $seed" >&2; tail -5 "$out.log" >&2; }
wait "$other" || true
rm -f "$out.node1.log"
