"""The Adam study's blocks: quickstart.md's figures and docs/adam.md's tables (docs/adam/runs/*.json through
examples/adam_study_table.py).
"""
from __future__ import annotations

import os
import sys

from .common import DOCS, ROOT, _load, _pct


def block_adam(m: dict) -> str:
    over = {r["model"]: r["overhead_default"] for r in _load("docs/adam/optim_overhead.json")}
    return "\n".join([
        "| | figure (docs/adam.md; held-out loss at equal steps, nanoGPT's recipe, 1000 steps) |",
        "|---|---|",
        f"| torch's AdamW with TernGrad vs fp32 AdamW (the gap): GPT-2 4x128, 3 seeds / stdlib corpus 6x96, 1 seed "
        f"| {_pct(m['adam_plain'])} / {_pct(m['adam_plain_stdlib'])} |",
        f"| `horovod_terngrad.optim.AdamW` + TernGrad vs fp32 AdamW: DDP / FSDP2 HSDP 2x2 / Horovod (1 seed) / stdlib "
        f"corpus | {_pct(m['adam_ddp'])} / {_pct(m['adam_hsdp'])} / {_pct(m['adam_hvd'])} / {_pct(m['adam_stdlib'])} |",
        f"| the same at 4 DDP ranks (3 seeds, widely spread) / with the re-ternarized exchange "
        f"| {_pct(m['adam_ddp4'])} / {_pct(m['adam_ddp4_ret'])} |",
        f"| bits per gradient element over the run, `min_numel=0` / TernGrad's defaults | {m['bits_tgc']:.2f} / "
        f"{m['bits_defaults']:.2f} |",
        f"| optimizer step + noise estimate, share of one rank's compute: GPT-2 4x256 / 6x512 "
        f"| {100 * over['gpt2-4x256']:+.1f}% / {100 * over['gpt2-6x512-v16384']:+.1f}% |",
        f"| alternatives: v from full-precision refreshes (`refresh=RefreshSchedule(max_interval=128)`) / DDP "
        f"`fp16_compress_hook` / PowerSGD rank 4 | {_pct(m['adam_refresh'])} / {_pct(m['adam_fp16hook'])} / "
        f"{_pct(m['adam_powersgd4'])} |",
    ])


ADAM_TABLES = (
    ("1. Approaches, DDP (2 ranks), GPT-2 4x128 on pydoc_data, nanoGPT recipe at its lr 2e-3", "fp32",
     "fp32,tgc,tg-adamw-defaults,terngrad-adamw,terngrad-adamw-bucket1024,tg-adamw-m64,tg-adamw-m128-minnumel0,"
     "tg-adamw-w16-flat128,bc-floor0.1,fp16hook,powersgd4"),
    ("2. The same at fp32's best lr, 6e-3", "fp32-lr6e-3",
     "fp32-lr6e-3,tgc-lr6e-3,terngrad-adamw-lr6e-3,tg-adamw-lr6e-3,bc-floor0.1-lr6e-3"),
    ("3. Learning-rate sweep (seed 0)", "fp32",
     "fp32,fp32-lr3e-3,fp32-lr4e-3,fp32-lr6e-3,fp32-lr8e-3,tg-adamw-m128-minnumel0,tg-adamw-lr4e-3,tg-adamw-lr6e-3"),
    ("4. Second corpus and model: GPT-2 6x96 on Python's stdlib source (4.7 MB, < 1 epoch), lr 2e-3",
     "stdlib-6x96-fp32",
     "stdlib-6x96-fp32,stdlib-6x96-tgc,stdlib-6x96-terngrad-adamw,stdlib-6x96-fp32-lr6e-3,stdlib-6x96-tgc-lr6e-3"),
    ("5. FSDP2 / HSDP, mesh (2 replicas x 2 shards), 8 sequences per rank (32 per step, as DDP), lr 2e-3",
     "fsdp-hsdp-fp32", "fsdp-hsdp-fp32,fsdp-tgc"),
    ("6. Horovod (horovodrun --gloo -np 2), lr 2e-3", "hvd-fp32", "hvd-fp32,hvd-tgc,fp32,tgc"),
    ("7. DDP, 4 ranks x 16 sequences (the recipe's; 64 per step): fp32 AdamW, the allgather and the re-ternarized "
     "exchange with the default `optim.AdamW` (3 seeds); torch's AdamW and owner error feedback with the "
     "re-ternarized exchange (seed 0; error feedback is not in the package)", "ddp4-fp32",
     "ddp4-fp32,ddp4-tgc-allgather,ddp4-tgc-reternarized,ddp4-terngrad-adamw-reternarized,"
     "ddp4-tgc-reternarized-feedback"),
)


#: docs/adam/scale-table.md (docs/scale.md includes it): the Adam study at 4 and 8 ranks and on emulated nodes
ADAM_SCALE_TAGS = ("ddp4-fp32,ddp4-tgc-allgather,ddp4-tg-adamw-defaults,ddp4-tgc-reternarized,ddp2x2-tg-adamw-defaults,"
                   "ddp2x2-tg-adamw-bf16,ddp2x2-adamw-defaults,ddp4-tgc-requantized,ddp4-tgc-reternarized-b128,"
                   "hvd2x2-tg-adamw-defaults,hvd2x2-tg-adamw-bf16,ddp8-fp32,"
                   "ddp8-tg-adamw-defaults")


def _adam_table(baseline: str, tags: str) -> str:
    """examples/adam_study_table.py's table of docs/adam/runs/*.json (the same code docs/adam/tables.sh runs)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import adam_study_table
    finally:
        sys.path.pop(0)
    return adam_study_table.table(adam_study_table.load(os.path.join(DOCS, "adam", "runs")), baseline,
                                  tags.split(","))


def block_adam_tables() -> str:
    out = []
    for title, baseline, tags in ADAM_TABLES:
        out += [f"### {title}", "", _adam_table(baseline, tags), ""]
    return "\n".join(out).rstrip()
