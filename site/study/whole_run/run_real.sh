#!/usr/bin/env bash
# Whole runs on real processes: examples/transformers_lm.py, GPT-2 2 x 64 (the simulator study's second workload)
# on the corpus the study wrote (study_lm_scale.py --corpus copyright --max-mb 1.5 --write-corpus), 8 ranks x 8
# sequences of 64 bytes (global batch 64, as the study), nanoGPT's AdamW recipe with 10% warm-up and cosine decay
# to lr/10 at the last step, one epoch (STEPS, default 348), one thread per rank:
#   docs/study/whole_run/run_real.sh TOPOLOGY TAG SEED [transformers_lm.py arguments...]
# TOPOLOGY: ddp8 (torchrun, 8 flat ranks), ddp2x4 (two torchrun launches of 4 ranks reporting node0/node1 through
# HOROVOD_TERNGRAD_HOST: the node-aware exchange; HOROVOD_TERNGRAD_GBPS=1 prices an Ethernet link), hvd8
# (horovodrun --gloo -np 8).  CORPUS: the corpus file (default /tmp/whole_run_copyright.txt, written on first use).
# Writes docs/study/whole_run/real/TOPOLOGY-TAG.s<SEED>.json and .log; skips a run whose JSON exists.
set -euo pipefail
cd "$(dirname "$0")/../../.."
topo=$1 tag=$2 seed=$3; shift 3
out=docs/study/whole_run/real/$topo-$tag.s$seed
mkdir -p "$(dirname "$out")"
[ -f "$out.json" ] && exit 0
corpus=${CORPUS:-/tmp/whole_run_copyright.txt}
[ -f "$corpus" ] || .venv/bin/python examples/study_lm_scale.py --corpus copyright --max-mb 1.5 --write-corpus "$corpus"
steps=${STEPS:-348}
args=(examples/transformers_lm.py --recipe nanogpt --n-layer 2 --n-embd 64 --batch-size 8 --seq-len 64
      --steps "$steps" --warmup $((steps / 10)) --lr 2e-3 --log-every 50 --eval-every $((steps / 4))
      --corpus "$corpus" --seed "$seed" --json "$out.json" "$@")
port=$((29500 + RANDOM % 1000))
export OMP_NUM_THREADS=1
case "$topo" in
  ddp8) .venv/bin/torchrun --nproc_per_node 8 --master_port "$port" "${args[@]}" --frontend ddp > "$out.log" 2>&1 ;;
  ddp2x4)
    node() {
      HOROVOD_TERNGRAD_HOST=node$1 HOROVOD_TERNGRAD_GBPS=${HOROVOD_TERNGRAD_GBPS:-1} \
        .venv/bin/torchrun --nnodes 2 --node_rank "$1" --nproc_per_node 4 --master_addr 127.0.0.1 \
        --master_port "$port" "${args[@]}" --frontend ddp
    }
    node 1 > "$out.node1.log" 2>&1 &
    other=$!
    node 0 > "$out.log" 2>&1
    wait "$other"
    rm -f "$out.node1.log" ;;
  hvd8) .venv/bin/horovodrun --gloo -np 8 -H localhost:8 .venv/bin/python "${args[@]}" --frontend horovod \
          > "$out.log" 2>&1 ;;
  *) echo "TOPOLOGY must be ddp8, ddp2x4 or hvd8" >&2; exit 2 ;;
esac
