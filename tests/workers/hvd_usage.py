"""What users do with Horovod, run under horovodrun / mpirun by tests/test_usage.py.

    python hvd_usage.py OUTDIR COMPRESSION[,COMPRESSION] PATTERN [PATTERN ...]

COMPRESSION is "terngrad" (a recording TernGrad compressor) or "none" (hvd.Compression.none, the parity
baseline: every pattern must behave with TernGrad as it does without compression); with both, each pattern runs
with each in turn, in the one launch.  Each pattern is taken from Horovod's own tests
(test/parallel/test_torch.py) and docs; each rank stores what it saw in OUTDIR/<pattern>.<compression>.rank<R>.pt
and the test process checks it.
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
import horovod_terngrad as tg  # noqa: E402
from hvd_scenarios import Recording, mlp, run_all  # noqa: E402

COMPRESSION = "terngrad"


def compressor(**settings):
    if COMPRESSION == "none":
        return hvd.Compression.none
    if os.environ.get("HVD_USAGE_EXCHANGE"):      # a test's choice of exchange for every pattern
        settings.setdefault("exchange", os.environ["HVD_USAGE_EXCHANGE"])
    return Recording(**settings)


def record(comp, model, **extra):
    """What the test checks: every rank's compressor inputs/outputs and final parameters."""
    out = {"params": [p.detach().clone() for p in model.parameters()],
           "names": [n for n, _ in model.named_parameters()], **extra}
    if isinstance(comp, Recording):
        out.update(config=comp.config, inputs=comp.inputs, outputs=comp.outputs, stats=vars(comp.stats).copy())
    return out


def batches(seed_offset=0, n=8, dim=16):
    gen = torch.Generator().manual_seed(100 + seed_offset + hvd.rank())
    while True:
        yield torch.randn(n, dim, generator=gen)


def plain_training(comp, steps=3, model=None, prefix="", **opt_kwargs):
    model = model or mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[(prefix + n, p) for n, p in model.named_parameters()],
                                   compression=comp, **opt_kwargs)
    data = batches()
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(opt.backward_passes_per_step):
            model(next(data)).pow(2).mean().backward()
        opt.step()
    return model, opt


# -- patterns ----------------------------------------------------------------------------------------------
def p_join(comp):
    """Uneven data: rank 0 runs two more steps, then every rank calls hvd.join() (test_horovod_join_allreduce)."""
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    data = batches()
    steps = 3 + (2 if hvd.rank() == 0 else 0)
    for _ in range(steps):
        opt.zero_grad()
        model(next(data)).pow(2).mean().backward()
        opt.step()
    last = hvd.join()
    # afterwards every rank can talk again (Horovod's docs: broadcast to re-align the models)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return record(comp, model, join=int(last), steps=steps)


def p_unnamed_ops_mid_step(comp):
    """Unnamed Horovod ops between backward and step (averaging the loss for logging), while TernGrad's
    exchanges are in flight, with rank 1 slower in backward.  Horovod names an unnamed op after a
    rank-local handle counter, so this hangs unless every rank issued the same ops before it."""
    import time
    model = mlp()
    if COMPRESSION != "none":
        comp = compressor(fusion_numel=0)     # every tensor its own group: the most ops in flight
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    data = batches()
    losses = []
    for _ in range(4):
        opt.zero_grad()
        h = model[0](next(data))
        if hvd.rank() == 1:           # rank 1 produces its later gradients later
            h.register_hook(lambda g: time.sleep(0.05))
        loss = model[1:](h).pow(2).mean()
        loss.backward()
        losses.append(float(hvd.allreduce(loss.detach())))
        losses.append(float(hvd.allreduce(torch.ones(1), op=hvd.Sum)))
        opt.step()
    return record(comp, model, losses=losses)


def p_sparse(comp, as_dense):
    torch.manual_seed(0)
    emb = nn.Embedding(50, 8, sparse=True)
    head = nn.Linear(8, 4)
    model = nn.Sequential(emb, head)
    before = emb.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(), compression=comp,
                                   sparse_as_dense=as_dense)
    gen = torch.Generator().manual_seed(7 + hvd.rank())
    for _ in range(3):
        opt.zero_grad()
        idx = torch.randint(0, 50, (6, 3), generator=gen)
        head(emb(idx).mean(1)).pow(2).mean().backward()
        opt.step()
    return record(comp, model, emb_moved=not torch.equal(before, emb.weight.detach()))


def p_grouped_allreduce(comp):
    """hvd.grouped_allreduce with a compression argument, one base name for the group; op=Sum and
    prescale/postscale factors of hvd.allreduce."""
    gen = torch.Generator().manual_seed(3 + hvd.rank())
    t = torch.randn(40, generator=gen)
    res = {"inputs": {"g.0": t.clone(), "g.1": (2 * t).clone(), "scaled": (3 * t).clone()}}
    res["grouped"] = hvd.grouped_allreduce([t, 2 * t], name="g", compression=comp)
    res["grouped_sum"] = hvd.grouped_allreduce([t, 2 * t], name="gs", op=hvd.Sum, compression=comp)
    res["scaled"] = hvd.allreduce(3 * t, name="scaled", prescale_factor=2.0, postscale_factor=0.5 * 3,
                                  compression=comp)
    res["unnamed_group"] = hvd.grouped_allreduce([t, t + 1], compression=comp)
    return res


def p_optimizer_groups(comp, groups):
    model = mlp()
    if groups == "list":
        layers = [m for m in model if isinstance(m, nn.Linear)]
        groups = [[layers[0].weight, layers[0].bias], [layers[2].weight]]
    model, _ = plain_training(comp, model=model, groups=groups)
    return record(comp, model)


def p_bpps(comp):
    model, _ = plain_training(comp, backward_passes_per_step=2)
    return record(comp, model)


def p_clip(comp):
    """synchronize(), clip the averaged gradients, then step() inside skip_synchronize() (Horovod's docs)."""
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    data = batches()
    norms = []
    for _ in range(3):
        opt.zero_grad()
        model(next(data)).pow(2).mean().backward()
        opt.synchronize()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        with opt.skip_synchronize():
            opt.step()
    return record(comp, model, norms=norms)


def p_gan(comp):
    """Two models and two optimizers sharing one compressor; the discriminator's requires_grad toggled."""
    torch.manual_seed(0)
    gen_net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g = hvd.DistributedOptimizer(torch.optim.Adam(gen_net.parameters(), lr=1e-3),
                                     named_parameters=[("G." + n, p) for n, p in gen_net.named_parameters()],
                                     compression=comp)
    opt_d = hvd.DistributedOptimizer(torch.optim.Adam(disc.parameters(), lr=1e-3),
                                     named_parameters=[("D." + n, p) for n, p in disc.named_parameters()],
                                     compression=comp)
    gen = torch.Generator().manual_seed(11 + hvd.rank())
    for _ in range(3):
        z, real = torch.randn(8, 4, generator=gen), torch.randn(8, 8, generator=gen)
        for p in disc.parameters():
            p.requires_grad_(True)
        opt_d.zero_grad()
        loss_d = F.softplus(-disc(real)).mean() + F.softplus(disc(gen_net(z).detach())).mean()
        loss_d.backward()
        opt_d.step()
        for p in disc.parameters():
            p.requires_grad_(False)
        opt_g.zero_grad()
        F.softplus(-disc(gen_net(z))).mean().backward()
        opt_g.step()
    both = nn.ModuleList([gen_net, disc])
    return record(comp, both)


class Branchy(nn.Module):
    """A dynamic forward: the side branch is used on even steps only (its parameters then have no grad)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(16, 16)
        self.side = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.frozen = nn.Linear(16, 16)          # never used
        self.step = 0

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        if self.step % 2 == 0:
            h = h + torch.relu(self.side(h))
        return self.head(h)


def p_no_grad(comp):
    model = Branchy()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    data = batches()
    for step in range(4):
        model.step = step
        opt.zero_grad()
        model(next(data)).pow(2).mean().backward()
        opt.step()
    return record(comp, model)


def p_optimizer_state(comp):
    """broadcast_parameters/broadcast_optimizer_state at start, an lr scheduler, and load_state_dict
    mid-run (a rollback to a saved state), as Horovod's examples and elastic do."""
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=comp)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = batches()
    saved = None
    for step in range(5):
        if step == 2:
            saved = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
        if step == 4:
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        opt.zero_grad()
        model(next(data)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return record(comp, model, lr=opt.param_groups[0]["lr"])


def p_predivide(comp):
    model, _ = plain_training(comp, gradient_predivide_factor=2.0)
    return record(comp, model)


def p_adasum(comp):
    try:
        # own names: when Horovod refuses Adasum mid-step (Gloo), its other ops of that step stay in flight
        # under these names for the rest of the run, and later patterns must not reuse them
        model, _ = plain_training(comp, op=hvd.Adasum, prefix="adasum.")
        return record(comp, model, error=None)
    except (tg.TernGradError, HorovodInternalError) as e:   # Horovod refuses Adasum itself under Gloo
        return {"error": f"{type(e).__name__}: {e}"}


def p_resume(comp):
    """A run stopped after 3 steps and resumed from its checkpoint (model, optimizer and TernGrad's
    state_dict) ends bit-identical to a run of 6 uninterrupted steps."""
    def run(steps, start=None):
        comp_ = compressor(seed=5)
        model = mlp()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=comp_)
        data = batches()
        done = 0
        if start is not None:
            model.load_state_dict(start["model"])
            opt.load_state_dict(start["optimizer"])
            if start["terngrad"] is not None:
                comp_.load_state_dict(start["terngrad"])
            done = start["step"]
            for _ in range(done):
                next(data)
        for _ in range(done, steps):
            opt.zero_grad()
            model(next(data)).pow(2).mean().backward()
            opt.step()
        ckpt = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict(),
                "terngrad": comp_.state_dict() if hasattr(comp_, "state_dict") else None, "step": steps}
        return model, ckpt

    straight, _ = run(6)
    _, ckpt = run(3)
    ckpt = torch.load(_roundtrip(ckpt), weights_only=False)   # through a file, as a user would
    resumed, _ = run(6, start=ckpt)
    no_state = dict(ckpt, terngrad=None)
    forgot, _ = run(6, start=no_state)                         # resumed without TernGrad's state
    p = lambda m: [x.detach().clone() for x in m.parameters()]  # noqa: E731
    return {"straight": p(straight), "resumed": p(resumed), "forgot": p(forgot), "ckpt_terngrad": ckpt["terngrad"]}


def _roundtrip(obj):
    path = os.path.join(OUTDIR, f"ckpt.rank{hvd.rank()}.{COMPRESSION}.pt")
    torch.save(obj, path)
    return path


def p_process_sets(comp):
    """Two optimizers on disjoint process sets at once (-np 4: ranks 0,1 train model A; 2,3 model B)."""
    mine = SETS[0] if hvd.rank() in SETS[0].ranks else SETS[1]
    set_rank = mine.rank()     # (read early: once, late in a run, Horovod answered "does not exist")
    model = mlp(seed=1 if mine is SETS[0] else 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp,
                                   process_set=mine)
    data = batches()
    for _ in range(3):
        opt.zero_grad()
        model(next(data)).pow(2).mean().backward()
        opt.step()
    hvd.barrier()          # the other set may still train: nobody shuts Horovod down before all are done
    return record(comp, model, set_ranks=list(mine.ranks), set_rank=set_rank)


def p_peer_loss(comp):
    """Rank 1 dies in the middle of a step (after its gradients went out, before it waits for them)."""
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    data = batches()
    try:
        for step in range(4):
            opt.zero_grad()
            model(next(data)).pow(2).mean().backward()
            if step == 2 and hvd.rank() == 1:
                os._exit(3)
            opt.step()
    except Exception as e:          # noqa: BLE001 - what the survivor sees is the result
        res = {"error_type": [c.__name__ for c in type(e).__mro__], "error": str(e), "size": hvd.size()}
        torch.save(res, os.path.join(OUTDIR, f"peer_loss.{COMPRESSION}.rank{hvd.rank()}.pt"))
        os._exit(4)
    return {"error_type": None}


PATTERNS = {
    "peer_loss": p_peer_loss,
    "join": p_join,
    "unnamed_ops_mid_step": p_unnamed_ops_mid_step,
    "sparse_as_dense": lambda c: p_sparse(c, True),
    "sparse": lambda c: p_sparse(c, False),
    "grouped_allreduce": p_grouped_allreduce,
    "optimizer_groups_n": lambda c: p_optimizer_groups(c, 2),
    "optimizer_groups_list": lambda c: p_optimizer_groups(c, "list"),
    "backward_passes_per_step": p_bpps,
    "synchronize_clip": p_clip,
    "gan_two_optimizers": p_gan,
    "params_without_grad": p_no_grad,
    "optimizer_state_scheduler": p_optimizer_state,
    "gradient_predivide_factor": p_predivide,
    "adasum": p_adasum,
    "resume": p_resume,
    "process_sets": p_process_sets,
}
SETS = None
OUTDIR = None


def main():
    global COMPRESSION, SETS, OUTDIR
    OUTDIR, compressions, names = sys.argv[1], sys.argv[2].split(","), sys.argv[3:]
    if "process_sets" in names:
        hvd.init(process_sets="dynamic")           # as Horovod's own process-set tests do
        SETS = [hvd.add_process_set([0, 1]), hvd.add_process_set([2, 3])]
        hvd.barrier()
    else:
        hvd.init()
    run_all(OUTDIR, [f"{name}.{c}" for name in names for c in compressions], run_with_compression)


def run_with_compression(job: str):
    """One "<pattern>.<compression>" job: the pattern, with that compression."""
    global COMPRESSION
    name, COMPRESSION = job.rsplit(".", 1)
    return PATTERNS[name](compressor())


if __name__ == "__main__":
    main()
