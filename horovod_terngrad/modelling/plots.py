"""Plots of the performance model (matplotlib, Agg backend, imported here only).

``plot_fig5``: the Fig.-5-like figure (images/s vs workers, fp32 and TernGrad per cluster);
``plot_exchanges``: each exchange's modelled time and received bits per element for one tensor vs N.
``python -m horovod_terngrad.modelling --png ... --exchanges-png ...`` calls them.
"""
from __future__ import annotations

from ..exchange.cost import (FP16, FP32, TERNGRAD_ALLGATHER, TERNGRAD_BEST, TERNGRAD_REQUANTIZED, TERNGRAD_RETERNARIZED,
                             TERNGRAD_SHARDED, Network, method_cost)
from .perfmodel import CLUSTERS, MODELS, TERNGRAD_DEFAULT, TERNGRAD_FLAT


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_fig5(results: dict, path: str, title: str | None = None) -> str:
    """Fig.-5-like PNG: one subplot per model, images/s vs workers, fp32 and TernGrad per cluster: "default"
    (``TernGradConfig()``) where the rows hold it, "auto" (exchange="auto"), and auto's flat exchange where the
    rows hold it (``predict_scaling(flat_too=True)``).

    ``results``: {model_key: {cluster_key: rows from predict_scaling}}.  matplotlib (Agg) is imported here.
    """
    plt = _pyplot()
    colors = {"ethernet": "tab:red", "infiniband": "tab:blue"}
    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.4), squeeze=False)
    for ax, (mkey, per_cluster) in zip(axes[0], results.items()):
        model = MODELS.get(mkey)
        for ckey, rows in per_cluster.items():
            cluster = CLUSTERS.get(ckey)
            cname = cluster.name if cluster else ckey
            color = colors.get(ckey, "tab:green")
            N = [r[FP32].workers for r in rows]
            ax.plot(N, [r[FP32].images_per_s for r in rows], "--o", color=color, ms=3,
                    label=f"{cname} fp32")
            if all(TERNGRAD_DEFAULT in r for r in rows):   # what TernGradConfig() picks
                ax.plot(N, [r[TERNGRAD_DEFAULT].images_per_s for r in rows], "-s", color=color, ms=3,
                        label=f"{cname} TernGrad default")
            ax.plot(N, [r[TERNGRAD_BEST].images_per_s for r in rows], "-^", color=color, ms=2, lw=0.8, alpha=0.8,
                    label=f"{cname} TernGrad auto")
            if all(TERNGRAD_FLAT in r for r in rows):      # the flat exchange beside the node-aware one
                ax.plot(N, [r[TERNGRAD_FLAT].images_per_s for r in rows], "-.", color=color, lw=0.9,
                        label=f"{cname} TernGrad auto, flat")
            ideal = [n * rows[0][FP32].images_per_s for n in N]
            ax.plot(N, ideal, ":", color=color, lw=0.8, alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs (workers)")
        ax.set_ylabel("images/s")
        ax.set_title(model.name if model else mkey)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or "Predicted training throughput (dotted: linear scaling of one GPU)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_exchanges(numel: int, network: Network, path: str, max_workers: int = 512, packing: str = "2bit") -> str:
    """PNG of each exchange's modelled time for one tensor of ``numel`` elements vs N."""
    plt = _pyplot()
    N = list(range(2, max_workers + 1))
    fig, axes = plt.subplots(1, 2, figsize=(10.4, 4.2))
    for m in (FP32, FP16, TERNGRAD_ALLGATHER, TERNGRAD_SHARDED, TERNGRAD_RETERNARIZED, TERNGRAD_REQUANTIZED):
        costs = [method_cost(m, numel, k, network, packing) for k in N]
        axes[0].plot(N, [c.time_s for c in costs], label=m)
        axes[1].plot(N, [c.bits_per_element for c in costs], label=m)
    axes[0].set_ylabel("s per exchange")
    axes[1].set_ylabel("received bits per element")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"one tensor of {numel:,} elements, {network.describe()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["plot_fig5", "plot_exchanges"]
