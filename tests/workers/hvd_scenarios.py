"""Runs under horovodrun / mpirun (launched by tests/test_horovod.py); writes what each rank saw.

    python hvd_scenarios.py OUTDIR SCENARIO [SCENARIO ...]

Every scenario stores plain tensors and strings in OUTDIR/<scenario>.rank<R>.pt, and the test
process checks them against an independent recomputation.
"""
import os
import sys
import time
import traceback

import torch
import torch.nn as nn

import horovod.torch as hvd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import horovod_terngrad as tg  # noqa: E402
from horovod_terngrad import TernGradCompressor as LibraryCompressor  # noqa: E402
from helpers import link_codec_cost, mlp  # noqa: E402,F401 (the test model; hvd_usage and hvd_elastic import it from here)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stall_watch  # noqa: E402


class TernGradCompressor(LibraryCompressor):
    """The library's compressor with ``min_numel=0`` unless a scenario sets it: the test models' tensors are
    small, and the checks recompute ternarized results (the default keeps tensors under 4096 elements at
    full precision)."""

    def __init__(self, config=None, **settings):
        if config is None:
            settings.setdefault("min_numel", 0)
        super().__init__(config, **settings)


class Recording(TernGradCompressor):
    """TernGrad that remembers each tensor's input and output (for the test to recompute)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.inputs, self.outputs = [], []

    def compress(self, tensor):
        out, ctx = super().compress(tensor)
        self.inputs.append((self.name_of(ctx), tensor.detach().clone()))
        return out, ctx

    def decompress(self, tensor, ctx):
        out = super().decompress(tensor, ctx)
        if ctx is not None:           # None: Horovod's sparse allreduce, nothing compressed
            self.outputs.append((self.name_of(ctx), out.detach().clone()))
        return out

    @staticmethod
    def name_of(ctx):
        return ctx.ticket.name if hasattr(ctx, "ticket") else ctx.name




def train_steps(comp, steps=3, bpps=1, dtype=torch.float32, inject=None, model=None, prefix=""):
    """``prefix`` names the gradients apart: a scenario that raises mid-step leaves that step's other
    collectives to finish in Horovod's background, and the next scenario must not enqueue the same names
    while they do ("a tensor with the same name ... is currently being processed")."""
    model = model or mlp()
    model = model.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hvd.DistributedOptimizer(opt, named_parameters=[(prefix + n, p) for n, p in model.named_parameters()],
                                   compression=comp, backward_passes_per_step=bpps)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    for step in range(steps):
        opt.zero_grad()
        for _ in range(bpps):
            x = torch.randn(8, 16, generator=gen).to(dtype)
            loss = model(x).pow(2).mean()
            if inject is not None and step == inject[0] and hvd.rank() == inject[1]:
                loss = loss * float("nan")
            loss.backward()
        opt.step()
    return model


def names_in_order(model):
    return [n for n, _ in model.named_parameters()]


def scenario_exact(cfg_kwargs, bpps=1, dtype=torch.float32):
    comp = Recording(**cfg_kwargs)
    model = train_steps(comp, steps=3, bpps=bpps, dtype=dtype)
    return {"config": comp.config, "inputs": comp.inputs, "outputs": comp.outputs,
            "names": names_in_order(model), "params": [p.detach().clone() for p in model.parameters()],
            "stats": vars(comp.stats).copy(), **_link_of(comp)}


def _link_of(comp) -> dict:
    """exchange="auto": the link the global engine measured, as plain values."""
    link = comp.engine().link if comp.config.exchange == "auto" else None
    if link is None:
        return {"link": None}
    return {"link": {"ranks": link.ranks, "allreduce_Bps": link.allreduce_Bps,
                     "codec_s_per_element": link.codec_s_per_element},
            "link_compresses": link.compresses, "link_text": link.describe()}


def scenario_auto(codec_s_per_element):
    """exchange="auto" with the link really measured on these ranks, and the codec's cost as given."""
    with link_codec_cost(codec_s_per_element):
        return scenario_exact({"exchange": "auto", "seed": 3})


FP_INF_CASES = {   # why the 32x32 weight "2.weight" (1024 elements) travels at full precision
    "min_numel": {},                                             # the defaults: under min_numel (4096)
    "exclude": {"min_numel": 0, "exclude": (r"\.2\.weight$",)},  # excluded by name
    "auto_off": {"min_numel": 0, "exchange": "auto"},             # exchange="auto": compression does not pay
}


def scenario_fp_inf(case):
    """Rank 1's gradient of "2.weight" holds an Inf at step 1; the library's compressor (not the tests'
    min_numel=0 one) with ``on_nonfinite`` raise (``<case>``) or zero (``<case>_zero``)."""
    zero = case.endswith("_zero")
    settings = dict(FP_INF_CASES[case[:-len("_zero")] if zero else case], on_nonfinite="zero" if zero else "raise")
    comp = LibraryCompressor(**settings)
    model = mlp()
    prefix = f"fp_inf_{case}."
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=comp,
                                   named_parameters=[(prefix + n, p) for n, p in model.named_parameters()])
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    res = {"error": None}
    step = 0

    def poison(g):   # a tensor hook: runs before the gradient is accumulated and handed to Horovod
        if step == 1 and hvd.rank() == 1:
            g = g.clone()
            g[3, 5] = float("inf")
        return g
    model[2].weight.register_hook(poison)
    try:
        with link_codec_cost(1e-3):
            for step in range(3):
                opt.zero_grad()
                model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
                opt.step()
    except tg.NonFiniteGradientError as e:
        res["error"] = str(e)
    res.update(zeroed=comp.stats.nonfinite_zeroed, uncompressed=comp.uncompressed_elements,
               params=[p.detach().clone() for p in model.parameters()])
    return res


def sim_setup():
    """Model, data and optimizer shared by the real run and the simulator (tests/test_simulate.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from mnist_lenet import LeNet
    torch.manual_seed(0)
    model = LeNet()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(256, 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (256,), generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    return model, x, y, opt


SIM_STEPS, SIM_BATCH, SIM_SEED = 4, 32, 7
SIM_EXCLUDE = ("^fc2",)      # the last layer stays fp32 (Horovod's allreduce): the simulator must agree


def scenario_lenet_sim():
    import torch.nn.functional as F
    from horovod_terngrad.modelling.simulate import batch_indices, worker_slice
    model, x, y, opt = sim_setup()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=TernGradCompressor(seed=SIM_SEED, exclude=SIM_EXCLUDE))
    for step in range(SIM_STEPS):
        idx = worker_slice(batch_indices(SIM_SEED, step, len(x), SIM_BATCH), hvd.rank(), hvd.size())
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()]}


def run(name):
    r = hvd.rank()
    if name == "exact":
        return scenario_exact({"seed": 3})
    if name == "exact_base3_buckets":
        return scenario_exact({"packing": "base3", "bucket_size": 100, "seed": 4})
    if name == "exact_sharded":
        return scenario_exact({"exchange": "sharded", "seed": 8})
    if name == "exact_reternarized":
        return scenario_exact({"exchange": "reternarized", "seed": 8})
    if name == "exact_requantized":
        return scenario_exact({"exchange": "requantized", "seed": 9})
    if name == "exact_sharded_unfused":
        return scenario_exact({"exchange": "sharded", "seed": 8, "fusion_numel": 0})
    if name == "exact_unfused":
        return scenario_exact({"seed": 3, "fusion_numel": 0})
    if name == "exact_small_groups":     # groups of a few tensors each, and a tensor too big to fuse
        return scenario_exact({"seed": 3, "fusion_numel": 1000})
    if name == "exact_per_rank_bpps2":
        return scenario_exact({"shared_scaler": False}, bpps=2)
    if name == "auto_on":
        return scenario_auto(0.0)
    if name == "auto_off":
        return scenario_auto(1e-3)
    if name == "exclude":
        return scenario_exact({"exclude": (r"^6\.",), "min_numel": 10})
    if name == "bf16":
        return scenario_exact({}, dtype=torch.bfloat16)
    if name == "nan_raise":
        try:
            train_steps(TernGradCompressor(on_nonfinite="raise"), steps=3, inject=(1, 1), prefix="nan_raise.")
            return {"error": None}
        except tg.NonFiniteGradientError as e:
            return {"error": str(e)}
    if name == "nan_zero":
        comp = TernGradCompressor(on_nonfinite="zero")
        model = train_steps(comp, steps=3, inject=(1, 1))
        return {"zeroed": comp.stats.nonfinite_zeroed,
                "params": [p.detach().clone() for p in model.parameters()]}
    if name.startswith("fp_inf_"):       # an Inf in a gradient that travels at full precision
        return scenario_fp_inf(name[len("fp_inf_"):])
    if name == "mismatch":
        out = {}
        try:
            train_steps(TernGradCompressor(), steps=1, model=mlp(width=32 + r), prefix="mismatch.")
            out["optimizer"] = None
        except tg.RankMismatchError as e:
            out["optimizer"] = str(e)
        try:
            tg.allreduce(torch.randn(10 + r), name="functional.x")
            out["functional"] = None
        except tg.RankMismatchError as e:
            out["functional"] = str(e)
        return out
    if name == "lenet_sim":
        return scenario_lenet_sim()
    if name == "fusion_partial":
        # A parameter leaves the optimizer's update set after the fusion plan was made (as if frozen
        # and dropped): its group is incomplete at decompress time, the rest goes as a smaller group.
        comp = TernGradCompressor(seed=2)
        model = mlp()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=comp)
        gen = torch.Generator().manual_seed(100 + r)
        for step in range(4):
            if step == 2:
                frozen = model[-1].bias
                frozen.requires_grad_(False)
                opt._requires_update.discard(frozen)
            opt.zero_grad()
            model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
            opt.step()
        return {"params": [p.detach().clone() for p in model.parameters()], "collectives": comp.stats.collectives}
    if name == "functional":
        res = {}
        gen = torch.Generator().manual_seed(r)
        base = torch.randn(30, 40, generator=gen)
        res["inputs"] = {}
        for key, t in {"f16": base.half(), "bf16": base.bfloat16(), "f64": base.double(),
                       "noncontig": base.t(), "empty": torch.zeros(0, 4), "zero": torch.zeros(7)}.items():
            res["inputs"][key] = t.clone()
            res[key] = tg.allreduce(t, name=f"fn.{key}")
        try:
            tg.allreduce(torch.ones(3, dtype=torch.int64), name="fn.int")
            res["int"] = None
        except TypeError as e:
            res["int"] = str(e)
        direct_in = base.clone()
        res["direct"] = hvd.allreduce(direct_in, name="fn.direct", compression=TernGradCompressor())
        res["direct_sum"] = hvd.allreduce(base.clone(), name="fn.directsum", op=hvd.Sum,
                                          compression=TernGradCompressor())
        res["direct_input_kept"] = torch.equal(direct_in, base)
        h = [tg.allreduce_async(base * k, name=f"fn.async{k}") for k in range(3)]
        res["async"] = [tg.synchronize(x) for x in h]
        res["async_inputs"] = [base * k for k in range(3)]
        return res
    raise SystemExit(f"unknown scenario {name}")


def run_all(outdir, names, run_one, tag=""):
    """Run every scenario and save each rank's result (a crash is a result too) as
    OUTDIR/<name><tag>.rank<R>.pt; then shut Horovod down.  With HVD_TEST_STALL_S set, a scenario that runs
    longer says where every rank is waiting and stops the job (stall_watch.py)."""
    torch.set_num_threads(1)
    if stall_watch.limit_s() > 0:
        stall_watch.install()
    for name in names:
        started = time.perf_counter()
        try:
            with stall_watch.watch(outdir, f"{name}{tag}", hvd.rank()):
                res = run_one(name)
        except Exception:
            res = {"crash": traceback.format_exc()}
        res["size"] = hvd.size()
        torch.save(res, os.path.join(outdir, f"{name}{tag}.rank{hvd.rank()}.pt"))
        # progress on stdout, so that a launch killed for hanging shows which scenario it was in
        print(f"rank {hvd.rank()}: {name} done in {time.perf_counter() - started:.1f} s", flush=True)
    hvd.shutdown()


def main():
    outdir, names = sys.argv[1], sys.argv[2:]
    hvd.init()
    run_all(outdir, names, run)


if __name__ == "__main__":
    main()
