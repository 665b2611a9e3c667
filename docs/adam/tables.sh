#!/usr/bin/env bash
# The tables of docs/adam.md from docs/adam/runs/*.json:  bash docs/adam/tables.sh
# Tags: fp32 = torch AdamW, no hook; tgc = horovod_terngrad.optim.AdamW at its default (v less the exchange's noise
# estimate) with TernGrad min_numel=0; tg-adamw-defaults = the same with every TernGrad default (min_numel 4096);
# terngrad-adamw = torch AdamW with TernGrad (the gap of issue 34); tg-adamw-m* = the refresh mode
# (RefreshSchedule max_interval 64 / 128; tg-adamw-w16-flat128: 16 warm-up steps, then every 128th only: v too
# stale, it diverges); bc-floor0.1 = the noise correction replayed in one process
# (examples/study_adam_bias_correction.py); fp16hook / powersgd4 = DDP's fp16_compress_hook / PowerSGD rank 4.
cd "$(dirname "$0")/../.."
T() { .venv/bin/python examples/adam_study_table.py docs/adam/runs "$@"; echo; }
echo "### 1. Approaches, DDP (2 ranks), GPT-2 4x128 on pydoc_data, nanoGPT recipe at its lr 2e-3"; echo
T --baseline fp32 --tags fp32,tgc,tg-adamw-defaults,terngrad-adamw,terngrad-adamw-bucket1024,tg-adamw-m64,tg-adamw-m128-minnumel0,tg-adamw-w16-flat128,bc-floor0.1,fp16hook,powersgd4
echo "### 2. The same at fp32's best lr, 6e-3"; echo
T --baseline fp32-lr6e-3 --tags fp32-lr6e-3,tgc-lr6e-3,terngrad-adamw-lr6e-3,tg-adamw-lr6e-3,bc-floor0.1-lr6e-3
echo "### 3. Learning-rate sweep (seed 0)"; echo
T --baseline fp32 --tags fp32,fp32-lr3e-3,fp32-lr4e-3,fp32-lr6e-3,fp32-lr8e-3,tg-adamw-m128-minnumel0,tg-adamw-lr4e-3,tg-adamw-lr6e-3
echo "### 4. Second corpus and model: GPT-2 6x96 on Python's stdlib source (4.7 MB, < 1 epoch), lr 2e-3"; echo
T --baseline stdlib-6x96-fp32 --tags stdlib-6x96-fp32,stdlib-6x96-tgc,stdlib-6x96-terngrad-adamw,stdlib-6x96-fp32-lr6e-3,stdlib-6x96-tgc-lr6e-3
echo "### 5. FSDP2 / HSDP, mesh (2 replicas x 2 shards), 8 sequences per rank (32 per step, as DDP), lr 2e-3"; echo
T --baseline fsdp-hsdp-fp32 --tags fsdp-hsdp-fp32,fsdp-tgc
echo "### 6. Horovod (horovodrun --gloo -np 2), lr 2e-3"; echo
T --baseline hvd-fp32 --tags hvd-fp32,hvd-tgc,fp32,tgc
echo "### 7. DDP, 4 ranks x 16 sequences (the recipe's; 64 per step): fp32 AdamW, the allgather and the re-ternarized exchange (issue 35) with the default tg AdamW (3 seeds); plain AdamW and owner error feedback (seed 0; feedback measured at 76c7be9, since reverted)"; echo
T --baseline ddp4-fp32 --tags ddp4-fp32,ddp4-tgc-allgather,ddp4-tgc-reternarized,ddp4-terngrad-adamw-reternarized,ddp4-tgc-reternarized-feedback
echo "### 8. Issue 39: DDP on 2 emulated nodes x 2 with the defaults (node-aware, its noise estimate now carried; ddp2x2-adamw-defaults: torch AdamW there, i.e. what tg AdamW did before without an estimate, seed 0) and 4 flat ranks with the requantized exchange (min_numel=0 as table 7, seed 0), beside table 7's fp32 and allgather (3 seeds; written to docs/adam/scale-table.md, which docs/scale.md includes); the *2x2*-defaults rows ran before stop 45, when the node-aware exchange carried fp32 inside a node; *2x2*-tg-adamw-bf16: the same with today's defaults (bf16 inside the node); hvd2x2-tg-adamw-defaults: Horovod on 2 emulated nodes x 2 with the defaults (hvd2x2-b8: the same at 8 sequences per rank, half the baseline's global batch, the run that looked +2.4%); ddp4-tgc-reternarized-b128: the re-ternarized exchange with one scaler per 128 elements in both stages (bucket_size=128); ddp4-tg-adamw-defaults: 4 flat ranks with every TernGrad default (the allgather exchange, min_numel 4096); ddp8-*: 8 flat ranks at 8 sequences per rank (the same global batch of 64), the default there being the re-ternarized exchange in 128-element buckets, beside fp32 on the same 8 ranks"; echo
T --baseline ddp4-fp32 --tags ddp4-fp32,ddp4-tgc-allgather,ddp4-tg-adamw-defaults,ddp4-tgc-reternarized,ddp2x2-tg-adamw-defaults,ddp2x2-tg-adamw-bf16,ddp2x2-adamw-defaults,ddp4-tgc-requantized,ddp4-tgc-reternarized-b128,hvd2x2-tg-adamw-defaults,hvd2x2-tg-adamw-bf16,hvd2x2-b8-tg-adamw-defaults,ddp8-fp32,ddp8-tg-adamw-defaults | tee docs/adam/scale-table.md
