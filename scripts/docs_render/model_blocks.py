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


def _owner_step_hsdp(key: str, rate) -> tuple:
    """HSDP GPT-3 1.3B at 512 GPUs (nodes of 4) on ``key``'s cluster, the codec free (``rate`` None) or charged:
    (the default, owner-step) as (speedup over bf16 HSDP, step / the 2-bit limit)."""
    from horovod_terngrad.modelling import hsdp
    cl = _cluster(key, 4)
    c = hsdp.hsdp_compute_s(hsdp.GPT3_1P3B, cl.gpu)
    step = lambda m, r=None: hsdp.predict_hsdp_step(hsdp.GPT3_1P3B, 512, cl.network, m, compute_s=c,  # noqa: E731
                                                    codec_elements_per_s=r)
    bf16, limit = step(hsdp.HSDP_BF16).step_s, step(hsdp.HSDP_TERNGRAD).limit_s
    return tuple((bf16 / p.step_s, p.step_s / limit) for p in (step(m, rate) for m in (
        hsdp.HSDP_TERNGRAD_DEFAULT, hsdp.HSDP_TERNGRAD_OWNER_STEP)))


def block_owner_step_512(gpu_check: dict) -> str:
    """perfmodel.md's and scale.md's owner-step rows at 512 GPUs (additive model, nodes of 4): the default beside
    ``OwnerStepOptimizer``'s exchange (base-3; modelled, not built, for HSDP), the codec free and charged at the
    GPU profile of the current gpu_check JSON (as the gpu-codec-512 block)."""
    from horovod_terngrad.modelling import hsdp, perfmodel as pm
    from horovod_terngrad.modelling.gpu_profile import GpuCodecProfile
    rate = GpuCodecProfile.from_check(gpu_check).codec_elements_per_s
    eth = [_owner_step_hsdp("ethernet", r) for r in (None, rate)]
    ib = [_owner_step_hsdp("infiniband", r) for r in (None, rate)]
    cl = _cluster("ethernet", 4)
    c = hsdp.hsdp_compute_s(hsdp.GPT3_1P3B, cl.gpu)
    limit = hsdp.predict_hsdp_step(hsdp.GPT3_1P3B, 512, cl.network, hsdp.HSDP_BF16, compute_s=c).step_s / \
        hsdp.predict_hsdp_step(hsdp.GPT3_1P3B, 512, cl.network, hsdp.HSDP_TERNGRAD, compute_s=c).limit_s

    def cells(pair, k, fmt):          # default free, owner-step free, default charged, owner-step charged
        return " | ".join(fmt(pair[i][j][k]) for i, j in ((0, 0), (0, 1), (1, 0), (1, 1)))
    lines = ["| 512 GPUs (128 nodes x 4), additive model | the default | owner-step (`OwnerStepOptimizer`, base-3) "
             "| the default, codec charged | owner-step, codec charged |", "|---|---|---|---|---|",
             f"| HSDP GPT-3 1.3B, Ethernet: x bf16 HSDP (the 2-bit limit: {_x(limit)}) | {cells(eth, 0, _x)} |",
             f"| HSDP GPT-3 1.3B, Ethernet: step / the 2-bit limit | {cells(eth, 1, _x)} |",
             f"| HSDP GPT-3 1.3B, InfiniBand: step / the 2-bit limit | {cells(ib, 1, _x)} |"]
    for mk, name in (("vgga", "VGG-A"), ("alexnet", "AlexNet")):
        model, ibc = pm.MODELS[mk], _cluster("infiniband", 4)
        rows = [pm.compare_exchanges(model, model.compute_s[ibc.gpu], 512, ibc.network,
                                     (pm.FP32, pm.TERNGRAD_DEFAULT, pm.TERNGRAD_OWNER_STEP),
                                     batch_per_worker=model.batch_per_gpu, codec_elements_per_s=r) for r in (None, rate)]
        pair = [[(row[m].scaling_efficiency,) for m in (pm.TERNGRAD_DEFAULT, pm.TERNGRAD_OWNER_STEP)] for row in rows]
        lines.append(f"| Horovod {name}, InfiniBand: of linear | {cells(pair, 0, lambda v: f'{v:.3f}')} |")
    lines += ["", f"Codec charged: `perfmodel.codec_work_elements` (owner-step: 4n + n/N, as the requantized "
              f"exchange) at {rate / 1e9:.1f}e9 element operations per second, the GPU profile of perfmodel.md's "
              "codec rows ([gpu](gpu.md))."]
    return "\n".join(lines)


def block_owner_step_budget(gpu_check: dict) -> str:
    """perfmodel.md: what the owner-step exchange pays at 512 GPUs on InfiniBand (nodes of 4, additive model) for
    Horovod VGG-A and AlexNet, term by term (``exchange.cost``'s collectives on the plan's sizes), against what the
    0.90 goal leaves; then a sentence on what holds AlexNet back."""
    from horovod_terngrad.exchange import cost
    from horovod_terngrad.modelling import perfmodel as pm
    from horovod_terngrad.modelling.gpu_profile import GpuCodecProfile
    rate = GpuCodecProfile.from_check(gpu_check).codec_elements_per_s
    G, N = 4, 512
    lines = [f"| owner-step, {N} GPUs ({N // G} nodes x {G}), InfiniBand, ms | compute | left for communication "
             f"at 0.90 | the exchange | of it: latency ({N - 1} α per collective) | gradients' alltoall bytes "
             f"({G} GPUs per NIC) | weights' allgather bytes | full-precision allgather bytes | the codec, charged |",
             "|---|---|---|---|---|---|---|---|---|"]
    terms = {}
    for mk, name in (("vgga", "VGG-A"), ("alexnet", "AlexNet")):
        model, cl = pm.MODELS[mk], _cluster("infiniband", G)
        net, c = cl.network, model.compute_s[cl.gpu]
        plan = pm.plan_buffers(pm.TERNGRAD_OWNER_STEP, model.sizes, N, net, names=[n for n, _ in model.tensors])[0]
        exact = [model.sizes[i] for i in plan.exact]
        up, down = cost.owner_step_bytes(list(plan.sizes), N, pm.OWNER_STEP_PACKING)
        total = cost.terngrad_owner_step_cost(list(plan.sizes), N, net, pm.OWNER_STEP_PACKING, exact=exact).time_s
        gather = lambda b: cost.ring_allgather_time(b, N, net) - cost.ring_allgather_time(0, N, net)  # noqa: E731
        t = {"alltoall": cost.alltoall_time(up, N, net, G) - cost.alltoall_time(0, N, net, G),
             "allgather": gather(down), "exact": gather(4 * sum(exact)) if exact else 0.0,
             "codec": pm.codec_work_elements(pm.TERNGRAD_OWNER_STEP, sum(plan.sizes), N) / rate}
        t["latency"] = total - t["alltoall"] - t["allgather"] - t["exact"]
        t.update(compute=c, total=total, exact_tensors=len(exact), exact_elements=sum(exact))
        terms[mk] = t
        lines.append(f"| {name} | {1e3 * c:.1f} | {1e3 * (c / 0.9 - c):.1f} | {1e3 * total:.2f} | "
                     f"{1e3 * t['latency']:.2f} | {1e3 * t['alltoall']:.2f} | {1e3 * t['allgather']:.2f} | "
                     f"{1e3 * t['exact']:.2f} | {1e3 * t['codec']:.2f} |")
    a = terms["alexnet"]
    lines += ["", f"AlexNet: the latency of the exchange's collectives alone ({1e3 * a['latency']:.2f} ms, three of "
              f"{N - 1} steps each among the {N} ranks and the flags' allreduce) is more than the "
              f"{1e3 * (a['compute'] / 0.9 - a['compute']):.1f} ms the goal leaves, before any byte; the bytes "
              f"({1e3 * (a['alltoall'] + a['allgather'] + a['exact']):.2f} ms) are mostly the gradients' alltoall, "
              f"whose {G} GPUs per node share one NIC; its big fc layers are not what costs (their shards are "
              "ternary both ways). The full-precision allgather, one message per peer for "
              f"{a['exact_tensors']} small tensors ({a['exact_elements']:,} elements), costs {N - 1} latencies of "
              f"its own. With the codec charged the flat exchange's 4n + n/N element operations per rank add "
              f"{1e3 * a['codec']:.2f} ms (the default's node-aware stages work on 1/{G} of n across nodes)."]
    return "\n".join(lines)
