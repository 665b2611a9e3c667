"""The node-aware exchange in the DDP hook, under torchrun (launched by tests/test_hierarchical_ranks.py).

    python ddp_hier.py OUTDIR HOSTS

HOSTS: "-" keeps the real host names, else one node name per global rank (HOROVOD_TERNGRAD_HOST, set from
the rank).  Every rank records, per fused group and step, what it handed the engine and what it got back
(the engine's own start_group/finish, wrapped), and saves OUTDIR/ddp_hier.rank<R>.pt.
"""
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from helpers import mlp  # noqa: E402
from horovod_terngrad.exchange.hierarchical import HierarchicalEngine  # noqa: E402
from horovod_terngrad.frontends import ddp as tg_ddp  # noqa: E402

RECORD = {"groups": [], "inputs": [], "outputs": []}
_start, _finish = HierarchicalEngine.start_group, HierarchicalEngine.finish


def start_group(self, items, group, average=True, in_place=False, routes=None):
    RECORD["groups"].append([n for _, n in items])
    RECORD["inputs"] += [(n, t.detach().clone()) for t, n in items]
    return _start(self, items, group, average, in_place, routes=routes)


def finish(self, tk):
    out = _finish(self, tk)
    RECORD["outputs"].append((tk.name, out.detach().clone()))
    return out


HierarchicalEngine.start_group, HierarchicalEngine.finish = start_group, finish


def main():
    outdir, hosts = sys.argv[1], sys.argv[2]
    intra = sys.argv[3] if len(sys.argv) > 3 else "float32"        # intra_node_dtype
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if hosts != "-":
        os.environ["HOROVOD_TERNGRAD_HOST"] = hosts.split(",")[rank]
    torch.set_num_threads(1)
    res = {"size": dist.get_world_size()}
    try:
        model = DDP(mlp(width=48), bucket_cap_mb=0.004)       # several buckets
        state = tg_ddp.register(model, min_numel=0, hierarchical=True, intra_node_dtype=intra)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
            opt.step()
        eng = state.engine
        res.update(RECORD, config=state.config, hierarchical=isinstance(eng, HierarchicalEngine),
                   nodes=[list(n) for n in eng.topology.nodes] if isinstance(eng, HierarchicalEngine) else None,
                   params=[p.detach().clone() for p in model.parameters()], stats=vars(state.stats).copy())
    except Exception:  # noqa: BLE001
        res["crash"] = traceback.format_exc()
    torch.save(res, os.path.join(outdir, f"ddp_hier.rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
