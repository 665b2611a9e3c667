"""Mixed precision with TernGrad on Horovod (launched by tests/test_amp.py with horovodrun --gloo).

    python amp_hvd.py OUTDIR HOSTS SCENARIO [SCENARIO ...]

HOSTS: "-" keeps the real host name; else one node name per rank (HOROVOD_TERNGRAD_HOST, set after hvd.init(),
as tests/workers/hvd_hier.py does), so 4 ranks on this machine are 2 nodes of 2.  Each scenario saves
OUTDIR/<scenario>.rank<R>.pt (hvd_scenarios.run_all; a crash is saved as the result).

fp16 scenarios use Horovod's AMP recipe (amp_common.train records what happened):

    scaler.scale(loss).backward(); opt.synchronize(); scaler.unscale_(opt)
    with opt.skip_synchronize(): scaler.step(opt)
    scaler.update()
"""
import os
import sys

import torch

import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from amp_common import INIT_SCALE, STEPS, Faults, make_model, make_optimizer, train  # noqa: E402
from hvd_scenarios import run_all  # noqa: E402
from horovod_terngrad import TernGrad  # noqa: E402
from horovod_terngrad.exchange.hierarchical import HierarchicalEngine  # noqa: E402

RESUME_AT = 8          # checkpoint after steps 0..7 (the first ones skipped), then steps 8..15
STATIC_SCALE = 128.0   # the .half() model's fixed loss scale


def compression(kind):
    """'none': Horovod's Compression.none; 'terngrad': TernGrad at its defaults (a fresh compressor, so that
    scenarios do not share state); 'terngrad_min0': every tensor ternarized; 'terngrad_hier': the node-aware
    exchange forced on; 'terngrad_rq': the requantized exchange (the default beyond 4 ranks) named."""
    return {"none": lambda: hvd.Compression.none,
            "terngrad": lambda: TernGrad.configure(),
            "terngrad_min0": lambda: TernGrad.configure(min_numel=0),
            "terngrad_hier": lambda: TernGrad.configure(hierarchical=True),
            "terngrad_rq": lambda: TernGrad.configure(exchange="requantized")}[kind]()


def build(prefix, comp, checkpoint=None):
    model = make_model()
    opt = hvd.DistributedOptimizer(make_optimizer(model), compression=comp,
                                   named_parameters=[(prefix + n, p) for n, p in model.named_parameters()])
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
        comp.load_state_dict(checkpoint["terngrad"])
    return model, opt, scaler


def amp_recipe(opt, scaler):
    def backward_and_step(loss):
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    return backward_and_step


def info(comp) -> dict:
    if comp is hvd.Compression.none:
        return {"terngrad": False}
    eng = comp.engine()
    return {"terngrad": True, "hierarchical": isinstance(eng, HierarchicalEngine),
            "nodes": [list(n) for n in eng.topology.nodes] if isinstance(eng, HierarchicalEngine) else None,
            "config": comp.config, "stats": vars(comp.stats).copy(), "uncompressed": comp.uncompressed_elements}


def scenario_fp16(kind):
    comp = compression(kind)
    model, opt, scaler = build(f"fp16_{kind}.", comp)
    rec = train(model, Faults(model, hvd.rank(), hvd.size()), amp_recipe(opt, scaler), hvd.rank(), scaler=scaler)
    return {**rec, **info(comp)}


def scenario_resume_save(outdir):
    """Steps 0..7 (the first skipped), rank 0 saves model, optimizer, scaler and TernGrad's state, then steps
    8..15 (three of them skipped) go on in this process."""
    comp = compression("terngrad")
    model, opt, scaler = build("resume.", comp)
    faults, recipe = Faults(model, hvd.rank(), hvd.size()), amp_recipe(opt, scaler)
    first = train(model, faults, recipe, hvd.rank(), steps=range(RESUME_AT), scaler=scaler)
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
                    "terngrad": comp.state_dict()}, os.path.join(outdir, "resume.ckpt"))
    rest = train(model, faults, recipe, hvd.rank(), steps=range(RESUME_AT, STEPS), scaler=scaler)
    return {"first": first, "rest": rest, **info(comp)}


def scenario_resume_load(outdir):
    """A fresh process: every rank loads rank 0's checkpoint into a new model, optimizer, scaler and compressor
    and runs steps 8..15."""
    ckpt = torch.load(os.path.join(outdir, "resume.ckpt"), weights_only=False)
    comp = compression("terngrad")
    model, opt, scaler = build("resume.", comp, ckpt)
    rest = train(model, Faults(model, hvd.rank(), hvd.size()), amp_recipe(opt, scaler), hvd.rank(),
                 steps=range(RESUME_AT, STEPS), scaler=scaler)
    return {"rest": rest, "loaded_scale": ckpt["scaler"]["scale"], **info(comp)}


def scenario_plain(kind):
    """TernGrad at its defaults, no GradScaler, no injected overflow: 'bf16_autocast' (fp32 parameters),
    'half_static' (a .half() model, fp16 gradients, a static loss scale of 128), 'bf16_params' (a bfloat16
    model)."""
    comp = compression("terngrad")
    model = make_model()
    dtype = {"bf16_autocast": torch.float32, "half_static": torch.float16, "bf16_params": torch.bfloat16}[kind]
    model = model.to(dtype)
    opt = hvd.DistributedOptimizer(make_optimizer(model), compression=comp,
                                   named_parameters=[(f"{kind}." + n, p) for n, p in model.named_parameters()])
    grad_dtypes = set()

    def backward_and_step(loss):
        if kind == "half_static":
            (loss * STATIC_SCALE).backward()
            opt.synchronize()
            for p in model.parameters():
                p.grad.div_(STATIC_SCALE)
            grad_dtypes.update(str(p.grad.dtype) for p in model.parameters())
            with opt.skip_synchronize():
                opt.step()
        else:
            loss.backward()
            opt.synchronize()
            grad_dtypes.update(str(p.grad.dtype) for p in model.parameters())
            with opt.skip_synchronize():
                opt.step()

    rec = train(model, Faults(model, hvd.rank(), hvd.size(), enabled=False), backward_and_step, hvd.rank(),
                autocast=torch.bfloat16 if kind == "bf16_autocast" else None, dtype=dtype)
    return {**rec, "grad_dtypes": sorted(grad_dtypes), **info(comp)}


def run(name, outdir):
    if name.startswith("fp16_"):
        return scenario_fp16(name[len("fp16_"):])
    if name == "resume_save":
        return scenario_resume_save(outdir)
    if name == "resume_load":
        return scenario_resume_load(outdir)
    return scenario_plain(name)


def main():
    outdir, hosts, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    hvd.init()
    if hosts != "-":
        os.environ["HOROVOD_TERNGRAD_HOST"] = hosts.split(",")[hvd.rank()]
    run_all(outdir, names, lambda name: run(name, outdir))


if __name__ == "__main__":
    main()
