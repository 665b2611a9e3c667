#!/usr/bin/env bash
# The tables of docs/adam.md from docs/adam/runs/*.json:  bash docs/adam/tables.sh
cd "$(dirname "$0")/../.."
T() { .venv/bin/python examples/adam_study_table.py docs/adam/runs "$@"; echo; }
echo "### 1. Approaches, DDP, GPT-2 4x128 on pydoc_data, nanoGPT recipe at its lr 2e-3"; echo
T --baseline fp32 --tags fp32,terngrad-adamw,terngrad-adamw-bucket1024,tg-adamw-m64,tg-adamw-m128-minnumel0,tg-adamw-w16-flat128,bc-floor0.1,tgc,powersgd4,fp16hook
echo "### 2. The same at fp32's best lr, 6e-3"; echo
T --baseline fp32-lr6e-3 --tags fp32-lr6e-3,terngrad-adamw-lr6e-3,tg-adamw-lr6e-3,bc-floor0.1-lr6e-3,tgc-lr6e-3
echo "### 3. Learning-rate sweep (seed 0)"; echo
T --baseline fp32 --tags fp32,fp32-lr3e-3,fp32-lr4e-3,fp32-lr6e-3,fp32-lr8e-3,tg-adamw-m128-minnumel0,tg-adamw-lr4e-3,tg-adamw-lr6e-3
echo "### 4. Second corpus and model: GPT-2 6x96 on Python's stdlib source (4.7 MB, < 1 epoch), lr 2e-3"; echo
T --baseline stdlib-6x96-fp32 --tags stdlib-6x96-fp32,stdlib-6x96-tgc,stdlib-6x96-terngrad-adamw
echo "### 5. FSDP2 / HSDP, mesh (2 replicas x 2 shards), 8 sequences per rank (32 per step, as DDP), lr 2e-3"; echo
T --baseline fsdp-hsdp-fp32 --tags fsdp-hsdp-fp32,fsdp-tgc
echo "### 6. Horovod (horovodrun --gloo -np 2), lr 2e-3"; echo
T --baseline hvd-fp32 --tags hvd-fp32,hvd-tgc,fp32,tgc
