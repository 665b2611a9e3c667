"""Mixed precision with TernGrad's DDP comm hook (launched by tests/test_amp.py with torchrun, gloo).

    python amp_ddp.py OUTDIR HOSTS SCENARIO [SCENARIO ...]

HOSTS: "-" keeps the real host name; else one node name per rank (HOROVOD_TERNGRAD_HOST, set from the rank
before the hook makes its groups, as tests/workers/ddp_hier.py does).  Each scenario saves
OUTDIR/<scenario>.rank<R>.pt (a crash is saved as the result).

fp16 scenarios use DDP's AMP recipe (amp_common.train records what happened):

    scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
"""
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from amp_common import INIT_SCALE, Faults, make_model, make_optimizer, train  # noqa: E402
from horovod_terngrad import ddp as tg_ddp  # noqa: E402
from horovod_terngrad.exchange.hierarchical import HierarchicalEngine  # noqa: E402

STATIC_SCALE = 128.0
SETTINGS = {"none": None, "terngrad": {}, "terngrad_min0": {"min_numel": 0},
            "terngrad_hier": {"hierarchical": True}, "terngrad_rq": {"exchange": "requantized"}}


def wrap(model, kind):
    """DDP, with TernGrad's hook at its defaults (plus the kind's setting), or none (DDP's own allreduce)."""
    ddp = DDP(model)
    state = tg_ddp.register(ddp, **SETTINGS[kind]) if SETTINGS[kind] is not None else None
    return ddp, state


def info(state) -> dict:
    if state is None:
        return {"terngrad": False}
    eng = state.engine
    hier = isinstance(eng, HierarchicalEngine)
    return {"terngrad": True, "hierarchical": hier, "nodes": [list(n) for n in eng.topology.nodes] if hier else None,
            "config": state.config, "stats": vars(state.stats).copy(),
            "uncompressed": state.state.uncompressed_elements}


def scenario_fp16(kind, rank, size):
    model = make_model()
    ddp, state = wrap(model, kind)
    opt = make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)

    def backward_and_step(loss):
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    rec = train(ddp, Faults(model, rank, size), backward_and_step, rank, scaler=scaler)
    return {**rec, **info(state)}


def scenario_plain(kind, rank, size):
    """The hook at its defaults, no GradScaler, no injected overflow: 'bf16_autocast', 'half_static' (a .half()
    model, static loss scale 128), 'bf16_params' (a bfloat16 model)."""
    dtype = {"bf16_autocast": torch.float32, "half_static": torch.float16, "bf16_params": torch.bfloat16}[kind]
    model = make_model().to(dtype)
    ddp, state = wrap(model, "terngrad")
    opt = make_optimizer(model)
    grad_dtypes = set()

    def backward_and_step(loss):
        if kind == "half_static":
            (loss * STATIC_SCALE).backward()
            for p in model.parameters():
                p.grad.div_(STATIC_SCALE)
        else:
            loss.backward()
        grad_dtypes.update(str(p.grad.dtype) for p in model.parameters())
        opt.step()

    rec = train(ddp, Faults(model, rank, size, enabled=False), backward_and_step, rank,
                autocast=torch.bfloat16 if kind == "bf16_autocast" else None, dtype=dtype)
    return {**rec, "grad_dtypes": sorted(grad_dtypes), **info(state)}


def main():
    outdir, hosts, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, size = dist.get_rank(), dist.get_world_size()
    if hosts != "-":
        os.environ["HOROVOD_TERNGRAD_HOST"] = hosts.split(",")[rank]
    torch.set_num_threads(1)
    for name in names:
        started = time.perf_counter()
        try:
            if name.startswith("fp16_"):
                res = scenario_fp16(name[len("fp16_"):], rank, size)
            else:
                res = scenario_plain(name, rank, size)
        except Exception:  # noqa: BLE001 - a crash is a result too
            res = {"crash": traceback.format_exc()}
        res["size"] = size
        torch.save(res, os.path.join(outdir, f"{name}.rank{rank}.pt"))
        print(f"rank {rank}: {name} done in {time.perf_counter() - started:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
