"""README's and the home page's headline: what ran where, then the measured and the modelled figures."""
from __future__ import annotations

import functools

from .common import _pct, _x
from .measured import measured
from .modelled import modelled
from .whole_run import owner_step_headline, whole_run_headline, whole_runs


@functools.lru_cache(maxsize=None)
def headline() -> str:
    """README's and the home page's headline (``DOCS/`` stands for the docs folder), computed once per process."""
    return block_headline(measured(), modelled())


def block_headline(m: dict, mod: dict) -> str:
    """README's and the home page's headline: what ran where, then the measured and the modelled figures.  The HSDP
    rows are the default's plan and the sharded exchange's, from ``modelled()``, the source of choosing.md's table."""
    eth, ib = mod["dp"][("ethernet", 4, 128, "alexnet")], mod["dp"][("infiniband", 4, 128, "alexnet")]
    hsdp = [(M, mod["hsdp"][("ethernet", 4, M)]) for M in (2, 16, 128)]
    nodes = " / ".join(f"{M} nodes" for M, _ in hsdp)
    return "\n".join([
        "**What ran where.** Every measured speed comes from CPUs (2-core machines, gloo and MPI, up to 4 real ranks) "
        "with emulated links: network namespaces shaped with `tc`, at 1 Gbit/s or in the *calibrated regime*, where "
        "fp32's payload takes 8x one rank's compute. Accuracy: on CPUs, and up to 64 workers in a simulator that runs "
        "the real exchange engine. Every speed at more than 4 ranks and every GPU-cluster figure is **modelled** (the "
        "alpha-beta performance model, `horovod_terngrad.modelling`, on the TernGrad paper's clusters). One H100 ran "
        "the GPU check on the kernels of 2026-11-27 ([gpu](DOCS/gpu.md)): that CUDA codec was byte-identical to the "
        "CPU's on GPT-2's and ResNet-50's shapes and on every exchange's golden pins. The kernels shipped now "
        "(rewritten for memory bandwidth, bf16 read directly, the optimizer's multi-tensor kernel) are checked byte "
        "for byte through their host build only. **Not measured**: a training step's time on a GPU, the current "
        "kernels on a GPU, NCCL, more than one GPU. Details: [what is measured where](DOCS/performance.md).",
        "",
        "Measured (CPUs, emulated links):",
        "",
        "| result | figure | evidence |",
        "|---|---|---|",
        f"| bits per gradient element handed to collectives (GPT-2 4x128, `min_numel=0` / defaults) "
        f"| {m['bits_tgc']:.2f} / {m['bits_defaults']:.2f} | [adam](DOCS/adam.md) |",
        f"| DDP step time vs PowerSGD rank 4, 2 hosts, 1 Gbit/s: MLP / ResNet-50 "
        f"| {_x(m['ddp_mlp_vs_psgd4'])} / {_x(m['ddp_resnet50_vs_psgd4'])} | [ddp](DOCS/ddp.md) |",
        f"| DDP step time vs PowerSGD rank 4, GPT-2 6x512, calibrated regime (3 / 5 rounds) "
        f"| {_x(m['ddp_gpt2_r3_vs_psgd4'])} / {_x(m['ddp_gpt2_r5_vs_psgd4'])} (slower) | [ddp](DOCS/ddp.md) |",
        f"| HSDP + TernGrad vs HSDP bf16, 2 hosts x 2 ranks: step time (run / repeat), host-link bytes "
        f"| {_x(m['hsdp_step_vs_bf16'])} / {_x(m['hsdp_step_vs_bf16_r2'])}, {m['hsdp_bytes_vs_bf16']:.3f}x "
        f"| [fsdp](DOCS/fsdp.md) |",
        whole_run_headline(whole_runs()),
        owner_step_headline(whole_runs()),
        f"| held-out loss vs fp32 AdamW, both at the recipe's lr (not fp32's best), `horovod_terngrad.optim.AdamW` "
        f"with the noise estimate's whole sum (no senders' squares) + TernGrad: DDP / HSDP 2x2 (3 seeds), Horovod "
        f"(1 seed) | {_pct(m['adam_ddp'])} / {_pct(m['adam_hsdp'])} / {_pct(m['adam_hvd'])} | [adam](DOCS/adam.md) |",
        f"| the same with torch's AdamW (the gap the recipe closes) | {_pct(m['adam_plain'])} | [adam](DOCS/adam.md) |",
        "",
        "Modelled (the paper's clusters, 4 GPUs per node; never measured):",
        "",
        "| result | figure | evidence |",
        "|---|---|---|",
        f"| Horovod / DDP, AlexNet at 512 GPUs (128 nodes), TernGrad with `exchange=\"auto\"` vs fp32 allreduce: "
        f"Ethernet / InfiniBand | {_x(eth['auto'])} / {_x(ib['auto'])} | [choosing](DOCS/choosing.md) |",
        f"| HSDP GPT-3 1.3B, TernGrad's defaults vs bf16 HSDP, 1 Gbit/s Ethernet: {nodes} "
        f"| {' / '.join(_x(h['default']) for _, h in hsdp)} | [choosing](DOCS/choosing.md) |",
        f"| the same with `exchange=\"sharded\"` | {' / '.join(_x(h['sharded']) for _, h in hsdp)} "
        f"| [choosing](DOCS/choosing.md) |",
    ])
