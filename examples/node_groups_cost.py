"""What the node-aware exchange's groups cost as world collectives against Horovod process sets, in one run.

    HOROVOD_DYNAMIC_PROCESS_SETS=1 OMP_NUM_THREADS=1 horovodrun --gloo -np 4 -H localhost:4 \
        python examples/node_groups_cost.py --nodes h0,h0,h1,h1 --model resnet50 --rounds 5

Every rank builds two node-aware engines over the same flat engine settings: one whose node and cross
groups are world alltoalls (exchange/world_groups.py, the default) and one on Horovod process sets; then
averages the model's gradients (its real parameter shapes, fused as the Horovod frontend fuses them) with
each in turn, ``--rounds`` rounds of ``--steps`` steps, so both see the same machine load.  Rank 0 prints
the median seconds per step of each, their ratio, and whether both gave the same bits (they must: the same
rank order, the same additions).  Only the exchange is timed (no forward/backward).
"""
import argparse
import os
import statistics
import time

import torch

import horovod.torch as hvd


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="", help="comma list of a host name per rank (emulated nodes)")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    hvd.init()
    if args.nodes:
        os.environ["HOROVOD_TERNGRAD_HOST"] = args.nodes.split(",")[hvd.rank()]
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.exchange import Engine, HorovodCollectives
    from horovod_terngrad.exchange.fusion import TensorSpec, cut
    from horovod_terngrad.exchange.hierarchical import HierarchicalEngine
    from horovod_terngrad.exchange.topology import discover
    from horovod_terngrad.exchange.world_groups import WorldGroupCollectives
    from horovod_terngrad.operations import models

    cfg = TernGradConfig(hierarchical=True)
    model = models.make(args.model, batch=1)[0]
    params = [(n, p) for n, p in model.named_parameters() if cfg.compresses(n, p.numel())]
    plan = cut([TensorSpec(n, p.numel(), "cpu") for n, p in reversed(params)], cfg)
    world = HorovodCollectives()
    topo = discover(world)
    me = hvd.rank()
    sets = {g: hvd.add_process_set(list(g)) for g in topo.local_groups() + topo.cross_groups()}
    engines = {
        "world": HierarchicalEngine(Engine(world, cfg, steps={}), WorldGroupCollectives(world, topo.local_ranks_of(me)),
                                      WorldGroupCollectives(world, topo.cross_ranks_of(me)), topo, end_of_step_sync=True),
        "process_sets": HierarchicalEngine(Engine(world, cfg, steps={}), HorovodCollectives(sets[topo.local_ranks_of(me)]),
                                             HorovodCollectives(sets[topo.cross_ranks_of(me)]), topo, end_of_step_sync=True),
    }
    shapes = dict((n, p.shape) for n, p in params)
    gen = torch.Generator().manual_seed(me)
    grads = {n: torch.randn(shapes[n], generator=gen) for n in shapes}
    times = {k: [] for k in engines}
    last = {}
    for rnd in range(args.rounds + 1):            # round 0: warm-up
        for key, eng in engines.items():
            hvd.allreduce(torch.zeros(1), name=f"ngc.barrier.{rnd}.{key}")
            t0 = time.perf_counter()
            for _ in range(args.steps):
                tickets = []
                for g, members in enumerate(plan.fused):
                    tickets += eng.start_group([(grads[n].clone(), n) for n in members], f"{key}.g{g}.{members[0]}")
                last[key] = [eng.finish(t) for t in tickets]
            if rnd:
                times[key].append((time.perf_counter() - t0) / args.steps)
    same = all(torch.equal(a, b) for a, b in zip(last["world"], last["process_sets"]))
    if me == 0:
        w, p = statistics.median(times["world"]), statistics.median(times["process_sets"])
        print(f"{args.model}: {len(params)} ternarized tensors in {len(plan.fused)} fused groups, {topo.describe()}")
        print(f"  world collectives: {1000 * w:7.1f} ms/step (rounds {[round(1000 * t, 1) for t in times['world']]})")
        print(f"  process sets:      {1000 * p:7.1f} ms/step (rounds {[round(1000 * t, 1) for t in times['process_sets']]})")
        print(f"  world / process sets: {w / p:.3f}; same bits: {same}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
