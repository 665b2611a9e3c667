"""Fig. 3-style study: LeNet on MNIST, fp32 vs TernGrad, for N simulated workers (one CPU process).

    python examples/study_lenet.py --iterations 10000 --workers 1,2,4,8,16,32,64 --out docs/study
    python examples/study_lenet.py --iterations 2000 --workers 8,16,64 --optimizers momentum --exchange owner-step \
        --out docs/study/lenet_owner_step

Setup of the paper (Fig. 3): total mini-batch 64 split over N workers, momentum SGD (base lr 0.01,
momentum 0.9) or vanilla SGD (base lr 0.1), polynomial decay lr = base·(1 - it/iterations)^0.5, weight
decay 5e-4.  Workers are simulated by horovod_terngrad.modelling.simulate (the exact codec and averaging of a
real run).  The fp32 baseline does not depend on N (averaging N equal slices of one batch is the
gradient of the batch), so it is trained once per optimizer and compared with every N.
Writes <out>/lenet_study.json, <out>/lenet_study.md (table) and <out>/lenet_study.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist_lenet import LeNet, evaluate  # noqa: E402

from horovod_terngrad import TernGradConfig  # noqa: E402
from horovod_terngrad.operations.datasets import load_mnist  # noqa: E402
from horovod_terngrad.modelling.simulate import Simulator, batch_indices  # noqa: E402

OPTIMIZERS = {"momentum": dict(lr=0.01, momentum=0.9), "vanilla": dict(lr=0.1, momentum=0.0)}


def train(data, n_workers: int, compression: str, optimizer: str, iterations: int, seed: int,
          batch: int = 64, log_every: int = 0, ranks_per_node: int = 1, hierarchical=False,
          exchange: str = "allgather") -> dict:
    torch.manual_seed(seed)
    model = LeNet()
    hp = OPTIMIZERS[optimizer]
    opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp["momentum"], weight_decay=5e-4)
    owner = exchange == "owner-step"
    if owner:       # OwnerStepOptimizer's arithmetic (examples/owner_step.py): the owners step SGD on their shards
        from owner_step import OwnerStepSimulator
        sim = OwnerStepSimulator(model, n_workers, TernGradConfig(seed=seed, exchange="requantized",
                                                                  packing="base3", hierarchical=False))
    else:
        sim = Simulator(model, n_workers, TernGradConfig(seed=seed, hierarchical=hierarchical, exchange=exchange),
                        compression=compression, ranks_per_node=ranks_per_node)
    hierarchical = compression == "terngrad" and sim.topology.flat_reason() is None and hierarchical is not False
    xtr, ytr = data["train"]
    t0 = time.perf_counter()
    for it in range(iterations):
        for group in opt.param_groups:
            group["lr"] = hp["lr"] * (1 - it / iterations) ** 0.5
        idx = batch_indices(seed, it, len(xtr), batch)
        if owner:
            sim.to_replica()
            avg = sim.average(sim.worker_gradients(xtr[idx], ytr[idx], F.cross_entropy))
            sim.to_master()
            for p, g in zip(sim.params, avg):
                p.grad = g
            opt.step()
            sim.send_weights()
        else:
            sim.step(xtr[idx], ytr[idx], F.cross_entropy, opt)
        if log_every and (it + 1) % log_every == 0:
            print(f"  [{optimizer} {compression} N={n_workers}] iteration {it + 1}/{iterations} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    if owner:
        sim.to_replica()            # what every rank computes on (the master's accuracy differs by a step)
    acc = evaluate(model, *data["test"])
    return {"workers": n_workers, "compression": compression, "optimizer": optimizer, "iterations": iterations,
            "ranks_per_node": ranks_per_node, "hierarchical": bool(hierarchical), "exchange": exchange,
            "test_acc": acc, "seconds": time.perf_counter() - t0,
            "bits_per_element": (sum(sim.bits_received()) if owner else
                                 sim.stats.bits_per_element() if compression == "terngrad" else 32.0)}


def write_outputs(results: list, out: str, iterations: int) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "lenet_study.json"), "w") as f:
        json.dump(results, f, indent=1)
    base = {r["optimizer"]: r["test_acc"] for r in results if r["compression"] == "none"}
    nodes = any(r.get("hierarchical") for r in results)
    lines = [f"LeNet / MNIST, {iterations} iterations, total batch 64 (paper Fig. 3 setup); accuracy on the 10k test set.",
             "", "| optimizer | workers N | exchange | fp32 | TernGrad | TernGrad - fp32 |" if nodes else
             "| optimizer | workers N | fp32 | TernGrad | TernGrad - fp32 |", "|---|---|---|---|---|---|" if nodes else
             "|---|---|---|---|---|"]
    for r in sorted((r for r in results if r["compression"] == "terngrad"),
                    key=lambda r: (r["optimizer"], r["workers"], r.get("hierarchical", False))):
        b = base.get(r["optimizer"])
        if b is None:
            continue
        how = (f"| nodes of {r['ranks_per_node']} (hierarchical) " if r.get("hierarchical") else "| flat ") if nodes else ""
        lines.append(f"| {r['optimizer']} | {r['workers']} {how}| {100 * b:.2f}% | {100 * r['test_acc']:.2f}% | "
                     f"{100 * (r['test_acc'] - b):+.2f}% |")
    with open(os.path.join(out, "lenet_study.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, opt in zip(axes, OPTIMIZERS):
        rs = sorted((r for r in results if r["optimizer"] == opt and r["compression"] == "terngrad"
                     and not r.get("hierarchical")),
                    key=lambda r: r["workers"])
        if not rs:
            continue
        ns = [r["workers"] for r in rs]
        ax.plot(ns, [100 * r["test_acc"] for r in rs], "o-", label="TernGrad")
        if opt in base:
            ax.plot(ns, [100 * base[opt]] * len(ns), "s--", label="fp32 (baseline)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers N (total batch 64)")
        ax.set_title(f"LeNet/MNIST, {opt} SGD, {iterations} it.")
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("test accuracy (%)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "lenet_study.png"), dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=10_000)
    p.add_argument("--workers", default="1,2,4,8,16,32,64")
    p.add_argument("--optimizers", default="momentum,vanilla")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="docs/study")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="simulate nodes of this many ranks (contiguous placement)")
    p.add_argument("--exchange", default="allgather", choices=["allgather", "owner-step"],
                   help="owner-step: horovod_terngrad.optim.OwnerStepOptimizer's arithmetic (examples/owner_step.py)")
    p.add_argument("--hierarchical", default="false", choices=["false", "true", "both"],
                   help="with --ranks-per-node: the node-aware exchange, the flat one (false), or both per N")
    args = p.parse_args(argv)
    variants = {"false": [False], "true": [True], "both": [False, True]}[args.hierarchical]
    torch.set_num_threads(args.threads)
    data = load_mnist()
    results = []
    for opt in args.optimizers.split(","):
        results.append(train(data, 1, "none", opt, args.iterations, args.seed, log_every=max(1, args.iterations // 4)))
        print(f"{opt} fp32: {100 * results[-1]['test_acc']:.2f}%", flush=True)
        for n in (int(v) for v in args.workers.split(",")):
            for hier in variants:
                results.append(train(data, n, "terngrad", opt, args.iterations, args.seed,
                                     log_every=max(1, args.iterations // 4), ranks_per_node=args.ranks_per_node,
                                     hierarchical=hier, exchange=args.exchange))
                print(f"{opt} TernGrad N={n}{' hierarchical' if results[-1]['hierarchical'] else ''}: "
                      f"{100 * results[-1]['test_acc']:.2f}%", flush=True)
                write_outputs(results, args.out, args.iterations)
    write_outputs(results, args.out, args.iterations)
    return results


if __name__ == "__main__":
    main()
