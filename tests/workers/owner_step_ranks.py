"""OwnerStepOptimizer on real ranks (launched by tests/test_owner_step_ranks.py).

    torchrun --nproc_per_node 3 owner_step_ranks.py OUTDIR torch SCENARIO [SCENARIO ...]
    horovodrun -np 3 ... owner_step_ranks.py OUTDIR horovod SCENARIO [...]

A small MLP (two weights that TernGrad ternarizes, a LayerNorm and biases at full precision), each rank its own
data, ``OwnerStepOptimizer`` over ``optim.AdamW`` with a global clip and a cosine schedule.  Saves
OUTDIR/<scenario>.rank<r>.pt.

torch:   train (the model wrapped in DDP with local_gradients_hook: per step, a checksum of the parameters, equal
         on every rank; the bits received), resume (8 steps against 4 + state_dicts through torch.save into fresh
         objects + 4: bit for bit)
horovod: train (as torch's, without DDP, on Horovod's collectives)
both:    amp (fp16 autocast with torch.amp.GradScaler from 2**20, rank 1's loss times 2**20 at step AMP_SPIKE: per
         step the checksum, the scale after update() and the skipped steps, to be equal on every rank)
"""
import io
import math
import os
import sys
import traceback
import zlib

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from horovod_terngrad import TernGradConfig  # noqa: E402
from horovod_terngrad.optim import OwnerStepOptimizer  # noqa: E402

STEPS = 8
CFG = TernGradConfig(packing="base3", min_numel=1000, seed=11, levels=3)   # OwnerStepOptimizer's default code


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), nn.LayerNorm(96), nn.GELU(), nn.Linear(96, 48), nn.GELU(),
                         nn.Linear(48, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def checksum(model) -> int:
    return zlib.crc32(b"".join(p.detach().contiguous().numpy().tobytes() for p in model.parameters()))


def build(model, collectives):
    opt = OwnerStepOptimizer(model.named_parameters(), collectives=collectives, config=CFG, lr=3e-3,
                             betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / STEPS)))
    return opt, sched


def train(model, opt, sched, rank, steps, start=0, net=None):
    """``steps`` steps from ``start``, the forward pass through ``net`` (the model, or its DDP wrapper): the
    parameters' checksum after each."""
    net = net or model
    sums = []
    for step in range(start, start + steps):
        x, y = batch(rank, step)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        sums.append(checksum(model))
    return sums


def scenario_train(rank, collectives, wrap=None):
    model = make_model()
    net = wrap(model) if wrap else model
    opt, sched = build(model, collectives)
    sums = train(model, opt, sched, rank, STEPS, net=net)
    return {"sums": sums, "bits": opt.bits_received(), "norm": opt.last_grad_norm,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


AMP_SPIKE = 5       # a step at which rank 1 alone overflows


def scenario_amp(rank, collectives, wrap=None):
    model = make_model()
    net = wrap(model) if wrap else model
    opt, sched = build(model, collectives)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=3)
    sums, scales = [], []
    for step in range(STEPS):
        x, y = batch(rank, step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(net(x).float(), y)
        if step == AMP_SPIKE and rank == 1:
            loss = loss * 2.0 ** 20
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()
        sums.append(checksum(model))
        scales.append(scaler.get_scale())
    return {"sums": sums, "scales": scales, "skipped": opt.skipped_steps,
            "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def scenario_resume(rank, collectives):
    model = make_model()
    opt, sched = build(model, collectives)
    whole = train(model, opt, sched, rank, STEPS)
    model = make_model()
    opt, sched = build(model, collectives)
    train(model, opt, sched, rank, STEPS // 2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model = make_model()
    opt, sched = build(model, collectives)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    sched.load_state_dict(saved["sched"])
    resumed = train(model, opt, sched, rank, STEPS // 2, start=STEPS // 2)
    return {"whole": whole, "resumed": resumed}


def run_torch(folder, scenarios):
    import torch.distributed as dist
    from horovod_terngrad.ddp import local_gradients_hook
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def wrap(model):
        ddp = nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(None, local_gradients_hook)
        return ddp
    for sc in scenarios:
        try:
            res = {"train": lambda: scenario_train(rank, "torch", wrap),
                   "resume": lambda: scenario_resume(rank, "torch"),
                   "amp": lambda: scenario_amp(rank, "torch", wrap)}[sc]()
        except Exception:  # noqa: BLE001 - saved for the test to show
            res = {"crash": traceback.format_exc()}
        res["size"] = dist.get_world_size()
        torch.save(res, os.path.join(folder, f"{sc}.rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_horovod(folder, scenarios):
    import horovod.torch as hvd
    hvd.init()
    rank = hvd.rank()
    for sc in scenarios:
        try:
            res = {"train": lambda: scenario_train(rank, "horovod"),
                   "amp": lambda: scenario_amp(rank, "horovod")}[sc]()
        except Exception:  # noqa: BLE001
            res = {"crash": traceback.format_exc()}
        res["size"] = hvd.size()
        torch.save(res, os.path.join(folder, f"{sc}.rank{rank}.pt"))
    hvd.allreduce(torch.zeros(1), name="done")


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore", "GradScaler is going to stop passing itself", FutureWarning)
    folder, kind, *names = sys.argv[1:]
    torch.set_num_threads(1)
    (run_torch if kind == "torch" else run_horovod)(folder, names)
