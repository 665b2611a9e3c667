"""Elastic training with TernGrad, run by tests/test_elastic.py under horovodrun's elastic mode.

    python hvd_elastic.py OUTDIR HOSTSFILE SCENARIO COMPRESSION

The discovery script prints HOSTSFILE.  SCENARIO "grow": one worker at first; after 3 steps it writes two
slots into HOSTSFILE and the job grows to 2 workers.  "shrink": two workers on two host names; after 5
steps the second one dies (os._exit), Horovod blacklists its host name, and the first finishes alone.  Every worker logs each step's world
size and saves its final parameters.
"""
import json
import os
import sys
import time

import torch

import horovod.torch as hvd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
from horovod_terngrad import TernGrad  # noqa: E402
from hvd_scenarios import mlp  # noqa: E402

OUTDIR, HOSTS, SCENARIO, COMPRESSION = sys.argv[1:5]
TOTAL = 16

hvd.init()
torch.set_num_threads(1)
model = mlp()
# every tensor of the small test model ternarized (the default keeps tensors under 4096 elements in fp32)
comp = TernGrad.configure(min_numel=0) if COMPRESSION == "terngrad" else hvd.Compression.none
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters(), compression=comp)
state = hvd.elastic.TorchState(model, opt, batch=0)
log = []


@hvd.elastic.run
def train(state):
    while state.batch < TOTAL:
        gen = torch.Generator().manual_seed(1000 * state.batch + hvd.rank())
        opt.zero_grad()
        model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
        state.batch += 1
        log.append({"batch": state.batch, "size": hvd.size(), "rank": hvd.rank()})
        print(f"step {state.batch} size {hvd.size()} rank {hvd.rank()}", flush=True)
        if SCENARIO == "grow" and state.batch == 3 and hvd.rank() == 0:
            with open(HOSTS, "w") as f:
                f.write("localhost:2\n")
        if SCENARIO == "shrink" and state.batch == 5 and hvd.rank() == 1:
            os._exit(1)                          # a worker dies mid-run (its host is then blacklisted)
        state.commit()
        time.sleep(0.3)                          # leave the driver time to notice host changes


train(state)
tag = f"{os.getpid()}"
with open(os.path.join(OUTDIR, f"worker.{tag}.json"), "w") as f:
    json.dump({"log": log, "rank": hvd.rank(), "size": hvd.size(),
               "params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
               "stats": vars(comp.stats).copy() if COMPRESSION == "terngrad" else None}, f)
