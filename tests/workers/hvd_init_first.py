"""The pattern of Horovod's own examples (pytorch_synthetic_benchmark.py): ``hvd.init()`` first, and TernGrad
imported afterwards, where the compression line stands; every setting at its default.

    python hvd_init_first.py OUTDIR CONFIG        CONFIG: "defaults" or "flat" (hierarchical=False)

Saves OUTDIR/<CONFIG>.rank<R>.pt: what it recorded, the engine, the stats, the parameters.
"""
import os
import sys

import torch

import horovod.torch as hvd

hvd.init()
assert "horovod_terngrad" not in sys.modules, "the point of this worker: TernGrad imported after hvd.init()"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hvd_scenarios import Recording  # noqa: E402  (imports horovod_terngrad: after hvd.init())

from horovod_terngrad import TernGradConfig  # noqa: E402
from horovod_terngrad.exchange.hierarchical import HierarchicalEngine  # noqa: E402
from horovod_terngrad.exchange.world_groups import WorldGroupCollectives  # noqa: E402

WIDTH, DEPTH, STEPS = 512, 4, 3     # 4 x 262,144 weights (ternarized at the defaults) and 4 biases (fp32)


def main():
    outdir, config = sys.argv[1], sys.argv[2]
    # (the tests' Recording ternarizes every tensor unless told: here the library's own defaults, all of them)
    defaults = {f: getattr(TernGradConfig(), f) for f in TernGradConfig.__dataclass_fields__}
    comp = Recording(**defaults) if config == "defaults" else Recording(**dict(defaults, hierarchical=False))
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), compression=comp,
                                   named_parameters=model.named_parameters())
    # (no broadcast_parameters: every rank starts from the same seed, and the 4 MB broadcast from rank 0 would
    # dwarf, on h0's link, the step traffic the test compares)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        x = torch.randn(16, WIDTH, generator=gen)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    eng = comp.engine()
    hier = isinstance(eng, HierarchicalEngine)
    res = {"size": hvd.size(), "config": comp.config, "inputs": comp.inputs, "outputs": comp.outputs,
           "hierarchical": hier, "world_groups": hier and isinstance(eng.local, WorldGroupCollectives),
           "nodes": [list(n) for n in eng.topology.nodes] if hier else None, "losses": losses,
           "stats": vars(comp.stats).copy(), "groups": [list(g) for f in comp.state.fusions.values() for g in f.plan.fused],
           "names": [n for f in comp.state.fusions.values() for g in f.plan.fused for n in g], "params": [p.detach().clone() for p in model.parameters()]}
    torch.save(res, os.path.join(outdir, f"{config}.rank{hvd.rank()}.pt"))
    hvd.shutdown()


if __name__ == "__main__":
    main()
