"""Runs under ``python -m torch.distributed.run --standalone --nproc_per_node 2`` (launched by
tests/test_ecosystem.py): the DDP hook's state as frameworks use it.  Every rank writes OUTDIR/<scenario>.rank<R>.pt.

    python ddp_ecosystem.py OUTDIR SCENARIO [SCENARIO ...]

A model and its TernGradState are pickled together *before* ``init_process_group`` (as Lightning's spawn
launcher does) and unpickled after it; wrappers of the DDP object are searched by ``register()``; a second
registration is refused.
"""
import datetime
import os
import pickle
import sys
import time
import traceback
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import horovod_terngrad as tg  # noqa: E402
from horovod_terngrad.frontends import ddp as tg_ddp  # noqa: E402

RANK = None
PICKLED = None        # (model, state) pickled before torch.distributed was initialized


def model_():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 300), nn.Tanh(), nn.Linear(300, 20), nn.Tanh(), nn.Linear(20, 4))


def train(ddp, steps=2, forward=None):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + RANK)
    for _ in range(steps):
        opt.zero_grad()
        (forward if forward is not None else ddp)(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()


def checksum(model):
    code = 0
    for p in model.parameters():
        code = zlib.crc32(p.detach().numpy().tobytes(), code)
    return code


def sc_pickled_before_init():
    """The pickle made before init_process_group: the state's names are still the model's parameters, its
    groups are made at the first bucket; the hook goes on with register_comm_hook, as Lightning does."""
    model, state = pickle.loads(PICKLED)
    before = (state.collectives, state.process_group, dict(state.steps))
    ddp = DDP(model)
    ddp.register_comm_hook(state, tg_ddp.terngrad_hook)
    train(ddp)
    again = pickle.loads(pickle.dumps(state))          # after use: worker thread, groups and engine dropped
    return {"before": before, "steps": dict(state.steps), "tensors": state.stats.tensors,
            "checksum": checksum(model), "again_steps": dict(again.steps), "again_groups": again.collectives,
            "again_config": again.config, "config": state.config, "repr": repr(state)}


def sc_unnamed_direct():
    """TernGradState() with no names, on register_comm_hook: parameters named param.<k> by the order the hook
    meets them, alike on every rank."""
    model = model_()
    ddp = DDP(model)
    state = tg_ddp.TernGradState(min_numel=0)
    ddp.register_comm_hook(state, tg_ddp.terngrad_hook)
    train(ddp)
    return {"steps": dict(state.steps), "checksum": checksum(model)}


def sc_exclude_needs_names():
    model = model_()
    ddp = DDP(model)
    state = tg_ddp.TernGradState(exclude=("2",))
    ddp.register_comm_hook(state, tg_ddp.terngrad_hook)
    errors = []
    for _ in range(2):
        try:
            train(ddp, steps=1)
            errors.append(None)
        except RuntimeError:
            errors.append(str(state.last_error))
    return {"errors": errors}


class _Obj:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def sc_wrappers():
    """find_ddp through the wrappers of torch.compile, Lightning, Fabric, transformers' Trainer; register() on a
    compiled DDP model trains; a second registration, or one over another hook, is a clear error."""
    model = model_()
    ddp = DDP(model)
    compiled = torch.compile(ddp, backend="eager")
    found = {"compiled": tg_ddp.find_ddp(compiled) is ddp,
             "hf_trainer": tg_ddp.find_ddp(_Obj(model=model, model_wrapped=ddp)) is ddp,
             "lightning_trainer": tg_ddp.find_ddp(_Obj(strategy=_Obj(model=ddp))) is ddp}
    try:
        import lightning.pytorch as pl
        from lightning.fabric.wrappers import _FabricModule

        class LM(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = model_()

        lm = LM()
        lm._trainer = _Obj(strategy=_Obj(model=ddp))        # what Trainer.fit attaches
        found["lightning_module"] = tg_ddp.find_ddp(lm) is ddp
        # Lightning < 2.1 put DDP around a _LightningModuleWrapperBase holding the LightningModule as _forward_module
        found["lightning_wrapper"] = tg_ddp.find_ddp(_Obj(_forward_module=lm)) is ddp
        found["fabric_module"] = tg_ddp.find_ddp(_FabricModule(ddp, None, original_module=model)) is ddp
    except ImportError:
        pass
    state = tg_ddp.register(compiled, seed=4, min_numel=0)
    train(ddp, forward=compiled)
    errors = {}
    for what, obj in (("again", ddp), ("again_compiled", compiled)):
        try:
            tg_ddp.register(obj)
        except tg.TernGradError as e:
            errors[what] = str(e)
    other = DDP(model_())
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    other.register_comm_hook(None, allreduce_hook)
    try:
        tg_ddp.register(other)
    except tg.TernGradError as e:
        errors["other_hook"] = str(e)
    reused = DDP(model_())
    try:
        tg_ddp.register(reused, state=state)
    except tg.TernGradError as e:
        errors["state_reused"] = str(e)
    try:
        tg_ddp.register(model)
    except TypeError as e:
        errors["not_ddp"] = str(e)
    return {"found": found, "steps": dict(state.steps), "checksum": checksum(model), "errors": errors}


SCENARIOS = {"pickled_before_init": sc_pickled_before_init, "unnamed_direct": sc_unnamed_direct,
             "exclude_needs_names": sc_exclude_needs_names, "wrappers": sc_wrappers}


def main():
    global RANK, PICKLED
    outdir, names = sys.argv[1], sys.argv[2:]
    assert not dist.is_initialized()
    model = model_()
    PICKLED = pickle.dumps((model, tg_ddp.TernGradState(model, seed=9, min_numel=0)))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    RANK = dist.get_rank()
    torch.set_num_threads(1)
    for name in names:
        started = time.perf_counter()
        try:
            res = SCENARIOS[name]()
        except Exception:  # noqa: BLE001 - a crash is a result too
            res = {"crash": traceback.format_exc()}
        torch.save(res, os.path.join(outdir, f"{name}.rank{RANK}.pt"))
        print(f"rank {RANK}: {name} done in {time.perf_counter() - started:.1f} s", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
    import gc
    gc.collect()
    dist.destroy_process_group()
