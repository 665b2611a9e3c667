"""Blocks of the performance model's predictions: docs/perfmodel.md's paper-against-model table, goals at 512
GPUs and what dominates them, and docs/scale.md's bf16-inside-the-node table.
"""
from __future__ import annotations

from .common import _x
from .modelled import _cluster


def block_paper_vs_model(pv: dict) -> str:
    a, v = pv[("alexnet", 8)], pv[("vgga", 512)]
    eff = lambda p: f"{p.scaling_efficiency:.3f} of linear"  # noqa: E731
    return "\n".join([
        "| paper (Fig. 5, §5) | this model, the defaults | `exchange=\"auto\"` | flat exchange (`--hierarchical false`): "
        "auto / allgather |",
        "|---|---|---|---|",
        f"| AlexNet, 8 GPUs (2 nodes x 4), 1 Gbit/s Ethernet: 3.04x | {_x(a['default'].speedup_vs_fp32)} "
        f"({a['default'].images_per_s:,.0f} img/s) | {_x(a['auto'].speedup_vs_fp32)} "
        f"| {_x(a['flat_auto'].speedup_vs_fp32)} / {_x(a['flat_allgather'].speedup_vs_fp32)} |",
        f"| VGG-A, 512 GPUs (128 x 4), InfiniBand: about 2x | {_x(v['default'].speedup_vs_fp32)} "
        f"({v['default'].images_per_s:,.0f} img/s, {eff(v['default'])}; fp32 {eff(v['fp32'])}) "
        f"| {_x(v['auto'].speedup_vs_fp32)} ({eff(v['auto'])}) "
        f"| {_x(v['flat_auto'].speedup_vs_fp32)} / {_x(v['flat_allgather'].speedup_vs_fp32)} |",
    ])


def block_bf16_intra() -> str:
    """scale.md's "bf16 inside the node" model table: the default with ``intra_node_dtype`` fp32 against bf16 (the
    default), additive model; fraction of linear scaling at 512 GPUs on InfiniBand, and AlexNet's speedup over
    fp32 at 8 GPUs on Ethernet."""
    from horovod_terngrad.config import TernGradConfig
    from horovod_terngrad.modelling import hsdp, perfmodel as pm

    def row(mk, key, G, N, dtype):
        model, cl = pm.MODELS[mk], _cluster(key, G)
        r = pm.compare_exchanges(model, model.compute_s[cl.gpu], N, cl.network, (pm.FP32, pm.TERNGRAD_DEFAULT),
                                 batch_per_worker=model.batch_per_gpu, config=TernGradConfig(intra_node_dtype=dtype))
        return r[pm.TERNGRAD_DEFAULT]
    lines = ["| the default, additive model | fp32 inside (`intra_node_dtype=\"float32\"`) | bf16 inside (default) |",
             "|---|---|---|"]
    for mk, name in (("vgga", "VGG-A"), ("alexnet", "AlexNet")):
        for G in (4, 8):
            f, b = (row(mk, "infiniband", G, 512, d).scaling_efficiency for d in ("float32", "bfloat16"))
            lines.append(f"| {name}, 512 GPUs, InfiniBand, nodes of {G}: fraction of linear | {f:.3f} | **{b:.3f}** |")
    f, b = (row("alexnet", "ethernet", 4, 8, d).speedup_vs_fp32 for d in ("float32", "bfloat16"))
    lines.append(f"| AlexNet, 8 GPUs (2 nodes x 4), 1 Gbit/s Ethernet: speedup over fp32 | {_x(f)} | **{_x(b)}** |")
    return "\n".join(lines)


def block_goals_512() -> str:
    """perfmodel.md's goals at 512 GPUs for the default: additive / scheduled model, nodes of 4 (of 8 in brackets)."""
    from horovod_terngrad.modelling import hsdp, perfmodel as pm
    from horovod_terngrad.modelling import timeline as tl
    fig: dict = {}
    for G in (4, 8):
        for mk in ("vgga", "alexnet"):
            model, cl = pm.MODELS[mk], _cluster("infiniband", G)
            c = model.compute_s[cl.gpu]
            add = pm.compare_exchanges(model, c, 512, cl.network, (pm.FP32, pm.TERNGRAD_DEFAULT),
                                       batch_per_worker=model.batch_per_gpu)[pm.TERNGRAD_DEFAULT].scaling_efficiency
            sch = c / tl.scheduled_scaling(model, cl, [512], methods=(pm.TERNGRAD_DEFAULT,))[0][pm.TERNGRAD_DEFAULT].step_s
            fig[(mk, G)] = (add, sch)
        for key in ("ethernet", "infiniband"):
            cl = _cluster(key, G)
            meth = (hsdp.HSDP_BF16, hsdp.HSDP_TERNGRAD_DEFAULT)
            a = hsdp.predict_hsdp(hsdp.GPT3_1P3B, cl, [512], methods=meth)[0][hsdp.HSDP_TERNGRAD_DEFAULT]
            b = hsdp.scheduled_hsdp(hsdp.GPT3_1P3B, cl, [512], methods=meth)[0][hsdp.HSDP_TERNGRAD_DEFAULT]
            fig[("hsdp", key, G)] = (a.speedup_vs_bf16, b.speedup_vs_bf16, a.step_s / a.limit_s, b.step_s / b.limit_s)

    def met(pairs):   # pairs: (additive ok, scheduled ok) for nodes of 4 and of 8
        if all(x for p in pairs for x in p):
            return "yes"
        if not any(x for p in pairs for x in p):
            return "**no**"
        return "; ".join(f"nodes of {G}: " + ("yes" if all(p) else "scheduled only" if p[1] else
                                               "additive only" if p[0] else "no") for G, p in zip((4, 8), pairs))

    he = [fig[("hsdp", "ethernet", G)] for G in (4, 8)]
    hi = [fig[("hsdp", "infiniband", G)] for G in (4, 8)]
    lines = ["| goal | the default (additive / scheduled; nodes of 8 in brackets) | met? |", "|---|---|---|",
             f"| HSDP GPT-3 1.3B, Ethernet: ≥ 4x bf16 HSDP | {_x(he[0][0])} / {_x(he[0][1])} "
             f"({_x(he[1][0])} / {_x(he[1][1])}) | {met([(h[0] >= 4, h[1] >= 4) for h in he])} |",
             f"| HSDP GPT-3 1.3B, InfiniBand: within 1.05x of its limit | {_x(hi[0][2])} / {_x(hi[0][3])} "
             f"({_x(hi[1][2])} / {_x(hi[1][3])}) | {met([(h[2] <= 1.05, h[3] <= 1.05) for h in hi])} |"]
    for mk, name in (("vgga", "VGG-A"), ("alexnet", "AlexNet")):
        f4, f8 = fig[(mk, 4)], fig[(mk, 8)]
        lines.append(f"| Horovod {name}, InfiniBand: ≥ 0.90 of linear | {f4[0]:.3f} / {f4[1]:.3f} "
                     f"({f8[0]:.3f} / {f8[1]:.3f}) | {met([(f[0] >= 0.9, f[1] >= 0.9) for f in (f4, f8)])} |")
    return "\n".join(lines)


def block_goal_budget() -> str:
    """perfmodel.md's "what dominates": for Horovod VGG-A and AlexNet at 512 GPUs on InfiniBand (nodes of 4, the
    default's additive plan), the communication the 0.90 goal leaves, the node-aware groups and the latency their
    cross-node exchanges pay before any byte (2·(M-1) per-message latencies each, M nodes)."""
    from horovod_terngrad.modelling import hsdp, perfmodel as pm
    G, N = 4, 512
    M = N // G
    lines = [f"| Horovod, {N} GPUs ({M} nodes x {G}), InfiniBand | compute ms | left for communication at 0.90 ms "
             "| node-aware groups | their cross-node latency alone ms |", "|---|---|---|---|---|"]
    for mk, name in (("vgga", "VGG-A"), ("alexnet", "AlexNet")):
        model, cl = pm.MODELS[mk], _cluster("infiniband", G)
        c = model.compute_s[cl.gpu]
        row = pm.compare_exchanges(model, c, N, cl.network, (pm.FP32, pm.TERNGRAD_DEFAULT),
                                   batch_per_worker=model.batch_per_gpu)[pm.TERNGRAD_DEFAULT]
        groups = sum(e == "terngrad_hierarchical" for e in row.exchanges)
        alpha = cl.network.latency_s
        lines.append(f"| {name} | {1e3 * c:.1f} | {1e3 * (c / 0.9 - c):.1f} | {groups} "
                     f"| {1e3 * groups * 2 * (M - 1) * alpha:.2f} ({groups} x 2·{M - 1} α, α = {1e6 * alpha:g} µs) |")
    return "\n".join(lines)
