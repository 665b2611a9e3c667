#!/usr/bin/env bash
# One run of examples/transformers_lm.py on DDP, 2 gloo ranks, for the Adam study (docs/adam.md):
#   docs/adam/run_lm.sh TAG SEED [transformers_lm.py arguments...]
# writes docs/adam/runs/TAG.s<SEED>.json and .log; skips a run whose JSON exists.
set -euo pipefail
cd "$(dirname "$0")/../.."
tag=$1 seed=$2; shift 2
out=docs/adam/runs/$tag.s$seed
[ -f "$out.json" ] && exit 0
port=$((29500 + RANDOM % 1000))
OMP_NUM_THREADS=1 flock /tmp/cpu.lock .venv/bin/torchrun --nproc_per_node 2 --master_port $port \
  examples/transformers_lm.py --frontend ddp --recipe nanogpt --n-layer 4 --steps 1000 --log-every 100 \
  --seed "$seed" --json "$out.json" "$@" > "$out.log" 2>&1 || { echo "FAILED: $tag seed $seed" >&2; tail -5 "$out.log" >&2; }
