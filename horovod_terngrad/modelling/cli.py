"""The performance model's command line: ``python -m horovod_terngrad.modelling`` (the Fig.-5 tables and
figures, perfmodel.py) and ``python -m horovod_terngrad.modelling hsdp`` (the HSDP tables).  Kept apart from
perfmodel.py so that the model does not import its figures (plots.py imports the model)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Sequence

from ..config import TernGradConfig
from ..exchange import policy
from ..exchange.names import label
from .hsdp import (GPT_MODELS, HSDP_BF16, HSDP_METHODS, HSDP_TERNGRAD_OWNER_STEP, HSDP_WORKERS, format_hsdp_table, predict_hsdp,
                   scheduled_hsdp)
from .perfmodel import (ALL_METHODS, ALLREDUCE_ALGORITHMS, ALLREDUCE_AUTO, CLUSTERS, FP32, OWNER_STEP_LEVELS,
                        OWNER_STEP_PACKING,
                        TERNGRAD_OWNER_STEP, Cluster, HOROVOD_FUSION_BYTES, MODELS, TERNGRAD_FUSION_NUMEL, Network,
                        format_table, predict_scaling, worker_counts)

PACKING_HELP = ("packing of every TernGrad column (default: each one's own: 2bit for TernGradConfig()'s exchanges, "
                f"{OWNER_STEP_PACKING} for OwnerStepOptimizer's owner-step column)")


def packings(packing: str | None) -> tuple[str, str]:
    """(the engine's columns' packing, the owner-step column's): ``--packing`` for both, else each one's default
    (``TernGradConfig()``'s, ``OwnerStepOptimizer``'s)."""
    return packing or TernGradConfig.packing, packing or OWNER_STEP_PACKING


def with_owner_step(rows: list, owner_rows: list, key: str) -> list:
    """``rows`` (one dict of predictions per worker count) with the owner-step column ``key`` of ``owner_rows``
    (the same worker counts, priced with the owner-step optimizer's config)."""
    return [{**r, key: o[key]} for r, o in zip(rows, owner_rows)]


def with_gpus_per_node(cluster: Cluster, gpus_per_node: int | None) -> Cluster:
    """``cluster`` with nodes of ``gpus_per_node`` GPUs sharing its NIC (None: the paper's 4); the link inside a
    node stays the cluster's (its ``peer_links`` too)."""
    if gpus_per_node is None or gpus_per_node == cluster.network.ranks_per_node:
        return cluster
    return replace(cluster, network=replace(cluster.network, ranks_per_node=int(gpus_per_node)))


def hsdp_main(argv: Sequence[str] | None = None) -> int:
    """``python -m horovod_terngrad.modelling hsdp [...]``: the HSDP tables."""
    p = argparse.ArgumentParser(prog="python -m horovod_terngrad.modelling hsdp",
                                description="Predicted HSDP step time (FSDP2 inside a node) with fp32, bf16 and "
                                            "TernGrad cross-node averaging, for a GPT on the paper's clusters.")
    p.add_argument("--cluster", choices=("ethernet", "infiniband", "both"), default="both")
    p.add_argument("--model", choices=sorted(GPT_MODELS), default="gpt3-1.3b")
    p.add_argument("--workers", default=",".join(map(str, HSDP_WORKERS)),
                   help="comma-separated GPU counts, multiples of the GPUs of a node (--gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node sharing its NIC, FSDP2's shard group (default: the paper's 4)")
    p.add_argument("--sequences", type=int, default=1, help="sequences of the model's context per GPU and step")
    p.add_argument("--compute-s", type=float, help="override the compute time per iteration, seconds")
    p.add_argument("--packing", choices=("2bit", "base3"), default=None, help=PACKING_HELP)
    p.add_argument("--min-numel", type=int, default=TernGradConfig.min_numel)
    p.add_argument("--bucket-size", type=int, default=TernGradConfig.bucket_size,
                   help="TernGradConfig.bucket_size for every TernGrad column (0: one scaler per tensor or shard; "
                        "k: one per k elements, in both stages of the re-ternarized exchange)")
    p.add_argument("--fusion-numel", type=int, default=TERNGRAD_FUSION_NUMEL)
    p.add_argument("--allreduce", choices=ALLREDUCE_ALGORITHMS, default=ALLREDUCE_AUTO)
    p.add_argument("--overlap", type=float, default=0.0, help="fraction of compute that hides communication")
    p.add_argument("--codec-gelems", type=float, default=None,
                   help="codec rate in 10^9 elements/s (default: codec not modelled)")
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.add_argument("--scheduled", action="store_true",
                   help="the scheduled step model (hsdp.scheduled_hsdp_step: FSDP2's all-gathers, "
                        "reduce-scatters and cross-node exchanges overlapping compute unit by unit) instead of "
                        "the additive one")
    a = p.parse_args(argv)
    workers = [int(w) for w in a.workers.split(",") if w.strip()]
    if a.gpus_per_node is not None and a.gpus_per_node < 1:
        p.error("--gpus-per-node must be >= 1")
    engine_packing, owner_packing = packings(a.packing)
    cfg = TernGradConfig(packing=engine_packing, min_numel=a.min_numel, fusion_numel=a.fusion_numel,
                         bucket_size=a.bucket_size)
    keys = list(CLUSTERS) if a.cluster == "both" else [a.cluster]
    for key in keys:
        cl = with_gpus_per_node(CLUSTERS[key], a.gpus_per_node)
        cl = replace(cl, network=cl.network.with_allreduce(a.allreduce))
        if any(w % cl.network.ranks_per_node for w in workers):
            p.error(f"--workers must be multiples of {cl.network.ranks_per_node}")
        engine = tuple(m for m in HSDP_METHODS if m != HSDP_TERNGRAD_OWNER_STEP)
        owner = (HSDP_BF16, HSDP_TERNGRAD_OWNER_STEP)
        rows = with_owner_step(_hsdp_rows(cl, workers, engine, cfg, a),
                               _hsdp_rows(cl, workers, owner, cfg.replace(packing=owner_packing,
                                                                          levels=OWNER_STEP_LEVELS), a),
                               HSDP_TERNGRAD_OWNER_STEP)
        print(format_hsdp_table(GPT_MODELS[a.model], cl, rows, markdown=a.markdown))
        print()
    return 0


def _hsdp_rows(cluster: Cluster, workers: list, methods: tuple, cfg: TernGradConfig, a: argparse.Namespace) -> list:
    """The HSDP rows of ``methods`` priced with ``cfg``: the scheduled or the additive step model, as asked."""
    if a.scheduled:
        return scheduled_hsdp(GPT_MODELS[a.model], cluster, workers, methods=methods, sequences=a.sequences,
                              compute_s=a.compute_s, config=cfg)
    return predict_hsdp(GPT_MODELS[a.model], cluster, workers, methods=methods, sequences=a.sequences,
                        compute_s=a.compute_s, overlap=a.overlap, config=cfg,
                        codec_elements_per_s=a.codec_gelems * 1e9 if a.codec_gelems else None)


def format_scheduled(model, cluster: Cluster, workers, rows, negotiation) -> str:
    """Markdown: per N, the negotiation wait per collective and each method's step and fraction of linear
    scaling (compute alone / step) from the scheduled step model, each method's column headed by its label
    (``exchange.names``: ``default``, what ``TernGradConfig()`` picks; ``auto``, exchange="auto")."""
    methods = list(rows[0])
    head = ["GPUs", "negotiation per collective, ms"] + [label(m) for m in methods]
    lines = [f"{model.name} on {cluster.name} ({cluster.network.name}, {cluster.network.ranks_per_node} GPUs per node), "
             "scheduled step model, world-group negotiation; per method the step in ms (fraction of linear scaling)",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for N, row in zip(workers, rows):
        cells = [str(N), f"{1e3 * negotiation(N, cluster.network):.3f}"]
        cells += [f"{1e3 * t.step_s:.1f} ({t.compute_s / t.step_s:.3f})" for t in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fig5_parser() -> argparse.ArgumentParser:
    """The arguments of ``python -m horovod_terngrad.modelling`` (the Fig.-5 tables and figures)."""
    p = argparse.ArgumentParser(prog="python -m horovod_terngrad.modelling",
                                description="Predicted images/s vs workers with and without TernGrad "
                                            "(TernGrad paper §5, Fig. 5), alpha-beta network model.")
    p.add_argument("--cluster", choices=("ethernet", "infiniband", "both", "custom"), default="both")
    p.add_argument("--bandwidth-gbps", type=float, help="custom cluster: inter-node bandwidth, Gbit/s")
    p.add_argument("--latency-us", type=float, help="custom cluster: per-message latency alpha, us")
    p.add_argument("--ranks-per-node", type=int, default=1, help="custom cluster: ranks sharing a NIC")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="the paper's clusters with nodes of this many GPUs sharing a NIC (default: their 4)")
    p.add_argument("--gpu", choices=("gtx1080", "p100"), default="gtx1080",
                   help="custom cluster: which published compute time to use")
    p.add_argument("--compute-ms", type=float, help="override the compute time per iteration (one model)")
    p.add_argument("--model", choices=("alexnet", "googlenet", "vgga", "all"), default="all")
    p.add_argument("--max-workers", type=int, default=512)
    p.add_argument("--packing", choices=("2bit", "base3"), default=None, help=PACKING_HELP)
    p.add_argument("--fusion-mb", type=float, default=HOROVOD_FUSION_BYTES / 2**20,
                   help="tensor fusion threshold in MiB (0: one message per tensor); default Horovod 0.28.1's 128")
    p.add_argument("--bucket-size", type=int, default=TernGradConfig.bucket_size,
                   help="TernGradConfig.bucket_size for every TernGrad column (0: one scaler per tensor or shard)")
    p.add_argument("--fusion-numel", type=int, default=TERNGRAD_FUSION_NUMEL,
                   help="TernGrad's tensor fusion: elements per fused group (0: none); default TernGradConfig's")
    p.add_argument("--hierarchical", choices=("auto", "true", "false"), default="auto",
                   help="node-aware exchange (TernGradConfig.hierarchical): auto (default) where the cost model "
                        "finds it cheaper per group, true where the nodes allow it, false never")
    p.add_argument("--intra-node-dtype", choices=("float32", "bfloat16"), default=TernGradConfig.intra_node_dtype,
                   help="TernGradConfig.intra_node_dtype: what the node-aware exchange carries inside a node")
    p.add_argument("--intra-gbps", type=float, help="custom cluster: the link inside a node, Gbit/s "
                   "(default: none, the inter-node link is used inside a node too)")
    p.add_argument("--intra-latency-us", type=float, default=5.0, help="custom cluster: its alpha, us")
    p.add_argument("--intra-links", type=int, default=None,
                   help="links from each GPU to its peers inside a node (Network.peer_links): default the "
                        "cluster's (InfiniBand: 3, NVLink fully connected; Ethernet: 1, one PCIe port; custom: 1)")
    p.add_argument("--allreduce", choices=ALLREDUCE_ALGORITHMS, default=ALLREDUCE_AUTO,
                   help="allreduce algorithm charged: auto (default: the cheaper of ring and tree per message, "
                        "as NCCL/Open MPI/gloo pick), ring (ring only) or tree")
    p.add_argument("--overlap", type=float, default=0.0, help="fraction of compute that hides communication")
    p.add_argument("--codec-gelems", type=float, default=None,
                   help="codec rate in 10^9 elements/s (default: codec not modelled)")
    p.add_argument("--scheduled", action="store_true",
                   help="the scheduled step model (timeline.scheduled_scaling: collectives overlapping backward, "
                        "Horovod's fusion rounds, world-group negotiation per collective) instead of the "
                        "additive one; prints the fraction of linear scaling per method")
    p.add_argument("--png", help="write a Fig.-5-like figure here")
    p.add_argument("--exchanges-png", help="write exchange time and bits vs N for one 25M-element tensor on "
                                           "the (first) cluster's inter-node link, one rank per NIC, here")
    return p


def _clusters(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict[str, Cluster]:
    """The clusters the arguments ask for, with their nodes, allreduce algorithm and links inside a node
    (``p.error`` where the arguments contradict each other)."""
    if a.max_workers < 1:
        p.error("--max-workers must be >= 1")
    if a.intra_links is not None and a.intra_links < 1:
        p.error("--intra-links must be >= 1")
    if a.gpus_per_node is not None and (a.gpus_per_node < 1 or a.cluster == "custom"):
        p.error("--gpus-per-node must be >= 1, for the paper's clusters (custom: --ranks-per-node)")
    if a.cluster == "custom":
        if a.bandwidth_gbps is None or a.latency_us is None:
            p.error("--cluster custom needs --bandwidth-gbps and --latency-us")
        intra = (Network.from_gbps("custom intra-node", a.intra_gbps, a.intra_latency_us,
                                   peer_links=a.intra_links or 1) if a.intra_gbps else None)
        net = Network.from_gbps("custom", a.bandwidth_gbps, a.latency_us, a.ranks_per_node, intra)
        clusters = {"custom": Cluster("custom", net, a.gpu, "command line")}
    elif a.cluster == "both":
        clusters = dict(CLUSTERS)
    else:
        clusters = {a.cluster: CLUSTERS[a.cluster]}
    for key, cl in clusters.items():
        cl = with_gpus_per_node(cl, a.gpus_per_node)
        net = cl.network.with_allreduce(a.allreduce)
        if a.intra_links is not None and net.intra_node is not None:
            net = replace(net, intra_node=replace(net.intra_node, peer_links=a.intra_links))
        clusters[key] = replace(cl, network=net)
    return clusters


def _print_scheduled(model_keys, clusters: dict, workers: list, compute_s, a: argparse.Namespace,
                     kwargs: dict) -> None:
    """``--scheduled``: per model and cluster, the scheduled step model's table."""
    from .timeline import negotiation_s, scheduled_scaling
    for mkey in model_keys:
        for cluster in clusters.values():
            rows = scheduled_scaling(MODELS[mkey], cluster, workers, compute_s=compute_s,
                                     fusion_bytes=kwargs["fusion_bytes"], fusion_numel=a.fusion_numel,
                                     hierarchical=kwargs["hierarchical"], config=kwargs["config"])
            print(format_scheduled(MODELS[mkey], cluster, workers, rows, negotiation_s))
            print()


def _print_tables(model_keys, clusters: dict, workers: list, compute_s, kwargs: dict, owner_config) -> dict:
    """Per model and cluster, the additive step model's table (with auto's flat exchange beside it where nodes
    hold several GPUs and the node-aware exchange may run, and the owner-step column priced with
    ``owner_config``); returns {model: {cluster: rows}} for the figures."""
    results = {}
    engine = tuple(m for m in ALL_METHODS if m != TERNGRAD_OWNER_STEP)
    for mkey in model_keys:
        results[mkey] = {}
        for ckey, cluster in clusters.items():
            rows = predict_scaling(MODELS[mkey], cluster, workers, compute_s=compute_s, methods=engine,
                                   flat_too=kwargs["hierarchical"] is not False and cluster.network.ranks_per_node > 1,
                                   **kwargs)
            owner = predict_scaling(MODELS[mkey], cluster, workers, compute_s=compute_s,
                                    methods=(FP32, TERNGRAD_OWNER_STEP), **{**kwargs, "config": owner_config})
            rows = with_owner_step(rows, owner, TERNGRAD_OWNER_STEP)
            results[mkey][ckey] = rows
            print(format_table(MODELS[mkey], cluster, rows))
            print()
    return results


def _write_figures(a: argparse.Namespace, results: dict, clusters: dict) -> None:
    """``--png`` and ``--exchanges-png`` (matplotlib is imported only when a figure is asked for)."""
    if not (a.png or a.exchanges_png):
        return
    from . import plots
    if a.png:
        plots.plot_fig5(results, a.png)
        print(f"wrote {a.png}")
    if a.exchanges_png:
        net = next(iter(clusters.values())).network
        flat_link = replace(net, intra_node=None, ranks_per_node=1)
        plots.plot_exchanges(25_000_000, flat_link, a.exchanges_png, a.max_workers, packings(a.packing)[0])
        print(f"wrote {a.exchanges_png}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m horovod_terngrad.modelling [...]`` (``hsdp [...]``: :func:`hsdp_main`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "hsdp":
        return hsdp_main(argv[1:])
    p = _fig5_parser()
    a = p.parse_args(argv)
    clusters = _clusters(p, a)
    model_keys = list(MODELS) if a.model == "all" else [a.model]
    if a.compute_ms is not None and len(model_keys) > 1:
        p.error("--compute-ms needs a single --model")
    hierarchical = {"true": True, "false": False}.get(a.hierarchical, policy.HIERARCHY_AUTO)
    engine_packing, owner_packing = packings(a.packing)
    cfg = TernGradConfig(packing=engine_packing, bucket_size=a.bucket_size, intra_node_dtype=a.intra_node_dtype)
    kwargs = dict(fusion_bytes=int(a.fusion_mb * 2**20), fusion_numel=a.fusion_numel,
                  overlap=a.overlap, hierarchical=hierarchical,
                  codec_elements_per_s=a.codec_gelems * 1e9 if a.codec_gelems else None, config=cfg)
    compute_s = a.compute_ms / 1e3 if a.compute_ms is not None else None
    workers = worker_counts(a.max_workers)
    if a.scheduled:
        _print_scheduled(model_keys, clusters, workers, compute_s, a, kwargs)
        return 0
    results = _print_tables(model_keys, clusters, workers, compute_s, kwargs,
                            cfg.replace(packing=owner_packing, levels=OWNER_STEP_LEVELS))
    _write_figures(a, results, clusters)
    return 0
