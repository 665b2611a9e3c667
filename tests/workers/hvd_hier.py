"""The node-aware exchange under horovodrun / mpirun (launched by tests/test_hierarchical_ranks.py).

    python hvd_hier.py OUTDIR HOSTS SCENARIO [SCENARIO ...]

HOSTS: "-" keeps the real host names (the emulated cluster gives each host its own); else a comma list of
one node name per global rank (ranks on one machine emulating nodes: HOROVOD_TERNGRAD_HOST, set here
after hvd.init() from the rank).  Each scenario saves OUTDIR/<scenario>.rank<R>.pt (hvd_scenarios.run_all).

SCENARIO@CASE runs SCENARIO as a job of its own would, in this one launch (several jobs' worth of checks
without a launch each): HIER_TEST_CASES (JSON) maps CASE to {"hosts": HOSTS, "env": {...}}; the case's
node names and environment apply while it runs (everything TernGrad reads from the environment it reads
when a compressor first meets a tensor), TernGrad's say-once memory starts empty, and every rank writes
"=== SCENARIO@CASE ===" to stderr first, so that a test can tell which case said what.
"""
import json
import os
import sys

import torch

import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hvd_scenarios import Recording, mlp, run_all, train_steps  # noqa: E402
from horovod_terngrad import NonFiniteGradientError, TernGradError  # noqa: E402
from horovod_terngrad.exchange.hierarchical import HierarchicalEngine  # noqa: E402
from horovod_terngrad.exchange.world_groups import WorldGroupCollectives  # noqa: E402
from horovod_terngrad.frontends import hierarchy  # noqa: E402


def engine_info(comp) -> dict:
    eng = comp.engine()
    hier = isinstance(eng, HierarchicalEngine)
    return {"hierarchical": hier, "nodes": [list(n) for n in eng.topology.nodes] if hier else None,
            "world_groups": hier and isinstance(eng.local, WorldGroupCollectives),
            "stats": vars(comp.stats).copy()}


def fused_groups(comp) -> list:
    return [list(g) for fus in comp.state.fusions.values() for g in fus.plan.fused]


def scenario_exact(prefix, **cfg):
    comp = Recording(hierarchical=True, **cfg)
    model = train_steps(comp, steps=3, prefix=prefix)
    return {"config": comp.config, "inputs": comp.inputs, "outputs": comp.outputs, "groups": fused_groups(comp),
            "names": [prefix + n for n, _ in model.named_parameters()],
            "params": [p.detach().clone() for p in model.parameters()], **engine_info(comp)}


def scenario_nan():
    """NaN in every gradient of rank 3 at step 1 (one rank of one node): every rank raises."""
    comp = Recording(hierarchical=True, on_nonfinite="raise")
    try:
        train_steps(comp, steps=3, inject=(1, 3), prefix="nan.")
        return {"raised": None, **engine_info(comp)}
    except NonFiniteGradientError as e:
        return {"raised": type(e).__name__, "message": str(e), **engine_info(comp)}


def scenario_join():
    """Uneven data: rank 2 runs 2 steps and joins; the others run 4."""
    comp = Recording(hierarchical=True)
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[("join." + n, p) for n, p in model.named_parameters()],
                                   compression=comp)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(2 if hvd.rank() == 2 else 4):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
    last = hvd.join()
    return {"outputs": comp.outputs, "last_joined": int(last),
            "params": [p.detach().clone() for p in model.parameters()], **engine_info(comp)}


def scenario_resume():
    """2 steps, checkpoint, 2 more; then a fresh model, optimizer and compressor from the checkpoint run
    the same 2 steps: the parameters must be identical."""
    def build(state=None):
        comp = Recording(hierarchical=True)
        torch.manual_seed(0)
        model = mlp()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=[("resume." + n, p) for n, p in model.named_parameters()],
                                       compression=comp)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            comp.load_state_dict(state["terngrad"])
        return comp, model, opt

    def steps(model, opt, first, n):
        for s in range(first, first + n):
            gen = torch.Generator().manual_seed(1000 * s + hvd.rank())
            opt.zero_grad()
            model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
            opt.step()

    comp, model, opt = build()
    steps(model, opt, 0, 2)
    ckpt = {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": opt.state_dict(), "terngrad": comp.state_dict()}
    steps(model, opt, 2, 2)
    whole = [p.detach().clone() for p in model.parameters()]
    comp2, model2, opt2 = build(ckpt)
    steps(model2, opt2, 2, 2)
    return {"whole": whole, "resumed": [p.detach().clone() for p in model2.parameters()], **engine_info(comp2)}


def scenario_fallback(tag=""):
    """HIER_TEST_SETTING: the ``hierarchical`` setting ("auto" unless "true"); HIER_TEST_SHARED=1: shared
    scaler (the node-aware exchange then needs process sets).  A TernGradError is the result too."""
    setting = True if os.environ.get("HIER_TEST_SETTING") == "true" else "auto"
    comp = Recording(hierarchical=setting, shared_scaler=True if os.environ.get("HIER_TEST_SHARED") else None)
    try:
        train_steps(comp, steps=2, prefix=f"fb{tag}.")
    except TernGradError as e:
        # every rank decides alone, from the same facts, with no collective; wait here until every rank has, so
        # that no rank's shutdown (run_all's hvd.shutdown) stops Horovod under a rank still deciding (which then
        # met "Horovod has not been initialized" instead of its TernGradError: a race on 2 shared cores)
        hvd.barrier()
        return {"error": str(e), "error_type": type(e).__name__, "hierarchical": False}
    return {"outputs": comp.outputs, "error": None, **engine_info(comp)}


def scenario_kill(outdir):
    """Rank 3 (node 1) dies mid-step, after its gradients went out: the others end with Horovod's error."""
    comp = Recording(hierarchical=True)
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[("kill." + n, p) for n, p in model.named_parameters()],
                                   compression=comp)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    try:
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
            if step == 2 and hvd.rank() == 3:
                os._exit(3)
            opt.step()
    except Exception as e:  # noqa: BLE001 - what a survivor sees is the result
        res = {"error_type": [c.__name__ for c in type(e).__mro__], "error": str(e), "size": hvd.size(),
               **engine_info(comp)}
        path = os.path.join(outdir, f"kill.rank{hvd.rank()}.pt")
        torch.save(res, path + ".part")    # whole or absent: the launcher may end this rank while it writes
        os.replace(path + ".part", path)
        os._exit(4)
    return {"error_type": None}


# each takes a tag for its tensor names (a case's own: no name of one case meets another's in Horovod)
SCENARIOS = {
    "exact": lambda tag: scenario_exact(f"exact{tag}.", fusion_numel=0),
    "fused": lambda tag: scenario_exact(f"fused{tag}."),
    "sharded": lambda tag: scenario_exact(f"sharded{tag}.", exchange="sharded", fusion_numel=0),
    # the scenarios above run the default, bf16 inside the node; this one fp32 inside
    "fp32inside": lambda tag: scenario_exact(f"fp32inside{tag}.", intra_node_dtype="float32"),
    "nan": lambda tag: scenario_nan(), "join": lambda tag: scenario_join(),
    "resume": lambda tag: scenario_resume(), "fallback": scenario_fallback,
}


def run_case(name: str):
    """SCENARIOS[name], or SCENARIO@CASE with the case's hosts and environment (module docstring)."""
    base, _, case = name.partition("@")
    if not case:
        return SCENARIOS[base]("")
    spec = json.loads(os.environ["HIER_TEST_CASES"])[case]
    saved = dict(os.environ)
    try:
        os.environ.update(spec.get("env", {}))
        os.environ["HOROVOD_TERNGRAD_HOST"] = spec["hosts"].split(",")[hvd.rank()]
        hierarchy._said.clear()
        print(f"=== {name} ===", file=sys.stderr, flush=True)
        return SCENARIOS[base]("." + case)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main():
    outdir, hosts, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    sets = os.environ.get("HIER_TEST_STATIC_SETS")
    if sets:       # the user registers the topology's process sets at init (no dynamic sets needed)
        hvd.init(process_sets=[hvd.ProcessSet([int(r) for r in g.split(".")]) for g in sets.split(",")])
    else:
        hvd.init()
    if hosts != "-":
        os.environ["HOROVOD_TERNGRAD_HOST"] = hosts.split(",")[hvd.rank()]
    if names == ["kill"]:
        scenario_kill(outdir)
    run_all(outdir, names, run_case)


if __name__ == "__main__":
    main()
