"""docs/choosing.md's table of settings per framework, network and scale, from the model's speedups."""
from __future__ import annotations

from .common import _pct, _x
from .modelled import NODES


def _settings_dp(a: dict, g: dict, adam: bool, M: int) -> str:
    """The settings of a data-parallel row, from its modelled speedups (AlexNet ``a``, GoogLeNet ``g``)."""
    key = "default" if adam else "auto"
    if a[key] < 1.0 and g[key] < 1.0:
        return "TernGrad off: slower than fp32 here" + (" (see the note above the table)" if adam else "")
    if adam:
        s = "`optim.AdamW` with the defaults"
    else:
        s = "`exchange=\"auto\"`"
    if min(a[key], g[key]) < 1.0:
        s += "; off for models with little to compress (GoogLeNet-like)"
    return s


def block_choosing(mod: dict, m: dict) -> str:
    lines = [
        "Modelled speedup of a step over fp32 allreduce (AlexNet / GoogLeNet, the paper's models and batch sizes; "
        "weak scaling; `horovod_terngrad.modelling`). \"auto\" is TernGrad with `exchange=\"auto\"` and "
        "`hierarchical=\"auto\"` (what it picks: fp32 for small tensors, and per group the allgather, the requantized "
        "or the node-aware exchange: the default's own exchanges, weighed per group by the cost "
        "model instead of chosen by N alone); \"default\" is `TernGradConfig()`: `exchange=\"default\"` (the allgather among up to 4 "
        "ranks or nodes, the requantized exchange among more) and `hierarchical=\"auto\"`, every path of which gives "
        "`horovod_terngrad.optim.AdamW` its noise estimate (docs/scale.md). fp16 allreduce for comparison. A speedup "
        "below 1.00x means TernGrad is slower than fp32 there: leave it off.",
        "",
        "| framework | network | GPUs/node | nodes | SGD: settings | SGD: auto | AdamW: settings | AdamW: default "
        "| fp16 | exchanges auto picks (AlexNet) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    net_name = {"ethernet": "Ethernet 1 Gbit/s", "infiniband": "InfiniBand 100 Gbit/s"}
    for key in ("ethernet", "infiniband"):
        for G in (4, 8):
            for M in NODES:
                a, g = mod["dp"][(key, G, M, "alexnet")], mod["dp"][(key, G, M, "googlenet")]
                pair = lambda k: f"{a[k]:.2f} / {g[k]:.2f}"  # noqa: E731
                lines.append(f"| Horovod, DDP | {net_name[key]} | {G} | {M} | {_settings_dp(a, g, False, M)} | "
                             f"{pair('auto')} | {_settings_dp(a, g, True, M)} | {pair('default')} | "
                             f"{pair('fp16')} | {', '.join(e.replace('terngrad_', '') for e in a['exchanges'])} |")
    lines += [
        "",
        "HSDP (FSDP2 inside a node, TernGrad across nodes), GPT-3 1.3B, one sequence of 2048 tokens per GPU: "
        "modelled speedup of the step over HSDP with a bf16 reduce. With 1 node there is no cross-node "
        "exchange: FSDP's own path runs (nothing to set).",
        "",
        "| framework | network | GPUs/node | nodes | settings (SGD or `optim.AdamW`) | default vs bf16 "
        "| `exchange=\"sharded\"` vs bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in ("ethernet", "infiniband"):
        for G in (4, 8):
            for M in NODES[1:]:
                h = mod["hsdp"][(key, G, M)]
                if h["default"] >= h["sharded"] and h["default"] > 1.0:
                    s = "defaults"
                elif h["sharded"] > 1.0:
                    s = ("`exchange=\"sharded\"` (SGD); with `optim.AdamW` the default keeps the estimate"
                         + (" but is slower than bf16 here" if h["default"] <= 1.0 else ""))
                else:
                    s = "bf16 HSDP (TernGrad does not pay here)"
                lines.append(f"| FSDP2 / HSDP | {net_name[key]} | {G} | {M} | {s} | {_x(h['default'])} | "
                             f"{_x(h['sharded'])} |")
    lines += [
        "",
        "Measured behind the optimizer column (docs/adam.md; held-out loss at equal steps against fp32 AdamW): "
        f"`horovod_terngrad.optim.AdamW` with the allgather exchange {_pct(m['adam_ddp'])} (DDP, 2 ranks), "
        f"{_pct(m['adam_hsdp'])} (HSDP 2x2), {_pct(m['adam_ddp4'])} (DDP, 4 ranks; seeds spread widely there); "
        f"torch's AdamW with TernGrad {_pct(m['adam_plain'])}: what you get where no estimate comes (the "
        f"sharded exchange); with the re-ternarized exchange {_pct(m['adam_ddp4_ret'])} at 4 ranks (not recommended "
        "with Adam; accuracy over whole runs at 8-64 ranks: docs/scale.md). Measured behind the speed columns, on CPUs with emulated links: DDP step time vs PowerSGD "
        f"rank 4 {_x(m['ddp_resnet50_vs_psgd4'])} (ResNet-50) and {_x(m['ddp_gpt2_r3_vs_psgd4'])} (GPT-2, not met); "
        f"HSDP + TernGrad {_x(m['hsdp_step_vs_bf16'])} / {_x(m['hsdp_step_vs_bf16_r2'])} of bf16 HSDP's step "
        "(2 hosts x 2 ranks).",
    ]
    return "\n".join(lines)
