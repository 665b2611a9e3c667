"""horovod_terngrad.optim on real ranks (launched by tests/test_optim.py).

    torchrun --nproc_per_node 2 optim_scenarios.py OUTDIR ddp SCENARIO [SCENARIO ...]
    horovodrun -np 2 ... optim_scenarios.py OUTDIR horovod SCENARIO [...]
    torchrun --nproc_per_node 4 optim_scenarios.py OUTDIR fsdp SCENARIO [...]

Every scenario trains a small MLP (two weights of 5120 and 10240 elements that TernGrad ternarizes; biases, a
LayerNorm and a 256-element head below min_numel, which travel at full precision) with
``horovod_terngrad.optim.AdamW`` under a short refresh schedule (SCHEDULE: refreshes at optimizer steps 0, 1,
3, 5, 9, 13, ...), each rank its own data, and saves OUTDIR/<scenario>.rank<r>.pt with, per step and parameter:
what the exchange recorded, the optimizer's step and v_steps, and checks made on the spot (the averaged
gradient of a refresh equal to an fp32 allreduce of the ranks' gradients, computed on a copy of the model;
full-precision parameters equal to torch.optim.AdamW's update of the same gradients), and a checksum of the
final parameters.

ddp:     train (DDP + tg_ddp.register), nosync (two micro-batches, the first under no_sync), twice (two
         exchanges per step, accumulated in .grad), amp (GradScaler, an Inf in rank 0's loss at two steps, against
         torch AdamW without a hook in the same launch), resume (6 steps, against 3 + state_dicts into fresh
         objects + 3), plain (no hook: tg AdamW against torch AdamW, bit for bit)
horovod: train (DistributedOptimizer; synchronize(), clip, step under skip_synchronize()), bpps2
         (backward_passes_per_step=2), none (Compression.none: bit for bit torch AdamW)
fsdp:    train (a (2, 2) mesh: fully_shard per layer on mesh["shard"], tg_fsdp.register, DTensor parameters),
         resume (8 steps, against 4 + a DCP checkpoint of model, optimizer and TernGrad + 4)
"""
import copy
import os
import sys
import traceback
import zlib

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers import expected_average, minibatch_share_out  # noqa: E402

from horovod_terngrad import TernGradConfig  # noqa: E402
from horovod_terngrad import codec as C  # noqa: E402
from horovod_terngrad.exchange import precision  # noqa: E402
from horovod_terngrad.optim import AdamW, RefreshSchedule  # noqa: E402

SCHEDULE = RefreshSchedule(warmup=2, interval=2, per_phase=2, max_interval=4)
STEPS = 12
HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 160), nn.LayerNorm(160), nn.GELU(), nn.Linear(160, 64), nn.GELU(),
                         nn.Linear(64, 4))


def batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def loss_of(model, x, y):
    return nn.functional.cross_entropy(model(x), y)


def checksum(params) -> int:
    code = 0
    for p in params:
        p = p.to_local() if hasattr(p, "to_local") else p
        code = zlib.crc32(p.detach().contiguous().numpy().tobytes(), code)
    return code


def snapshot(opt, named):
    """Per parameter: (record, step, v_steps)."""
    out = {}
    for n, p in named:
        st = opt.state.get(p, {})
        ledger = precision.ledger_of(p)
        out[n] = (ledger and ledger.record_of(p), int(st["step"]) if "step" in st else 0,
                  int(st["v_steps"]) if "v_steps" in st else None)
    return out


class Shadow:
    """torch.optim.AdamW over copies of the parameters that travel at full precision (same groups, same
    hyperparameters): fed the same averaged gradients, it must land on the same bits."""

    def __init__(self, named, small):
        self.names = small
        self.copies = {n: p.detach().clone().requires_grad_(True) for n, p in named if n in small}
        self.opt = torch.optim.AdamW(list(self.copies.values()), **HP)

    def step(self, named):
        for n, p in named:
            if n in self.copies:
                self.copies[n].grad = p.grad.detach().clone()
        self.opt.step()

    def equal(self, named) -> bool:
        return all(torch.equal(self.copies[n], p.detach()) for n, p in named if n in self.copies)


# -- DDP ---------------------------------------------------------------------------------------------------------

def ddp_setup(model, hook=True, **settings):
    from horovod_terngrad import ddp as tg_ddp
    ddp = nn.parallel.DistributedDataParallel(model)
    state = tg_ddp.register(ddp, asynchronous=False, **settings) if hook else None
    return ddp, state


def exact_average(dist, ref, model, x, y):
    """fp32 allreduce of every rank's gradient of (x, y), computed on a copy of the model's current weights."""
    ref.load_state_dict(model.state_dict())
    ref.zero_grad()
    loss_of(ref, x, y).backward()
    out = []
    for p in ref.parameters():
        g = p.grad.detach().clone()
        dist.all_reduce(g)
        out.append(g / dist.get_world_size())
    return out


def ddp_train(dist, rank, micro="one"):
    model = make_model()
    ddp, state = ddp_setup(model)
    named = list(model.named_parameters())
    opt = AdamW(model.parameters(), refresh=SCHEDULE, **HP)
    small = {n for n, p in named if p.numel() < 4096}
    shadow = Shadow(named, small)
    ref = copy.deepcopy(model)
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        exact = None
        if micro == "one":
            x, y = batch(rank, step)
            exact = exact_average(dist, ref, model, x, y)
            loss_of(ddp, x, y).backward()
        elif micro == "nosync":
            with ddp.no_sync():
                loss_of(ddp, *batch(rank, step, 0)).backward()
            loss_of(ddp, *batch(rank, step, 1)).backward()
        else:                         # twice: two exchanges before one step
            loss_of(ddp, *batch(rank, step, 0)).backward()
            loss_of(ddp, *batch(rank, step, 1)).backward()
        before = snapshot(opt, named)
        refresh_exact = None
        if exact is not None:
            refresh_exact = {n: torch.equal(p.grad, e) for (n, p), e in zip(named, exact)}
        shadow.step(named)
        opt.step()
        steps.append({"before": before, "after": snapshot(opt, named), "refresh_exact": refresh_exact,
                      "shadow_equal": shadow.equal(named)})
    return {"steps": steps, "checksum": checksum(model.parameters()), "small": sorted(small)}


def expected_noise(grads, name, step, cfg):
    """(1/N^2)·Σ_r (s_r·t_r)^2 written out again from every rank's gradient (per-rank scalers, rank order), with
    the minibatch's share taken out by the senders' squares (codec/squares.py)."""
    _, ternary = expected_average(grads, name, step, cfg)
    acc, clipped = None, []
    for g, t in zip(grads, ternary):
        flat = g.detach().reshape(-1).float()
        st = C.tensor_stats(flat, cfg.bucket_size)
        thr = C.clip_threshold(st, cfg.clip_factor)
        s = C.local_scalers(st, thr)
        x = (t.float() * s) * (t.float() * s)
        acc = x if acc is None else acc + x
        clipped.append(torch.minimum(torch.maximum(flat, -thr), thr))
    nu = (acc / len(grads) ** 2).reshape(-1)
    return minibatch_share_out(nu, clipped, len(grads)).view_as(grads[0])


def ddp_corrected(dist, rank):
    """The default optimizer (v corrected by the exchange's noise estimate): the estimate handed over with every
    ternary average equals (1/N^2)·Σ_r (s_r·t_r)^2 recomputed from every rank's gradient, the average equals the
    reference, full-precision parameters are torch's AdamW, ranks identical."""
    model = make_model()
    ddp, state = ddp_setup(model)
    named = list(model.named_parameters())
    opt = AdamW(model.parameters(), **HP)
    small = {n for n, p in named if p.numel() < 4096}
    shadow = Shadow(named, small)
    ref = copy.deepcopy(model)
    cfg = TernGradConfig()
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, step)
        ref.load_state_dict(model.state_dict())
        ref.zero_grad()
        loss_of(ref, x, y).backward()
        per_rank = {}
        for n, p in ref.named_parameters():
            got = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
            dist.all_gather(got, p.grad.contiguous())
            per_rank[n] = got
        loss_of(ddp, x, y).backward()
        checks = {}
        for n, p in named:
            if n in small:
                checks[n] = opt.precision_ledger.noise_of(p) is None
                continue
            noise, at = opt.precision_ledger.noise_of(p)
            noise = noise.view(p.shape)
            avg, _ = expected_average(per_rank[n], n, step, cfg)
            checks[n] = (torch.equal(p.grad, avg) and torch.equal(noise, expected_noise(per_rank[n], n, step, cfg))
                         and torch.equal(at, torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()))
        shadow.step(named)
        opt.step()
        steps.append({"checks": checks, "shadow_equal": shadow.equal(named), "after": snapshot(opt, named)})
    noise_nonzero = {n: bool(opt.state[p]["exp_avg_noise"].abs().sum() > 0) for n, p in named}
    return {"steps": steps, "checksum": checksum(model.parameters()), "small": sorted(small),
            "noise_nonzero": noise_nonzero}


def ddp_amp(dist, rank):
    """GradScaler with an Inf in rank 0's loss at loop steps 3 and 7; tg (TernGrad + tg AdamW) beside the
    baseline (DDP's own allreduce + torch AdamW).  Both must skip the same steps on every rank."""
    out = {}
    for kind in ("baseline", "tg", "tgc"):        # tg: the refresh mode; tgc: the default (noise-corrected)
        model = make_model()
        ddp, _ = ddp_setup(model, hook=kind != "baseline")
        named = list(model.named_parameters())
        opt = (torch.optim.AdamW(model.parameters(), **HP) if kind == "baseline" else
               AdamW(model.parameters(), **HP, refresh=SCHEDULE if kind == "tg" else None))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        skipped, invariant = [], []
        for step in range(STEPS):
            opt.zero_grad()
            loss = loss_of(ddp, *batch(rank, step))
            if rank == 0 and step in (3, 7):
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < scale:
                skipped.append(step)
            if kind != "baseline":
                invariant.append(snapshot(opt, named))
        out[kind] = {"skipped": skipped, "snapshots": invariant, "checksum": checksum(model.parameters())}
    return out


def ddp_resume(dist, rank, folder, refresh=SCHEDULE):
    def run(model, opt, steps, start):
        ddp, state = ddp_setup(model)
        for step in range(start, start + steps):
            opt.zero_grad()
            loss_of(ddp, *batch(rank, step)).backward()
            opt.step()
        return ddp, state

    model = make_model()
    opt = AdamW(model.parameters(), refresh=refresh, **HP)
    run(model, opt, 6, 0)
    straight = checksum(model.parameters())

    model = make_model()
    opt = AdamW(model.parameters(), refresh=refresh, **HP)
    _, state = run(model, opt, 3, 0)
    path = os.path.join(folder, f"resume.ckpt.{refresh is None}.rank{rank}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "terngrad": state.state_dict()}, path)
    saved = torch.load(path, weights_only=True)          # what a user's torch.load gives back
    model = make_model(seed=123)                          # other weights: the checkpoint must bring them
    opt = AdamW(model.parameters(), **HP)                 # the default schedule: the checkpoint must bring it
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    ddp, state = ddp_setup(model)
    state.load_state_dict(saved["terngrad"])
    for step in range(3, 6):
        opt.zero_grad()
        loss_of(ddp, *batch(rank, step)).backward()
        opt.step()
    return {"straight": straight, "resumed": checksum(model.parameters()),
            "refresh": opt.param_groups[0]["refresh"]}


def ddp_plain(dist, rank):
    a, b = make_model(), make_model()
    da, db = nn.parallel.DistributedDataParallel(a), nn.parallel.DistributedDataParallel(b)
    oa, ob = torch.optim.AdamW(a.parameters(), **HP), AdamW(b.parameters(), **HP)
    for step in range(STEPS):
        for d, o in ((da, oa), (db, ob)):
            o.zero_grad()
            loss_of(d, *batch(rank, step)).backward()
            o.step()
    return {"equal": all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))}


def run_ddp(folder, scenarios):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for sc in scenarios:
        try:
            if sc == "train":
                res = ddp_train(dist, rank)
            elif sc in ("nosync", "twice"):
                res = ddp_train(dist, rank, micro=sc)
            elif sc == "amp":
                res = ddp_amp(dist, rank)
            elif sc == "resume":
                res = ddp_resume(dist, rank, folder)
            elif sc == "resume_corrected":
                res = ddp_resume(dist, rank, folder, refresh=None)
            elif sc == "corrected":
                res = ddp_corrected(dist, rank)
            elif sc == "plain":
                res = ddp_plain(dist, rank)
            else:
                raise ValueError(sc)
        except Exception:  # noqa: BLE001 - saved for the test to show
            res = {"crash": traceback.format_exc()}
        res["size"] = dist.get_world_size()
        torch.save(res, os.path.join(folder, f"{sc}.rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


# -- Horovod -----------------------------------------------------------------------------------------------------

def hvd_train(hvd, rank, bpps=1, compression=None, refresh=SCHEDULE):
    from horovod_terngrad import TernGrad
    model = make_model()
    named = list(model.named_parameters())
    comp = TernGrad.configure() if compression is None else compression
    opt = hvd.DistributedOptimizer(AdamW(model.parameters(), refresh=refresh, **HP),
                                   named_parameters=model.named_parameters(), compression=comp,
                                   backward_passes_per_step=bpps)
    twin = make_model()                                   # torch AdamW on the same gradients (Compression.none)
    twin_opt = hvd.DistributedOptimizer(torch.optim.AdamW(twin.parameters(), **HP),
                                        named_parameters=[("twin." + n, p) for n, p in twin.named_parameters()],
                                        compression=hvd.Compression.none) if compression is not None else None
    ref = copy.deepcopy(model)
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        exact = None
        if bpps == 1:
            x, y = batch(rank, step)
            ref.load_state_dict(model.state_dict())
            ref.zero_grad()
            loss_of(ref, x, y).backward()
            exact = [hvd.allreduce(p.grad.detach().clone(), name=f"exact.{i}", op=hvd.Average)
                     for i, p in enumerate(ref.parameters())]
            loss_of(model, x, y).backward()
        else:
            for m in range(bpps):
                loss_of(model, *batch(rank, step, m)).backward()
        opt.synchronize()                                  # the recipe of gradient clipping with Horovod
        refresh_exact = None
        if exact is not None:
            refresh_exact = {n: torch.equal(p.grad, e) for (n, p), e in zip(named, exact)}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = snapshot(opt, named)
        with opt.skip_synchronize():
            opt.step()
        if twin_opt is not None:
            twin_opt.zero_grad()
            loss_of(twin, *batch(rank, step)).backward()
            twin_opt.synchronize()
            torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
            with twin_opt.skip_synchronize():
                twin_opt.step()
        steps.append({"before": before, "after": snapshot(opt, named), "refresh_exact": refresh_exact})
    res = {"steps": steps, "checksum": checksum(model.parameters()),
           "noise_nonzero": {n: bool(opt.state[p]["exp_avg_noise"].abs().sum() > 0)
                             for n, p in named if "exp_avg_noise" in opt.state[p]}}
    if twin_opt is not None:
        res["twin_equal"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    return res


def run_horovod(folder, scenarios):
    import horovod.torch as hvd
    hvd.init()
    rank = hvd.rank()
    for sc in scenarios:
        try:
            if sc == "train":
                res = hvd_train(hvd, rank)
            elif sc == "bpps2":
                res = hvd_train(hvd, rank, bpps=2)
            elif sc == "none":
                res = hvd_train(hvd, rank, compression=hvd.Compression.none)
            elif sc == "corrected":
                res = hvd_train(hvd, rank, refresh=None)
            else:
                raise ValueError(sc)
        except Exception:  # noqa: BLE001
            res = {"crash": traceback.format_exc()}
        res["size"] = hvd.size()
        torch.save(res, os.path.join(folder, f"{sc}.rank{rank}.pt"))
    hvd.barrier() if hasattr(hvd, "barrier") else hvd.allreduce(torch.zeros(1), name="done")


# -- FSDP2 -------------------------------------------------------------------------------------------------------

def fsdp_train(dist, rank, refresh=SCHEDULE):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from horovod_terngrad import fsdp as tg_fsdp
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    model = make_model()
    for i in (0, 3, 5):
        fully_shard(model[i], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = tg_fsdp.register(model, mesh, min_numel=2048)
    named = list(model.named_parameters())
    opt = AdamW(model.parameters(), refresh=refresh, **HP)
    replica = mesh.get_coordinate()[0]
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, *batch(replica * 10 + mesh.get_coordinate()[1], step)).backward()
        before = snapshot(opt, named)
        opt.step()
        steps.append({"before": before, "after": snapshot(opt, named)})
    noise_nonzero = {n: bool(opt.state[p]["exp_avg_noise"].to_local().abs().sum() > 0)  # a DTensor, as exp_avg
                     for n, p in named if "exp_avg_noise" in opt.state[p]}
    return {"steps": steps, "checksum": checksum(model.parameters()), "shard": mesh.get_coordinate()[1],
            "layout": dict(state.layout), "noise_nonzero": noise_nonzero}


def fsdp_resume(dist, rank, folder, refresh=SCHEDULE):
    """8 steps straight, against 4 steps, a DCP checkpoint (model, tg AdamW, TernGrad), fresh objects loaded from
    it (the optimizer built with the default schedule: the checkpoint brings the saved one) and 4 more."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from horovod_terngrad import fsdp as tg_fsdp
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    me = mesh.get_coordinate()[0] * 10 + mesh.get_coordinate()[1]

    def fresh(refresh=SCHEDULE):
        model = make_model()
        for i in (0, 3, 5):
            fully_shard(model[i], mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        state = tg_fsdp.register(model, mesh, min_numel=2048)
        return model, AdamW(model.parameters(), refresh=refresh, **HP), state

    def train(model, opt, start, steps):
        for step in range(start, start + steps):
            opt.zero_grad()
            loss_of(model, *batch(me, step)).backward()
            opt.step()

    model, opt, state = fresh(refresh)
    train(model, opt, 0, 8)
    straight = checksum(model.parameters())
    model, opt, state = fresh(refresh)
    train(model, opt, 0, 4)
    msd, osd = get_state_dict(model, opt)
    where = os.path.join(folder, f"dcp.{refresh is None}")
    dcp.save({"model": msd, "optim": osd, "terngrad": state.state_dict()}, checkpoint_id=where)
    model, opt, state = fresh(refresh)
    msd, osd = get_state_dict(model, opt)
    loaded = {"model": msd, "optim": osd, "terngrad": state.state_dict()}
    dcp.load(loaded, checkpoint_id=where)
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    state.load_state_dict(loaded["terngrad"])
    train(model, opt, 4, 4)
    return {"straight": straight, "resumed": checksum(model.parameters()), "shard": mesh.get_coordinate()[1],
            "refresh": opt.param_groups[0]["refresh"]}


def run_fsdp(folder, scenarios):
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for sc in scenarios:
        try:
            if sc == "train":
                res = fsdp_train(dist, rank)
            elif sc == "resume":
                res = fsdp_resume(dist, rank, folder)
            elif sc == "resume_corrected":
                res = fsdp_resume(dist, rank, folder, refresh=None)
            elif sc == "corrected":
                res = fsdp_train(dist, rank, refresh=None)
            else:
                raise ValueError(sc)
        except Exception:  # noqa: BLE001
            res = {"crash": traceback.format_exc()}
        res["size"] = dist.get_world_size()
        torch.save(res, os.path.join(folder, f"{sc}.rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, frontend, *names = sys.argv[1:]
    {"ddp": run_ddp, "horovod": run_horovod, "fsdp": run_fsdp}[frontend](out, names)
