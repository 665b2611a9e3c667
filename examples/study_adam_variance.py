"""How much TernGrad inflates Adam's second moment, and so shrinks Adam's steps.

    python examples/study_adam_variance.py --workers 2,4 --out docs/study

Adam moves each parameter by lr * m / (sqrt(v) + eps), where m and v are running means of the gradient and of
its square.  One worker's ternary element is s * sign(g) with probability |g| / s and 0 otherwise, g being
the clipped gradient (|g| <= 2.5 sigma) and s the layer's scaler (the largest |g| over the layer and the
workers), so

    E[t] = g,    E[t^2] = s * |g|  >=  g^2

and the average over N workers adds (1/N^2) * sum_k (s |g_k| - g_k^2) to the square of the mean: the first
moment is unchanged (up to the clipping of the few elements beyond 2.5 sigma), the second is larger.  Adam
divides by the square root of that larger v, so with the same lr the steps are shorter by about

    ratio = sqrt(v_TernGrad / v_fp32)

per element (a heuristic for the drift: TernGrad's m is noisier too).  This script measures the ratio along
an fp32 training trajectory of CifarNet, set up as in study_cifarnet (Adam, weight decay 0.004 on fc3 and
fc4): it trains with fp32 gradients for --warm-steps, then for --steps more it averages the same per-worker
gradients both ways (the exact codec of a real run, horovod_terngrad.modelling.simulate), adds the weight-decay term
that Adam adds after the exchange, and sums both squares over the steps (an equally weighted stand-in for
Adam's running mean, whose 0.999 decay spans ~1000 steps), while still stepping with the fp32 average.  It
reports the ratio's median (and 10th/90th percentiles) over each layer's elements.  A ratio r means
TernGrad + Adam moves about as fp32 + Adam at lr / r: the slower convergence seen in docs/study, and the
reason for trying lr * r with TernGrad.  Writes <out>/adam_variance.{json,md}.
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
from cifarnet import SUBSTITUTE, CifarNet, augment  # noqa: E402

from horovod_terngrad import TernGradConfig  # noqa: E402
from horovod_terngrad.modelling.simulate import Simulator, batch_indices  # noqa: E402


def second_moment_ratios(model: torch.nn.Module, xtr: torch.Tensor, ytr: torch.Tensor, n_workers: int,
                         warm_steps: int, steps: int, lr: float = 2e-4, seed: int = 1, per_worker: int = 64,
                         config: TernGradConfig | None = None) -> list[dict]:
    """Per layer: numel and the quantiles of sqrt(sum (t + wd p)^2 / sum (g + wd p)^2) over its elements, where g
    is the fp32 average and t TernGrad's decoded average of the same per-worker gradients, summed over
    ``steps`` steps of an Adam/fp32 trajectory (after ``warm_steps`` steps of it).  Elements whose fp32 sum
    is 0 are left out (the ratio is undefined there)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1 to measure anything, got {steps}")
    # the paper's settings, with which docs/study was measured: every tensor ternarized, one shared scaler
    config = config or TernGradConfig(seed=seed, min_numel=0, shared_scaler=True)
    fp32 = Simulator(model, n_workers, config, compression="none")
    tern = Simulator(model, n_workers, config, compression="terngrad")
    opt = model.adam(lr)
    params = list(model.parameters())
    decay_of = {id(p): group["weight_decay"] for group in opt.param_groups for p in group["params"]}
    weight_decay = [decay_of[id(p)] for p in params]
    gen = torch.Generator().manual_seed(seed)
    batch = per_worker * n_workers
    sums = None
    for it in range(warm_steps + steps):
        idx = batch_indices(seed, it, len(xtr), batch)
        per_worker_grads = fp32.worker_gradients(augment(xtr[idx], gen), ytr[idx], F.cross_entropy)
        avg = fp32.average(per_worker_grads)
        if it >= warm_steps:
            t_avg = tern.average(per_worker_grads)
            if sums is None:
                sums = [(torch.zeros_like(a, dtype=torch.float64), torch.zeros_like(a, dtype=torch.float64)) for a in avg]
            for (sg, st), a, t, p, wd in zip(sums, avg, t_avg, params, weight_decay):
                sg += (a.double() + wd * p.detach().double()) ** 2       # what Adam squares: grad + wd * p
                st += (t.double() + wd * p.detach().double()) ** 2
        for p, a in zip(params, avg):
            p.grad = a
        opt.step()
    rows = []
    probs = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    for name, (sg, st) in zip(fp32.names, sums or []):
        keep = sg.flatten() > 0
        ratio = (st.flatten()[keep] / sg.flatten()[keep]).sqrt()
        # torch.quantile takes at most 16M elements; a strided sample keeps it exact enough for a median
        sample = ratio[:: max(1, ratio.numel() // 1_000_000)]
        q = torch.quantile(sample, probs).tolist() if sample.numel() else [float("nan")] * 3
        rows.append({"layer": name, "numel": sg.numel(), "p10": q[0], "median": q[1], "p90": q[2],
                     "never_ternarized_nonzero": float(((st.flatten()[keep]) == 0).double().mean())
                     if keep.any() else 0.0})
    return rows


def write_outputs(results: dict, out: str, meta: dict) -> str:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "adam_variance.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    ns = sorted(results, key=int)
    lines = [f"TernGrad vs fp32: sqrt(v_TernGrad / v_fp32), Adam's second moment, per layer (median over its "
             f"elements, [10th, 90th percentile]). CifarNet, data: **{meta['dataset']}**, batch 64 per worker, "
             f"Adam lr {meta['lr']:g}, measured over {meta['steps']} steps after {meta['warm_steps']} fp32 steps. "
             "A ratio r means TernGrad + Adam steps about 1/r as far as fp32 + Adam at the same lr.", "",
             "| layer | elements | " + " | ".join(f"N = {n}" for n in ns) + " |",
             "|---|---|" + "---|" * len(ns)]
    for i, row in enumerate(results[ns[0]]):
        cells = [f"{results[n][i]['median']:.2f} [{results[n][i]['p10']:.2f}, {results[n][i]['p90']:.2f}]" for n in ns]
        lines.append(f"| {row['layer']} | {row['numel']:,} | " + " | ".join(cells) + " |")
    weighted = {n: sum(r["median"] * r["numel"] for r in results[n]) / sum(r["numel"] for r in results[n]) for n in ns}
    lines += ["", "Element-weighted mean of the layer medians: "
              + ", ".join(f"N = {n}: {weighted[n]:.2f}" for n in ns) + "."]
    with open(os.path.join(out, "adam_variance.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return os.path.join(out, "adam_variance.md")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2,4")
    p.add_argument("--warm-steps", type=int, default=300)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cifar10", default="", metavar="PATH")
    p.add_argument("--out", default="docs/study")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from horovod_terngrad.operations.datasets import load_cifar10, load_fashion_mnist
    data = load_cifar10(args.cifar10) if args.cifar10 else load_fashion_mnist()
    xtr, ytr = data["train"]
    results = {}
    for n in (int(v) for v in args.workers.split(",")):
        t0 = time.perf_counter()
        torch.manual_seed(args.seed)
        results[str(n)] = second_moment_ratios(CifarNet(in_channels=xtr.shape[1]), xtr, ytr, n, args.warm_steps,
                                               args.steps, lr=args.lr, seed=args.seed)
        print(f"N={n}: {time.perf_counter() - t0:.0f}s", flush=True)
    meta = {"dataset": "CIFAR-10" if args.cifar10 else SUBSTITUTE, "lr": args.lr, "warm_steps": args.warm_steps,
            "steps": args.steps, "seed": args.seed,
            "command": "python examples/study_adam_variance.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    write_outputs(results, args.out, meta)


if __name__ == "__main__":
    main()
