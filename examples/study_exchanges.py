"""LeNet / MNIST in the simulator (exact codec and exchange of a real run) with each TernGrad exchange at N
simulated workers: the accuracy the re-ternarized exchange's second rounding costs, beside the allgather and
sharded exchanges and fp32, and the bits per element each moves.

    python examples/study_exchanges.py --iterations 2000 --workers 8,64 --out docs/study/exchanges

Setup of examples/study_lenet.py (the paper's Fig. 3: total batch 64, momentum SGD, lr 0.01 with polynomial
decay); one seed per cell unless --seeds.  Writes <out>/exchanges.json and <out>/exchanges.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist_lenet import LeNet  # noqa: E402
from study_lenet import train  # noqa: E402

from horovod_terngrad.codec import sizes  # noqa: E402
from horovod_terngrad.operations.datasets import load_mnist  # noqa: E402


def wire_bits(exchange: str, n: int, N: int) -> float:
    """Bits per element one rank receives for an n-element tensor (codec/sizes.py)."""
    if exchange == "allgather":
        return 8 * (N - 1) * sizes.payload_size(n, "2bit") / n
    if exchange == "sharded":
        codes, sums = sizes.shard_code_bytes(n, N, "2bit"), sizes.shard_sum_bytes(n, N)
        return 8 * ((N - 1) * codes[0] + sum(sums) - sums[0]) / n
    chunk = sizes.reternarized_chunk_bytes(n, N, "2bit")
    return 8 * 2 * (N - 1) * chunk[0] / n


def table(results: list, iterations: int) -> str:
    base = {r["seed"]: r["test_acc"] for r in results if r["compression"] == "none"}
    lines = [f"LeNet / MNIST, {iterations} iterations, total batch 64, momentum SGD (paper Fig. 3 setup), simulated "
             "workers; accuracy on the 10k test set (mean over seeds; gap to fp32 per seed, paired).", "",
             "| workers N | exchange | seeds | TernGrad | fp32 | gap (points) | bits/element received, ternarized weights |",
             "|---|---|---|---|---|---|---|"]
    cells: dict = {}
    for r in results:
        if r["compression"] == "terngrad":
            cells.setdefault((r["workers"], r["exchange"]), []).append(r)
    for (N, ex), rs in sorted(cells.items()):
        acc = statistics.mean(r["test_acc"] for r in rs)
        gaps = [100 * (r["test_acc"] - base[r["seed"]]) for r in rs if r["seed"] in base]
        b = statistics.mean(base[r["seed"]] for r in rs if r["seed"] in base) if gaps else float("nan")
        numels = [p.numel() for p in LeNet().parameters() if p.numel() >= 4096]     # min_numel's default
        bits = sum(wire_bits(ex, n, N) * n for n in numels) / sum(numels)
        lines.append(f"| {N} | {ex} | {len(rs)} | {100 * acc:.2f}% | {100 * b:.2f}% | "
                     f"{statistics.mean(gaps):+.2f} | {bits:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=2000)
    p.add_argument("--workers", default="8,64")
    p.add_argument("--exchanges", default="allgather,sharded,reternarized")
    p.add_argument("--seeds", default="1")
    p.add_argument("--out", default="docs/study/exchanges")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    data = load_mnist()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "exchanges.json")
    results = json.load(open(path)) if os.path.exists(path) else []
    done = {(r["workers"], r["exchange"], r["seed"], r["compression"]) for r in results}
    for seed in (int(s) for s in a.seeds.split(",")):
        if (1, "allgather", seed, "none") not in done:
            r = train(data, 1, "none", "momentum", a.iterations, seed)
            results.append(dict(r, seed=seed))
            print(f"seed {seed} fp32: {100 * r['test_acc']:.2f}%", flush=True)
        for N in (int(v) for v in a.workers.split(",")):
            for ex in a.exchanges.split(","):
                if (N, ex, seed, "terngrad") in done:
                    continue
                r = train(data, N, "terngrad", "momentum", a.iterations, seed, exchange=ex)
                results.append(dict(r, seed=seed))
                print(f"seed {seed} N={N} {ex}: {100 * r['test_acc']:.2f}% ({r['seconds']:.0f} s)", flush=True)
                with open(path, "w") as f:
                    json.dump(results, f, indent=1)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    md = table(results, a.iterations)
    with open(os.path.join(a.out, "exchanges.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
