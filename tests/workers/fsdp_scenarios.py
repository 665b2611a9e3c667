"""FSDP2 (HSDP) with TernGrad between replicas, under torchrun (launched by tests/test_fsdp.py).

    python fsdp_scenarios.py OUTDIR R SCENARIO [SCENARIO ...]

The world is an (R, S) mesh (replicate, shard), S = world size / R.  Each scenario builds the same small
language model (an embedding of 37 rows, three blocks with LayerNorm and Linear layers of 47 rows, a head of
5 rows, a (1, 80) gain: first dimensions that S does not divide, a shard that is empty), shards it with
``fully_shard(..., mesh=mesh["shard"])`` per block and at the root, registers TernGrad and trains a few
steps; every rank saves OUTDIR/<scenario>.rank<R>.pt with what the test checks.  Scenarios:

exact, exact_sharded (exchange="sharded": shared scaler, alltoall to owners), exact_reternarized
(exchange="reternarized": owners re-ternarize), exact_bf16 (bf16 parameters and reduce), exact_bf16p (bf16 parameters, fp32 reduce), accum (two
micro-batches per step, set_requires_gradient_sync), frozen_unused (a frozen weight, a block unused at step
1), compile (blocks under torch.compile), buckets (FSDP internals hidden: the flat-shard fallback):
    every call of TernGrad's hook recorded (unit, input shard, averaged shard) and the final local shards;
resume: 6 steps, against 3 steps, a DCP checkpoint (model, AdamW, TernGrad), a fresh model loaded from it and
    3 more steps;
amp: fp16 autocast with GradScaler, native HSDP beside TernGrad-HSDP, overflows forced at steps 4 (rank 3's
    loss times inf) and 7 (a NaN in rank 0's activations): the steps skipped and the scale after each step;
nan_propagate, nan_zero: a NaN in one activation of the last rank at step 1, native HSDP beside TernGrad:
    which local gradient shards are finite after that backward;
raise: register(..., on_nonfinite="raise") must be refused;
fallback: a 1-D mesh: FSDP's own path, no hook;
kill: the last rank exits in the middle of the run (the job must end with an error).
"""
import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from horovod_terngrad.errors import TernGradError  # noqa: E402
from horovod_terngrad.frontends import fsdp as tg_fsdp  # noqa: E402

VOCAB, D, H, CTX = 37, 24, 47, 6
SETTINGS = dict(min_numel=64)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class ToyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.gain = nn.Parameter(torch.ones(1, 80))
        self.head = nn.Linear(D, 5)
        self.poison = None      # added to block 0's output (NaN scenarios)
        self.skip = ()          # blocks not run (frozen_unused)

    def forward(self, tokens):
        x = self.emb(tokens) * self.gain[:, :D]
        for i, b in enumerate(self.blocks):
            if i in self.skip:
                continue
            x = b(x)
            if i == 0 and self.poison is not None:
                x = x + self.poison
        return self.head(x)


def batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    tokens = torch.randint(0, VOCAB, (4, CTX), generator=g)
    return tokens, torch.randint(0, 5, (4, CTX), generator=g)


def loss_of(model, tokens, target):
    return torch.nn.functional.cross_entropy(model(tokens).float().reshape(-1, 5), target.reshape(-1))


def build(mesh, native=False, mp=None, compile_blocks=False, frozen=False):
    torch.manual_seed(0)
    model = ToyLM()
    if frozen:
        model.blocks[1].up.weight.requires_grad_(False)
    kw = {"mesh": mesh if native else mesh["shard"]}
    if mp is not None:
        kw["mp_policy"] = mp
    for b in model.blocks:
        if compile_blocks:
            b.compile(backend="aot_eager")
        fully_shard(b, **kw)
    fully_shard(model, **kw)
    return model


def unit_params(model):
    """Per FSDP unit (by name, root ""), its parameters in the order of its flat shard: (FQN, full shape,
    requires_grad).  FSDP's rule, written out again: the unit's modules in post-order (children before
    their parent, not entering a nested unit), each module's own parameters in registration order."""
    from torch.distributed.fsdp import FSDPModule
    out = {}

    def visit(prefix, module, params):
        for cname, child in module.named_children():
            if not isinstance(child, FSDPModule):
                visit(prefix + cname + ".", child, params)
        params += [(prefix + n, tuple(p.shape), p.requires_grad) for n, p in module.named_parameters(recurse=False)]

    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            visit(name + "." if name else "", m, out.setdefault(name, []))
    return out


def record(state):
    calls = []
    original = state.reduce

    def reduce(unit, pg, out):
        before = out.detach().clone()
        original(unit, pg, out)
        calls.append((unit, before, out.detach().clone()))
    state.reduce = reduce
    return calls


def local_shards(model):
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def train(model, rank, steps, opt, accum=1, skip_at=None, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        model.skip = (2,) if step == skip_at else ()
        for micro in range(accum):
            if accum > 1:
                model.set_requires_gradient_sync(micro == accum - 1)
            loss_of(model, *batch(rank, step, micro)).backward()
        opt.step()


def exact(mesh, rank, scenario):
    mp = {"exact_bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
          "exact_bf16p": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}.get(scenario)
    model = build(mesh, mp=mp, compile_blocks=scenario == "compile", frozen=scenario == "frozen_unused")
    settings = {"exact_sharded": dict(SETTINGS, exchange="sharded"),
                "exact_reternarized": dict(SETTINGS, exchange="reternarized"),
                "exact_requantized": dict(SETTINGS, exchange="requantized")}.get(scenario, SETTINGS)
    state = tg_fsdp.register(model, mesh, **settings)
    calls = record(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if scenario == "buckets":          # a future FSDP whose reduced parameters cannot be told: the sizes disagree
        state._record_with_grad = lambda pg: state._with_grad.__setitem__(id(pg), [])
    train(model, rank, 3, opt, accum=2 if scenario == "accum" else 1,
          skip_at=1 if scenario == "frozen_unused" else None)
    return {"calls": calls, "units": unit_params(model), "shards": local_shards(model), "layout": dict(state.layout),
            "config": state.config, "stats": vars(state.stats).copy(), "unit_steps": dict(state.unit_steps)}


def resume(mesh, rank, outdir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh():
        model = build(mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01), tg_fsdp.register(model, mesh, **SETTINGS)

    model, opt, _ = fresh()
    train(model, rank, 6, opt)
    straight = local_shards(model)
    model, opt, state = fresh()
    train(model, rank, 3, opt)
    msd, osd = get_state_dict(model, opt)
    where = os.path.join(outdir, "dcp")
    dcp.save({"model": msd, "optim": osd, "terngrad": state.state_dict()}, checkpoint_id=where)
    saved_steps = dict(state.unit_steps)
    model, opt, state = fresh()
    msd, osd = get_state_dict(model, opt)
    loaded = {"model": msd, "optim": osd, "terngrad": state.state_dict()}
    dcp.load(loaded, checkpoint_id=where)
    set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    state.load_state_dict(loaded["terngrad"])
    restored_steps = dict(state.unit_steps)
    train(model, rank, 3, opt, start=3)
    return {"straight": straight, "resumed": local_shards(model), "saved_steps": saved_steps,
            "restored_steps": restored_steps}


def amp(mesh, rank, world):
    out = {}
    for kind in ("native", "terngrad"):
        model = build(mesh, native=kind == "native")
        if kind == "terngrad":
            tg_fsdp.register(model, mesh, **SETTINGS)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
        skipped, scales, losses = [], [], []
        for step in range(10):
            opt.zero_grad()
            model.poison = None
            if step == 7 and rank == 0:
                model.poison = torch.zeros(D).index_fill_(0, torch.tensor([3]), float("nan"))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model, *batch(rank, step))
            if step == 4 and rank == world - 1:
                loss = loss * float("inf")
            losses.append(float(loss))
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            stepped = []
            handle = opt.register_step_post_hook(lambda *a: stepped.append(1))
            scaler.step(opt)
            handle.remove()
            scaler.update()
            if not stepped:
                skipped.append(step)
            scales.append((before, scaler.get_scale()))
        out[kind] = {"skipped": skipped, "scales": scales, "losses": losses, "shards": local_shards(model)}
    return out


def nan(mesh, rank, world, policy):
    out = {}
    for kind in ("native", "terngrad"):
        model = build(mesh, native=kind == "native")
        if kind == "terngrad":
            tg_fsdp.register(model, mesh, on_nonfinite=policy, **SETTINGS)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, rank, 1, opt)
        opt.zero_grad()
        if rank == world - 1:
            model.poison = torch.zeros(D).index_fill_(0, torch.tensor([5]), float("nan"))
        loss_of(model, *batch(rank, 1)).backward()
        model.poison = None
        out[kind] = {n: (bool(torch.isfinite(p.grad.to_local()).all()), p.grad.to_local().clone())
                     for n, p in model.named_parameters()}
    return out


def refused(mesh):
    model = build(mesh)
    try:
        tg_fsdp.register(model, mesh, on_nonfinite="raise")
    except TernGradError as e:
        return {"refused": str(e)}
    return {"refused": None}


def fallback(rank, world):
    records = []

    class Catch(logging.Handler):
        def emit(self, rec):
            records.append(rec.getMessage())
    logging.getLogger("horovod_terngrad").addHandler(Catch())
    logging.getLogger("horovod_terngrad").setLevel(logging.INFO)
    mesh1 = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    model = build_1d(mesh1)
    state = tg_fsdp.register(model, mesh1)
    state2 = tg_fsdp.register(build_1d(mesh1), mesh1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, rank, 2, opt)
    hooked = [m for m in model.modules() if getattr(getattr(m, "_get_fsdp_state", None), "__call__", None)
              and any(pg._all_reduce_hook is not None for pg in m._get_fsdp_state()._fsdp_param_groups)]
    return {"active": state.active, "active2": state2.active, "reason": state.reason, "records": records,
            "hooked": len(hooked)}


def build_1d(mesh1):
    torch.manual_seed(0)
    model = ToyLM()
    for b in model.blocks:
        fully_shard(b, mesh=mesh1)
    fully_shard(model, mesh=mesh1)
    return model


def kill(mesh, rank, world):
    model = build(mesh)
    tg_fsdp.register(model, mesh, **SETTINGS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        if step == 2 and rank == world - 1:
            os._exit(3)
        train(model, rank, 1, opt, start=step)
    return {}


def main():
    outdir, replicas, scenarios = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    for scenario in scenarios:
        res = {"size": world, "rank": rank, "coords": mesh.get_coordinate(), "replicas": replicas}
        try:
            if scenario == "resume":
                res.update(resume(mesh, rank, outdir))
            elif scenario == "amp":
                res.update(amp(mesh, rank, world))
            elif scenario.startswith("nan_"):
                res.update(nan(mesh, rank, world, scenario[4:]))
            elif scenario == "raise":
                res.update(refused(mesh))
            elif scenario == "fallback":
                res.update(fallback(rank, world))
            elif scenario == "kill":
                res.update(kill(mesh, rank, world))
            else:
                res.update(exact(mesh, rank, scenario))
        except Exception:  # noqa: BLE001
            res["crash"] = traceback.format_exc()
        torch.save(res, os.path.join(outdir, f"{scenario}.rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
