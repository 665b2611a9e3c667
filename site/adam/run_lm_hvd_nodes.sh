#!/usr/bin/env bash
# One Horovod run of examples/transformers_lm.py (--recipe nanogpt, GPT-2 4 x 128, 1000 steps, the recipe's 16
# sequences per rank: the global batch of docs/adam/run_lm.sh's 4-rank runs, 64) on 2 emulated nodes x 2 ranks: horovodrun --gloo
# -np 4 on this machine, ranks 0-1 reporting node0 and ranks 2-3 node1 to TernGrad (HOROVOD_TERNGRAD_HOST), so the
# node-aware exchange runs (HOROVOD_TERNGRAD_GBPS=1 prices an Ethernet link, as terngrad-launch's ethernet
# profile does):
#   docs/adam/run_lm_hvd_nodes.sh TAG SEED [transformers_lm.py arguments...]
# Writes docs/adam/runs/TAG.s<SEED>.json and .log; skips a run whose JSON exists.
set -euo pipefail
cd "$(dirname "$0")/../.."
tag=$1 seed=$2; shift 2
out=docs/adam/runs/$tag.s$seed
[ -f "$out.json" ] && exit 0
args=(examples/transformers_lm.py --frontend horovod --recipe nanogpt --n-layer 4 --steps 1000 --log-every 100
      --seed "$seed" --json "$out.json" "$@")
# horovodrun's gloo launcher gives each process HOROVOD_RANK: its node is rank / 2
HOROVOD_TERNGRAD_GBPS=${HOROVOD_TERNGRAD_GBPS:-1} OMP_NUM_THREADS=1 \
  .venv/bin/horovodrun --gloo -np 4 -H localhost:4 \
  sh -c 'HOROVOD_TERNGRAD_HOST=node$((HOROVOD_RANK / 2)) exec "$0" "$@"' .venv/bin/python "${args[@]}" \
  > "$out.log" 2>&1 || { echo "FAILED: $tag seed $seed" >&2; tail -5 "$out.log" >&2; }
