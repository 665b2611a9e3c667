#!/usr/bin/env bash
# One run of examples/transformers_lm.py for the Adam study (docs/adam.md), --recipe nanogpt, GPT-2 4 x 128,
# 1000 steps, one thread per rank:
#   docs/adam/run_lm.sh TAG SEED [transformers_lm.py arguments...]
# FRONTEND=ddp (default: torchrun, NPROC gloo ranks, default 2) | fsdp (torchrun, 4 ranks, mesh (2, 2), 8 sequences per rank:
# the same 32 per step) | horovod (horovodrun --gloo, 2 ranks).
# Writes docs/adam/runs/TAG.s<SEED>.json and .log; skips a run whose JSON exists.
set -euo pipefail
cd "$(dirname "$0")/../.."
tag=$1 seed=$2; shift 2
out=docs/adam/runs/$tag.s$seed
[ -f "$out.json" ] && exit 0
frontend=${FRONTEND:-ddp}
# --optim adamw: the study's runs were made when torch's AdamW was the example's default (a tag's --optim overrides it)
common=(examples/transformers_lm.py --frontend "$frontend" --recipe nanogpt --optim adamw --n-layer 4 --steps 1000
        --log-every 100 --seed "$seed" --json "$out.json")
case "$frontend" in
  ddp) cmd=(.venv/bin/torchrun --nproc_per_node "${NPROC:-2}" --master_port $((29500 + RANDOM % 1000)) "${common[@]}") ;;
  fsdp) cmd=(.venv/bin/torchrun --nproc_per_node 4 --master_port $((29500 + RANDOM % 1000)) "${common[@]}"
             --replicas 2 --batch-size 8) ;;
  horovod) cmd=(.venv/bin/horovodrun --gloo -np 2 -H localhost:2 .venv/bin/python "${common[@]}") ;;
  *) echo "FRONTEND must be ddp, fsdp or horovod" >&2; exit 2 ;;
esac
OMP_NUM_THREADS=1 flock /tmp/cpu.lock "${cmd[@]}" "$@" > "$out.log" 2>&1 \
  || { echo "FAILED: $tag seed $seed" >&2; tail -5 "$out.log" >&2; }
