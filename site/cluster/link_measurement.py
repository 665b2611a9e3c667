"""One short Horovod job (one rank per process, mpirun on the emulated cluster of link_measurement.sh): an MLP of
4 layers 1024 x 1024 (4.2M parameters in 8 tensors) trained a few steps with TernGrad at its defaults
(hierarchical="auto", no HOROVOD_TERNGRAD_GBPS: the links are measured by the plan step, before the first exchange).  Rank 0 prints one
JSON line: the links as measured and as priced, the plan of each fused group of the step, and the bytes through
its host's eth0 per step after the first (the step that measures).  Works on a tree without link.measure_links
too (the figures then are the network it priced, unsnapped)."""
import json
import os
import sys
import time

import horovod.torch as hvd
import torch

from horovod_terngrad import TernGrad
from horovod_terngrad.exchange import link
from horovod_terngrad.exchange.hierarchical import HierarchicalEngine
from horovod_terngrad.operations.models import mlp

STEPS = int(os.environ.get("LINK_STEPS", "4"))
hvd.init()
torch.manual_seed(0)
model = mlp(4, 1024)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), named_parameters=model.named_parameters(),
                               compression=TernGrad)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

measured, groups = [], []
if hasattr(link, "measure_links"):
    real = link.measure_links

    def recorded(*a, **k):
        t0 = time.perf_counter()
        got = real(*a, **k)
        measured.append((got, time.perf_counter() - t0))
        return got
    link.measure_links = recorded
started = HierarchicalEngine.start_group


def start_group(self, items, group, *a, **k):
    groups.append([t.numel() for t, _ in items])
    return started(self, items, group, *a, **k)


HierarchicalEngine.start_group = start_group


def counters():
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f, open("/sys/class/net/eth0/statistics/rx_bytes") as g:
        return int(f.read()), int(g.read())


x = torch.randn(8, 1024)
step_s, c0 = [], None
for step in range(STEPS):
    if step == 1:
        hvd.allreduce(torch.zeros(1), name="barrier")
        c0 = counters()
    t0 = time.perf_counter()
    opt.zero_grad()
    model(x + hvd.rank()).square().mean().backward()
    opt.step()
    step_s.append(time.perf_counter() - t0)
    if step == 0:
        first_groups = list(groups)
hvd.allreduce(torch.zeros(1), name="barrier")
c1 = counters()
if hvd.rank() == 0:
    eng = TernGrad.engine()
    net = eng.plan.network if isinstance(eng, HierarchicalEngine) else None
    plan = [eng.plan.group(g).hierarchical for g in first_groups] if net is not None else []
    row = dict(
        ranks=hvd.size(), params=sum(p.numel() for p in model.parameters()),
        priced_across_gbps=8 * net.bandwidth_Bps / 1e9 if net else None,
        priced_inside_gbps=8 * net.intra_node.bandwidth_Bps / 1e9 if net and net.intra_node else None,
        network_name=net.name if net else None,
        group_numels=[sum(g) for g in first_groups], group_node_aware=plan,
        plan=("node-aware" if plan and all(plan) else "flat" if not any(plan) else "mixed"),
        node_aware_fraction=(sum(sum(g) for g, p in zip(first_groups, plan) if p)
                             / max(1, sum(map(sum, first_groups)))),
        host0_eth0_tx_MB_per_step=(c1[0] - c0[0]) / (STEPS - 1) / 1e6,
        host0_eth0_rx_MB_per_step=(c1[1] - c0[1]) / (STEPS - 1) / 1e6,
        step_s=step_s, loadavg=open("/proc/loadavg").read().split()[:3])
    if measured and measured[0][0] is not None:
        m, t = measured[0]
        row.update(measured_across_gbps=8 * m.across_Bps / 1e9, measured_inside_gbps=8 * m.inside_Bps / 1e9,
                   probe_s=t, probe_times_ms=[[round(1e3 * x, 2) for x in r] for r in m.times])
    else:
        row.update(measured_across_gbps=row["priced_across_gbps"], measured_inside_gbps=row["priced_inside_gbps"])
    print("LINKROW " + json.dumps(row), flush=True)
    sys.stdout.flush()
