"""What the node-aware exchange does to TernGrad's variance: one ternarization per node instead of one per GPU.

    python examples/study_node_variance.py --workers 8,16 --ranks-per-node 4 --draws 40 --out docs/study/node_variance

Flat TernGrad averages N independently ternarized gradients.  Rank r's element t_r = s_r·sign(g_r)·b_r with
b_r ~ Bernoulli(|g_r| / s_r) is unbiased, E[t_r] = g_r, with variance s_r·|g_r| - g_r², so the average adds

    V_flat = (1/N²) · Σ_r (s_r·|g_r| - g_r²)

to the fp32 mean (elements beyond the c·σ clip aside).  The node-aware exchange first averages the G ranks of
a node at full precision, m_k = (1/G)·Σ_{r in k} g_r, and ternarizes m_k once, across M = N/G nodes:

    V_node = (1/M²) · Σ_k (s_k·|m_k| - m_k²)  =  (G/N) · mean_k (s_k·|m_k| - m_k²)

still unbiased.  With s_k = s_r and |m_k| = |g_r| (ranks of a node whose gradients agree) that is G times
V_flat.  Two things make it smaller: averaging makes |m_k| smaller where the ranks' gradients disagree
(mini-batch noise), and each local rank ternarizes only its 1/G piece of a tensor, whose scaler (the max over
the piece) is at most the whole tensor's.  So the factor is at most about G, and nearer 1 the noisier the
per-rank gradients.  This script measures it on LeNet/MNIST's real gradients
with the real engines (modelling/simulate.Simulator, flat and with ranks_per_node=G): for a few training
points of an fp32 run it takes one global batch of 64, the N workers' gradients, and averages them --draws
times each way (each draw a new step of the random streams), and reports per training point

    ternarization noise  E||t - g||² / ||g||²   (t: TernGrad's average, g: the fp32 average of the same gradients)
    against SGD's own    E||t - g||² / E||g_b - ḡ||²  (g_b: fp32 average of one batch, ḡ: of --batches batches)

and the node-aware / flat ratio.  Every tensor is ternarized (min_numel=0), per-rank scalers (the default), and
both run the allgather exchange (flat: one ternarization per rank, the V_flat above; node-aware: across the M
nodes), whatever ``exchange="default"`` would pick at that N: a second rounding (the two-stage exchanges the
default runs above 4) is another question (docs/scale.md).
Writes <out>/node_variance.{json,md}.
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
from mnist_lenet import LeNet  # noqa: E402

from horovod_terngrad import TernGradConfig  # noqa: E402
from horovod_terngrad.modelling.simulate import Simulator, batch_indices  # noqa: E402

BATCH = 64


def _sq(tensors) -> float:
    return float(sum((t.double() ** 2).sum() for t in tensors))


def noise(model, x: torch.Tensor, y: torch.Tensor, n_workers: int, ranks_per_node: int, draws: int,
          config: TernGradConfig) -> dict:
    """Relative ternarization noise of the flat and the node-aware exchange on one global batch (x, y)."""
    flat = Simulator(model, n_workers, config)
    node = Simulator(model, n_workers, config, ranks_per_node=ranks_per_node)
    grads = flat.worker_gradients(x, y, F.cross_entropy)
    mean = [torch.stack([g[i] for g in grads]).mean(0) for i in range(len(grads[0]))]
    norm = _sq(mean)
    out = {}
    for label, sim in (("flat", flat), ("node", node)):
        err, bias = 0.0, [torch.zeros_like(m, dtype=torch.float64) for m in mean]
        for _ in range(draws):
            avg = sim.average(grads)
            err += _sq([a - m for a, m in zip(avg, mean)])
            for b, a, m in zip(bias, avg, mean):
                b += (a - m).double()
        out[label] = err / draws / norm
        # the mean of the draws' errors: noise/draws plus the bias of clipping at c·σ, which draws do not remove
        out[label + "_bias"] = _sq([b / draws for b in bias]) / norm
    out["ratio"] = out["node"] / out["flat"]
    out["grad_sq"] = norm
    return out


def batch_noise(model, xtr, ytr, batches: int, seed: int, step: int) -> float:
    """E||g_b - ḡ||² over ``batches`` global batches of 64 (fp32, one worker; absolute)."""
    per = []
    for b in range(batches):
        idx = batch_indices(seed + 7919, step * batches + b, len(xtr), BATCH)
        model.zero_grad()
        F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        per.append([p.grad.detach().clone() for p in model.parameters()])
    mean = [torch.stack([g[i] for g in per]).mean(0) for i in range(len(per[0]))]
    return sum(_sq([a - m for a, m in zip(g, mean)]) for g in per) / batches


def run(workers, ranks_per_node: int, draws: int, points, batches: int, seed: int) -> list[dict]:
    from horovod_terngrad.operations.datasets import load_mnist
    xtr, ytr = load_mnist()["train"]
    torch.manual_seed(seed)
    model = LeNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    config = TernGradConfig(seed=seed, min_numel=0, exchange="allgather")
    rows, done = [], 0
    for point in points:
        for step in range(done, point):              # fp32 training up to this point
            idx = batch_indices(seed, step, len(xtr), BATCH)
            opt.zero_grad()
            F.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
        done = point
        idx = batch_indices(seed, point, len(xtr), BATCH)
        sgd = batch_noise(model, xtr, ytr, batches, seed, point)
        for n in workers:
            t0 = time.perf_counter()
            got = noise(model, xtr[idx], ytr[idx], n, ranks_per_node, draws, config)
            # the ternary noise beside SGD's own: E||t - g||² / E||g_b - ḡ||² (both absolute)
            vs_sgd = {k + "_vs_minibatch": got[k] * got["grad_sq"] / sgd for k in ("flat", "node")}
            rows.append({"iteration": point, "workers": n, "ranks_per_node": ranks_per_node, "draws": draws,
                         "minibatch_noise": sgd, **got, **vs_sgd, "seconds": time.perf_counter() - t0})
            print(f"it {point:5d} N={n:3d} G={ranks_per_node}: ternary noise flat {got['flat']:.3f}, node-aware "
                  f"{got['node']:.3f} (x{got['ratio']:.2f}); of the mini-batch noise: {vs_sgd['flat_vs_minibatch']:.3f}"
                  f" / {vs_sgd['node_vs_minibatch']:.3f}", flush=True)
    return rows


def markdown(rows) -> str:
    lines = ["LeNet / MNIST, global batch 64, every tensor ternarized (per-rank scalers); relative noise "
             "E||t - g||² / ||g||² of TernGrad's average t around the fp32 average g of the same worker "
             f"gradients ({rows[0]['draws']} draws each); beside it, E||t - g||² as a fraction of fp32 SGD's own "
             "mini-batch noise E||g_b - ḡ||² (batches of 64 around their mean), and the squared mean error of the "
             "draws (noise/draws plus the bias of clipping at c·σ).", "",
             "| iteration | workers N | nodes x G | flat TernGrad | node-aware TernGrad | node-aware / flat | "
             "of the mini-batch noise (flat / node-aware) | mean error² (flat / node-aware) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["ranks_per_node"]
        lines.append(f"| {r['iteration']} | {r['workers']} | {r['workers'] // g} x {g} | {r['flat']:.3f} | "
                     f"{r['node']:.3f} | {r['ratio']:.2f}x | {r['flat_vs_minibatch']:.3f} / {r['node_vs_minibatch']:.3f} | "
                     f"{r['flat_bias']:.4f} / {r['node_bias']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="8,16", help="comma list of N (multiples of --ranks-per-node)")
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--draws", type=int, default=40, help="TernGrad averages per configuration and point")
    p.add_argument("--points", default="0,300,1500", help="fp32 training iterations at which to measure")
    p.add_argument("--batches", type=int, default=20, help="batches for the mini-batch noise")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="", help="write node_variance.{json,md} here")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    workers = [int(w) for w in a.workers.split(",")]
    if any(n % a.ranks_per_node or n // a.ranks_per_node < 2 for n in workers):
        p.error(f"every N must be a multiple of --ranks-per-node {a.ranks_per_node} with at least 2 nodes")
    rows = run(workers, a.ranks_per_node, a.draws, [int(x) for x in a.points.split(",")], a.batches, a.seed)
    text = markdown(rows)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "node_variance.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(a.out, "node_variance.md"), "w") as f:
            f.write(text)
    return rows


if __name__ == "__main__":
    main()
