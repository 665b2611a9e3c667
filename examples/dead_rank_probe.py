"""How a job ends when a rank dies: which error the survivors raise, and when.

    horovodrun --gloo -np 4 -H localhost:4 python examples/dead_rank_probe.py --compression terngrad \
        --nodes h0,h0,h1,h1 --die-at 20 --out /tmp/probe

One rank (``--victim``, default the last) calls ``os._exit`` in the backward pass of step ``--die-at``, after
its gradients went out.  Every survivor writes ``OUT.rank<R>.json``: the exception's class chain, and the
seconds from the victim's death (the step's start, on a shared clock: time.time()) to the exception.  With
``--nodes`` the ranks report those host names to TernGrad (HOROVOD_TERNGRAD_HOST: emulated nodes, so the
node-aware exchange runs on one machine).  ``--compression``: terngrad (defaults), terngrad-flat
(hierarchical=False), terngrad-requantized (exchange="requantized", the default beyond 4
ranks or nodes), none (Horovod's Compression.none).
"""
import argparse
import json
import os
import time

import torch

import horovod.torch as hvd


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compression", choices=["terngrad", "terngrad-flat", "terngrad-requantized", "none"], default="terngrad")
    ap.add_argument("--nodes", default="", help="comma list of a host name per rank (emulated nodes)")
    ap.add_argument("--die-at", type=int, default=20)
    ap.add_argument("--victim", type=int, default=-1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hvd.init()
    if args.nodes:
        os.environ["HOROVOD_TERNGRAD_HOST"] = args.nodes.split(",")[hvd.rank()]
    from horovod_terngrad import TernGrad
    comp = {"terngrad": TernGrad, "terngrad-flat": TernGrad.configure(hierarchical=False),
            "terngrad-requantized": TernGrad.configure(exchange="requantized"),
            "none": hvd.Compression.none}[args.compression]
    victim = args.victim % hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), compression=comp,
                                   named_parameters=model.named_parameters())
    gen = torch.Generator().manual_seed(hvd.rank())
    died_at = None
    try:
        for step in range(args.steps):
            opt.zero_grad()
            x = torch.randn(32, 256, generator=gen)
            model(x).pow(2).mean().backward()
            if step == args.die_at:
                died_at = time.time()
                if hvd.rank() == victim:
                    os._exit(3)
            opt.step()
        record = {"error": None}
    except Exception as e:  # noqa: BLE001 - what a survivor sees is the result
        record = {"error": [c.__name__ for c in type(e).__mro__], "message": str(e)[:300],
                  "seconds_after_death": time.time() - died_at if died_at else None}
    record.update(rank=hvd.rank(), compression=args.compression,
                  node_aware=type(getattr(comp, "engine", lambda: None)()).__name__ if args.compression != "none" else None)
    with open(f"{args.out}.rank{hvd.rank()}.json", "w") as f:
        json.dump(record, f)
    os._exit(4 if record["error"] else 0)


if __name__ == "__main__":
    main()
