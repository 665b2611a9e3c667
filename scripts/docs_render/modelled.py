"""Modelled figures, from ``horovod_terngrad.modelling`` (the performance model): the data-parallel and HSDP
speedups of the choosing-settings table, HSDP's break-even, and the paper's two headline cases; each computed once
per process.
"""
from __future__ import annotations

import functools
from dataclasses import replace


NODES = (1, 2, 16, 128, 512)
SCALING_MODELS = ("alexnet", "googlenet")


def _cluster(key: str, G: int):
    from horovod_terngrad.modelling import hsdp, perfmodel as pm
    cl = pm.CLUSTERS[key]
    return replace(cl, network=replace(cl.network, ranks_per_node=G))


@functools.lru_cache(maxsize=None)
def modelled() -> dict:
    """Data-parallel (Horovod, DDP) and HSDP predictions for the choosing-settings table: per network, GPUs per
    node G and node count M, the speedup over fp32 of TernGrad with ``exchange="auto"`` (node-aware where it is
    cheaper), of the flat allgather (what keeps horovod_terngrad.optim's noise estimate) and of fp16; and for
    HSDP (GPT-3 1.3B) TernGrad's allgather and sharded exchanges against bf16 HSDP."""
    from horovod_terngrad.modelling import hsdp, perfmodel as pm
    out: dict = {"dp": {}, "hsdp": {}}
    for key in ("ethernet", "infiniband"):
        for G in (4, 8):
            cl = _cluster(key, G)
            for mk in SCALING_MODELS:
                model = pm.MODELS[mk]
                c, b = model.compute_s[cl.gpu], model.batch_per_gpu
                for M in NODES:
                    N = M * G
                    row = pm.compare_exchanges(model, c, N, cl.network,
                                               (pm.FP32, pm.FP16, pm.TERNGRAD_BEST, pm.TERNGRAD_DEFAULT),
                                               batch_per_worker=b)
                    fp32 = row[pm.FP32].step_s
                    out["dp"][(key, G, M, mk)] = {
                        "auto": fp32 / row[pm.TERNGRAD_BEST].step_s,
                        "default": fp32 / row[pm.TERNGRAD_DEFAULT].step_s,
                        "fp16": fp32 / row[pm.FP16].step_s,
                        "exchanges": sorted(set(row[pm.TERNGRAD_BEST].exchanges)),
                    }
            W = [M * G for M in NODES if M > 1]
            rows = hsdp.predict_hsdp(hsdp.GPT3_1P3B, cl, W, methods=(hsdp.HSDP_BF16, hsdp.HSDP_TERNGRAD_DEFAULT,
                                                                  hsdp.HSDP_TERNGRAD_SHARDED))
            for M, r in zip([M for M in NODES if M > 1], rows):
                out["hsdp"][(key, G, M)] = {"default": r[hsdp.HSDP_TERNGRAD_DEFAULT].speedup_vs_bf16,
                                           "sharded": r[hsdp.HSDP_TERNGRAD_SHARDED].speedup_vs_bf16}
    return out


@functools.lru_cache(maxsize=None)
def hsdp_break_even(key: str = "ethernet", G: int = 4) -> dict:
    """Where HSDP + TernGrad's allgather stops beating bf16 HSDP on the paper cluster (docs/perfmodel.md's table)."""
    from horovod_terngrad.modelling import hsdp, perfmodel as pm
    cl = pm.CLUSTERS[key]
    rows = hsdp.predict_hsdp(hsdp.GPT3_1P3B, cl, hsdp.HSDP_WORKERS, methods=(hsdp.HSDP_BF16, hsdp.HSDP_TERNGRAD,
                                                                       hsdp.HSDP_TERNGRAD_SHARDED))
    sp = [(r[hsdp.HSDP_TERNGRAD].workers // G, r[hsdp.HSDP_TERNGRAD].speedup_vs_bf16,
           r[hsdp.HSDP_TERNGRAD_SHARDED].speedup_vs_bf16) for r in rows]
    wins = [n for n, s, _ in sp if s > 1.0]
    return {"rows": sp, "last_win_nodes": max(wins) if wins else 0,
            "first": sp[0], "at16": next(x for x in sp if x[0] == 16), "last": sp[-1]}


def paper_vs_model() -> dict:
    """The model's figures for the paper's two headline cases (perfmodel.md's table): per case, {method: prediction}
    with the node-aware default and, flat (``hierarchical=False``), "auto" and the allgather exchange."""
    from horovod_terngrad.modelling import hsdp, perfmodel as pm
    out = {}
    for mk, ck, N in (("alexnet", "ethernet", 8), ("vgga", "infiniband", 512)):
        model, cl = pm.MODELS[mk], pm.CLUSTERS[ck]
        c, b = model.compute_s[cl.gpu], model.batch_per_gpu
        row = pm.compare_exchanges(model, c, N, cl.network, (pm.FP32, pm.TERNGRAD_DEFAULT, pm.TERNGRAD_BEST),
                                   batch_per_worker=b)
        flat = pm.compare_exchanges(model, c, N, cl.network, (pm.FP32, pm.TERNGRAD_BEST, pm.TERNGRAD_ALLGATHER),
                                    batch_per_worker=b, hierarchical=False)
        out[(mk, N)] = {"default": row[pm.TERNGRAD_DEFAULT], "auto": row[pm.TERNGRAD_BEST], "fp32": row[pm.FP32],
                        "flat_auto": flat[pm.TERNGRAD_BEST], "flat_allgather": flat[pm.TERNGRAD_ALLGATHER]}
    return out
