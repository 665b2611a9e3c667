"""Bits per gradient element the busiest rank receives, per TernGrad exchange, on a real model's tensor shapes:
measured on thread ranks (the real engine, ``ExchangeStats.bytes_received``, max over ranks) up to ``--measure-to``
ranks, and from the cost model (exchange/cost.py, whose sizes are codec/sizes.py's, the engine's own) at every N.

    python examples/exchange_bits.py --model gpt2 --workers 2,4,8,16,64,512 --measure-to 16 \\
        --out docs/study/lm_scale/bits.md

The tensors are those the default policy ternarizes (``min_numel``), each its own group (fusion changes headers
only).  Requantized: with the noise channel (what horovod_terngrad.optim.AdamW asks for) and without (SGD).
``reternarized@b128``: the re-ternarized exchange with one scaler per 128 elements in both stages (bucket_size=128).
``owner-step``: ``horovod_terngrad.optim.OwnerStepOptimizer`` in its default base-3 packing (both stages, with the
squares AdamW's noise estimate needs), measured by its exchange's counter after one step, modelled from
codec/sizes.py (its own sizes).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

OWNER_STEP = "owner-step (OwnerStepOptimizer, base-3)"
EXCHANGES = ("allgather", "sharded", "reternarized", "reternarized@b128", "requantized",
             "requantized (SGD: no noise channel)", OWNER_STEP)


def exchange_spec(label: str) -> tuple[str, int]:
    """(exchange, bucket_size) of a label "name[@bK][ (comment)]": "reternarized@b128" is the re-ternarized
    exchange with bucket_size=128 (one scaler per 128 elements); without @bK, bucket_size 0.  Also
    examples/study_lm_scale.py's --exchanges."""
    name, _, bucket = label.split(" ")[0].partition("@b")
    return name, int(bucket or 0)


def shapes(model_name: str) -> list:
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.operations import models
    model, _ = models.make(model_name, batch=1)
    cfg = TernGradConfig()
    return [tuple(p.shape) for n, p in model.named_parameters() if cfg.compresses(n, p.numel())]


def owner_step_received(numels: list, N: int) -> int:
    """The busiest rank's bytes received in one owner-step step (codec/sizes.py)."""
    from horovod_terngrad.codec import sizes
    per_rank = []
    for r in range(N):
        total = 0
        for n in numels:
            grad = sizes.reternarized_chunk_bytes(n, N, "base3", 0, True)
            weights = sizes.owner_step_weight_chunk_bytes(n, N, "base3")
            total += (N - 1) * grad[r] + sum(weights) - weights[r]
        per_rank.append(total)
    return max(per_rank)


def measured_owner_step(shape_list: list, N: int) -> float:
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.exchange import run_ranks
    from horovod_terngrad.optim import OwnerStepOptimizer

    def body(c):
        torch.set_num_threads(1)
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shape_list]
        opt = OwnerStepOptimizer([(f"t{i}", p) for i, p in enumerate(params)], collectives=c,
                                 config=TernGradConfig(packing="base3"), lr=1e-3)
        g = torch.Generator().manual_seed(1 + c.rank)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        return opt.exchange.bytes_received

    got = run_ranks(N, body, timeout=900)
    return 8 * max(got) / sum(int(torch.Size(s).numel()) for s in shape_list)


def modelled(numels: list, N: int, exchange: str) -> float:
    if exchange == OWNER_STEP:
        return 8 * owner_step_received(numels, N) / sum(numels)
    from horovod_terngrad.exchange import cost
    net = cost.Network.from_gbps("any", 1.0, 50.0)
    if exchange == "allgather":
        c = [cost.terngrad_allgather_cost(n, N, net, shared_scaler=False) for n in numels]
    elif exchange == "sharded":
        c = [cost.terngrad_sharded_cost(n, N, net) for n in numels]
    elif exchange_spec(exchange)[0] == "reternarized":
        bucket = exchange_spec(exchange)[1]
        c = [cost.terngrad_reternarized_cost(n, N, net, bucket_size=bucket) for n in numels]
    else:
        c = [cost.terngrad_requantized_cost(n, N, net, noise="no noise" not in exchange) for n in numels]
    return 8 * sum(x.bytes_received for x in c) / sum(numels)


def measured(shape_list: list, N: int, exchange: str) -> float:
    if exchange == OWNER_STEP:
        return measured_owner_step(shape_list, N)
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.exchange import Engine, run_ranks
    name, bucket = exchange_spec(exchange)
    cfg = TernGradConfig(exchange=name, fusion_numel=0, bucket_size=bucket)
    noise = "no noise" not in exchange

    def body(c):
        torch.set_num_threads(1)
        ex = Engine(c, cfg)
        gen = torch.Generator().manual_seed(c.rank)
        tickets = []
        for i, s in enumerate(shape_list):
            tickets.append(ex.start(torch.randn(s, generator=gen), f"t{i}"))
            tickets[-1].want_noise = noise
        for tk in tickets:
            ex.finish(tk)
        return ex.stats.bytes_received

    got = run_ranks(N, body, timeout=600)
    return 8 * max(got) / sum(int(torch.Size(s).numel()) for s in shape_list)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--workers", default="2,4,8,16,32,64,128,512")
    ap.add_argument("--measure-to", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    shape_list = shapes(args.model)
    numels = [int(torch.Size(s).numel()) for s in shape_list]
    Ns = [int(x) for x in args.workers.split(",")]
    lines = [f"Bits per element received by the busiest rank, {args.model}'s {len(numels)} ternarized tensors "
             f"({sum(numels) / 1e6:.1f}M elements), 2-bit packing (owner-step: base-3); measured (thread ranks, "
             f"the exchanges' counters) / modelled (exchange/cost.py; owner-step: codec/sizes.py)", "",
             "| exchange | " + " | ".join(f"N={N}" for N in Ns) + " |", "|---" * (len(Ns) + 1) + "|"]
    for ex in EXCHANGES:
        cells = []
        for N in Ns:
            m = modelled(numels, N, ex)
            if N <= args.measure_to:
                cells.append(f"{measured(shape_list, N, ex):.2f} / {m:.2f}")
            else:
                cells.append(f"- / {m:.2f}")
        lines.append(f"| {ex} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
