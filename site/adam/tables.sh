#!/usr/bin/env bash
# The tables of docs/adam.md and docs/adam/scale-table.md (which docs/scale.md includes), from docs/adam/runs/*.json:
#   bash docs/adam/tables.sh
# scripts/render_docs.py renders them (its ADAM_TABLES say which tags each table shows) with
# examples/adam_study_table.py, and tests/test_docs.py checks the committed pages equal its output.
# Tags: fp32 = torch AdamW, no hook; tgc = horovod_terngrad.optim.AdamW at its default (v less the exchange's noise
# estimate) with TernGrad min_numel=0; tg-adamw-defaults = the same with every TernGrad default (min_numel 4096);
# terngrad-adamw = torch AdamW with TernGrad (the gap); tg-adamw-m* = the refresh mode (RefreshSchedule
# max_interval 64 / 128; tg-adamw-w16-flat128: 16 warm-up steps, then every 128th only: v too stale, it diverges);
# bc-floor0.1 = the noise correction replayed in one process (examples/study_adam_bias_correction.py);
# fp16hook / powersgd4 = DDP's fp16_compress_hook / PowerSGD rank 4; ddp4-* / ddp8-*: 4 / 8 flat DDP ranks;
# ddp2x2-* / hvd2x2-*: DDP / Horovod on 2 emulated nodes x 2 (*-defaults: fp32 inside the node, *-bf16: bf16,
# the default; ddp2x2-adamw-defaults: torch's AdamW there, the control without the correction; hvd2x2-b8: 8
# sequences per rank, half the baseline's global batch: not comparable, so not in the table); *-reternarized-b128: the re-ternarized
# exchange with one scaler per 128 elements; ddp8-tg-adamw-defaults ran the re-ternarized exchange in 128-element
# buckets at 8 sequences per rank, beside fp32 on the same 8 ranks.
cd "$(dirname "$0")/../.."
exec .venv/bin/python scripts/render_docs.py
