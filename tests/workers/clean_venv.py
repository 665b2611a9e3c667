"""Runs under ``torchrun --standalone --nproc_per_node 2`` inside the clean virtual environment of
tests/test_packaging.py (torch and the installed package, no Horovod): the DDP communication hook and the FSDP2
frontend, each training a few steps with ``horovod_terngrad.optim.AdamW``.  Every rank writes
OUTDIR/rank<R>.json.

    python -m torch.distributed.run --standalone --nproc_per_node 2 clean_venv.py OUTDIR

Nothing here puts the checkout on sys.path: the package must come from the environment's site-packages.
"""
import datetime
import importlib.util
import json
import math
import os
import sys
import traceback
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn

import horovod_terngrad
from horovod_terngrad.optim import AdamW

STEPS = 5
MIN_NUMEL = 1024      # the two large weights are ternarized; biases and the head travel in fp32


def make_model():
    torch.manual_seed(0)      # the same initial parameters on every rank
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)     # each rank its own data
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def checksum(params):
    """crc32 of every parameter's full value (a DTensor is gathered first)."""
    code = 0
    for p in params:
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        code = zlib.crc32(t.detach().contiguous().numpy().tobytes(), code)
    return code


def ternary_steps(opt):
    """Per parameter the optimizer holds, how many steps it took on TernGrad's path (a ternary gradient)."""
    return sorted(int(st.get("ternary_steps", torch.zeros(())).item()) for st in opt.state.values())


def run_ddp(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from horovod_terngrad import ddp as tg_ddp
    model = make_model()
    ddp = DDP(model)
    state = tg_ddp.register(ddp, min_numel=MIN_NUMEL)
    return train(rank, ddp, model, state)


def run_fsdp(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from horovod_terngrad import fsdp as tg_fsdp
    # two replicas of one shard each: FSDP2 shards nothing, TernGrad averages between the replicas
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = tg_fsdp.register(model, mesh, min_numel=MIN_NUMEL)
    return train(rank, model, model, state)


def train(rank, forward, model, state) -> dict:
    """STEPS steps of horovod_terngrad.optim.AdamW through ``forward`` (the wrapped model), and what the test checks:
    the losses, a checksum of ``model``'s parameters, the frontend ``state``'s counters, the ternary steps."""
    opt = AdamW(forward.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "checksum": checksum(model.parameters()), "tensors": state.stats.tensors,
            "bits_per_element": state.stats.bits_per_element(), "adam_ternary_steps": ternary_steps(opt)}


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    res = {"rank": rank, "size": dist.get_world_size(), "package_file": horovod_terngrad.__file__,
           "prefix": sys.prefix, "horovod_found": importlib.util.find_spec("horovod") is not None}
    for name, run in (("ddp", run_ddp), ("fsdp", run_fsdp)):
        try:
            res[name] = run(rank)
            res[name]["finite"] = all(math.isfinite(v) for v in res[name]["losses"])
        except Exception:  # noqa: BLE001 - a crash is a result the test reports
            res[name] = {"crash": traceback.format_exc()}
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
