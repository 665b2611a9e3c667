"""Table 1-style study: CifarNet, fp32 vs TernGrad, N simulated workers with a fixed batch per worker.

    python examples/study_cifarnet.py --workers 2,4,8 --epochs 4 --out docs/study [--cifar10 PATH]

Paper Table 1 setup: Adam, base lr 0.0002, batch per worker fixed (64 here) so the total batch grows with
N, all runs the same number of epochs.  Workers are simulated (horovod_terngrad.simulate: the exact
codec and averaging of a real run).  Without --cifar10 it trains on Fashion-MNIST, a SUBSTITUTE, and the
outputs say so.  Writes <out>/cifarnet_study.{json,md}.
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
from cifarnet import SUBSTITUTE, CifarNet, ParameterEMA, augment, evaluate  # noqa: E402

from horovod_terngrad import TernGradConfig  # noqa: E402
from horovod_terngrad.simulate import Simulator, batch_indices  # noqa: E402


def train(data, n_workers: int, compression: str, epochs: float, seed: int, per_worker: int = 64,
          lr: float = 2e-4, test_limit: int = 0, ema_decay: float = 0.9999) -> dict:
    torch.manual_seed(seed)
    xtr, ytr = data["train"]
    model = CifarNet(in_channels=xtr.shape[1])
    decayed = {id(p) for p in model.decayed_parameters()}
    opt = torch.optim.Adam([{"params": [p for p in model.parameters() if id(p) in decayed], "weight_decay": 0.004},
                            {"params": [p for p in model.parameters() if id(p) not in decayed], "weight_decay": 0.0}],
                           lr=lr)
    sim = Simulator(model, n_workers, TernGradConfig(seed=seed), compression=compression)
    batch = per_worker * n_workers
    steps = int(epochs * len(xtr) // batch)
    g = torch.Generator().manual_seed(seed)
    ema = ParameterEMA(model, ema_decay)
    t0 = time.perf_counter()
    for it in range(steps):
        idx = batch_indices(seed, it, len(xtr), batch)
        sim.step(augment(xtr[idx], g), ytr[idx], F.cross_entropy, opt)
        ema.update(model)
    xte, yte = data["test"]
    if test_limit:
        xte, yte = xte[:test_limit], yte[:test_limit]
    return {"workers": n_workers, "compression": compression, "total_batch": batch, "iterations": steps,
            "epochs": epochs, "test_acc": evaluate(model, xte, yte),
            "test_acc_ema": ema.evaluate_with(model, lambda m: evaluate(m, xte, yte)), "ema_decay": ema_decay,
            "seconds": time.perf_counter() - t0}


def write_outputs(rows: list, out: str, epochs: float) -> None:
    """<out>/cifarnet_study.{json,md} from result rows (also used to merge runs made per N)."""
    dataset = rows[0]["dataset"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cifarnet_study.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [f"CifarNet, Adam lr 0.0002, batch 64 per worker, {epochs:g} epochs, data: **{dataset}**. "
             "Accuracy of the final parameters, and (as the paper evaluates) of their exponential moving "
             "average (decay 0.9999, TensorFlow's warm-up).", "",
             "| workers N | total batch | iterations | fp32 | TernGrad | gap | fp32 (EMA) | TernGrad (EMA) | gap (EMA) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({r["workers"] for r in rows}):
        b = next(r for r in rows if r["workers"] == n and r["compression"] == "none")
        t = next(r for r in rows if r["workers"] == n and r["compression"] == "terngrad")
        lines.append(f"| {n} | {b['total_batch']} | {b['iterations']} | {100 * b['test_acc']:.2f}% | "
                     f"{100 * t['test_acc']:.2f}% | {100 * (t['test_acc'] - b['test_acc']):+.2f}% | "
                     f"{100 * b['test_acc_ema']:.2f}% | {100 * t['test_acc_ema']:.2f}% | "
                     f"{100 * (t['test_acc_ema'] - b['test_acc_ema']):+.2f}% |")
    with open(os.path.join(out, "cifarnet_study.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2,4,8")
    p.add_argument("--epochs", type=float, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cifar10", default="")
    p.add_argument("--test-limit", type=int, default=0)
    p.add_argument("--out", default="docs/study")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from horovod_terngrad.data_extra import load_cifar10, load_fashion_mnist
    data = load_cifar10(args.cifar10) if args.cifar10 else load_fashion_mnist()
    dataset = "CIFAR-10" if args.cifar10 else SUBSTITUTE
    rows = []
    for n in (int(v) for v in args.workers.split(",")):
        for comp in ("none", "terngrad"):
            r = train(data, n, comp, args.epochs, args.seed, test_limit=args.test_limit)
            r["dataset"] = dataset
            rows.append(r)
            print(f"[{dataset}] N={n} {comp}: {100 * r['test_acc']:.2f}% (EMA {100 * r['test_acc_ema']:.2f}%, "
                  f"{r['iterations']} iterations, "
                  f"{r['seconds']:.0f}s)", flush=True)
    write_outputs(rows, args.out, args.epochs)


if __name__ == "__main__":
    main()
