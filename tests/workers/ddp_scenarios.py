"""Runs under ``python -m torch.distributed.run --standalone --nproc_per_node N`` (launched by
tests/test_ddp.py); every rank writes what it saw to OUTDIR/<scenario>.rank<R>.pt.

    python ddp_scenarios.py OUTDIR SCENARIO [SCENARIO ...]

DDP scenarios record, per parameter and step, the gradient each rank handed TernGrad's hook and the
average DDP left in ``p.grad``; the test process recomputes the averages independently
(tests/helpers.expected_average) and compares them bit for bit.
"""
import contextlib
import datetime
import os
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import horovod_terngrad as tg  # noqa: E402
from horovod_terngrad.exchange.collectives import CollectiveError  # noqa: E402
from horovod_terngrad.exchange.dist_collectives import DistCollectiveError, DistCollectives  # noqa: E402
from horovod_terngrad.frontends import ddp as tg_ddp  # noqa: E402
from horovod_terngrad.frontends import ddp_bucket, ddp_worker  # noqa: E402
from helpers import link_codec_cost, mlp  # noqa: E402 (mlp: the model of the Horovod twin runs)

RANK = SIZE = None
LAST_STATE = []       # the TernGradState made last (for a scenario that ends in an exception)


# -- models ----------------------------------------------------------------------------------------------


class Scrambled(nn.Module):
    """Parameters of several sizes (5 .. 1776 elements), registered in an order unlike the order backward
    produces their gradients, so DDP's buckets after its rebuild (iteration 1) differ from the first ones.
    ``skip``: a layer this rank does not use (find_unused_parameters); ``dead``: a layer no rank uses."""

    def __init__(self, seed=0, skip=False, dead=False):
        super().__init__()
        torch.manual_seed(seed)
        self.head = nn.Linear(37, 5)
        self.body = nn.Linear(48, 37)
        self.norm = nn.LayerNorm(48)
        self.stem = nn.Linear(16, 48)
        self.extra = nn.Linear(37, 37)
        if dead:
            self.dead = nn.Linear(5, 3)
        self.skip = skip
        self.pause = 0.0

    def forward(self, x):
        h = self.norm(self.stem(x))
        if self.pause:        # backward waits here, between the gradients of 'body' and those of 'norm'
            h.register_hook(lambda g: time.sleep(self.pause))
        h = F.relu(self.body(h))
        if not self.skip:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def batches(seed_offset=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 + seed_offset + RANK)
    while True:
        yield torch.randn(8, 16, generator=gen).to(dtype)


# -- a recording hook ----------------------------------------------------------------------------------------
class Recorder:
    """The hook's state for DDP: TernGrad's state, plus what every bucket held before the exchange."""

    def __init__(self, state):
        self.state = state
        self.inputs = []          # (name, gradient as handed to the hook)
        self.buckets = []         # per hook call: (iteration, bucket index, names)
        self.done_at_return = []  # per hook call: (is last bucket, was its future complete when the hook returned)
        self.iteration = 0


def recording_hook(rec, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    names = [rec.state._name(p, bucket.index()) for p in bucket.parameters()]
    rec.inputs += [(n, g.detach().clone()) for n, g in zip(names, bucket.gradients())]
    rec.buckets.append((rec.iteration, bucket.index(), names))
    fut = tg_ddp.terngrad_hook(rec.state, bucket)
    rec.done_at_return.append((bucket.is_last(), fut.done()))
    return fut


def wrap(model, settings, hook=True, asynchronous=True, dedicated_group=True, **ddp_kwargs):
    ddp = DDP(model, **ddp_kwargs)
    state = tg_ddp.TernGradState(model.named_parameters(), config=tg.TernGradConfig(**{"min_numel": 0, **settings}),
                                 asynchronous=asynchronous, dedicated_group=dedicated_group)
    rec = Recorder(state)
    LAST_STATE[:] = [state]
    if hook:
        ddp.register_comm_hook(rec, recording_hook)
    return ddp, rec


def outputs_of(model, into):
    for n, p in model.named_parameters():
        if p.grad is not None:
            into.append((n, p.grad.detach().clone()))


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def train(model, settings, steps=3, accumulate=1, dtype=torch.float32, lr=0.1, inject=None, rec_out=None,
          asynchronous=True, dedicated_group=True, join=False, compile_backend=None, **ddp_kwargs):
    """SGD steps through DDP + TernGrad's hook; ``accumulate`` backward passes per step (the first ones in
    ``no_sync()``); ``join``: inside ``Join([ddp])`` (uneven inputs); ``compile_backend``: forward through
    ``torch.compile(ddp)``.  Returns (ddp model, recorder, outputs)."""
    model = model.to(dtype)
    ddp, rec = wrap(model, settings, asynchronous=asynchronous, dedicated_group=dedicated_group, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = batches(dtype=dtype)
    outputs = [] if rec_out is None else rec_out
    forward = ddp if compile_backend is None else torch.compile(ddp, backend=compile_backend)
    with Join([ddp]) if join else contextlib.nullcontext():
        for step in range(steps):
            opt.zero_grad()
            for k in range(accumulate):
                with ddp.no_sync() if k < accumulate - 1 else contextlib.nullcontext():   # forward and backward
                    loss = forward(next(data)).pow(2).mean()
                    if inject is not None and step == inject[0] and RANK == inject[1]:
                        loss = loss * float("nan")
                    loss.backward()
            outputs_of(model, outputs)
            opt.step()
            rec.iteration += 1
    return ddp, rec, outputs


def exact(model, settings, **kw):
    ddp, rec, outputs = train(model, settings, **kw)
    st = rec.state
    return {"config": st.config, "inputs": rec.inputs, "outputs": outputs, "buckets": rec.buckets,
            "done_at_return": rec.done_at_return,
            "names": [n for n, _ in ddp.module.named_parameters()], "params": params(ddp.module),
            "stats": vars(st.stats).copy(), "steps": dict(st.steps), "state": st.state_dict()}


# -- scenarios -----------------------------------------------------------------------------------------------
def sc_collectives():
    """DistCollectives alone: max/sum, allgather of unequal lengths, alltoall with uneven splits, errors."""
    out = {}
    for mode in (False, True):
        c = DistCollectives(equal_sizes=mode)
        tag = "equal" if mode else "exchanged"
        h = c.allreduce_max_async(torch.tensor([1.5 + RANK, -RANK, 7.0], dtype=torch.float64), "m")
        s = c.allreduce_sum_async(torch.tensor([1, RANK, 3], dtype=torch.int32), "s")
        n = 5 if mode else 3 + 4 * RANK                 # equal_sizes: the caller promises equal lengths
        g = c.allgather_async(torch.arange(n, dtype=torch.uint8) + 50 * RANK, "g")
        e = c.allgather_async(torch.empty(0, dtype=torch.uint8), "empty")
        # rank r sends (r + 1) * (j + 1) bytes to rank j (exchanged), or j + 1 bytes (equal: by receiver only)
        splits = [(j + 1) * ((RANK + 1) if not mode else 1) for j in range(SIZE)]
        data = torch.cat([torch.full((k,), 10 * RANK + j, dtype=torch.uint8) for j, k in enumerate(splits)])
        a = c.alltoall_async(data, splits, "a")
        out[tag] = {"max": c.synchronize(h), "sum": c.synchronize(s), "gather": c.synchronize(g),
                    "empty": c.synchronize(e), "a2a": c.synchronize(a), "polled": c.poll(a)}
    c = DistCollectives()
    bad = c.allreduce_max_async(torch.zeros(2, dtype=torch.complex64), "bad")   # refused locally, every rank
    try:
        c.synchronize(bad)
        out["error"] = None
    except CollectiveError as err:
        out["error"] = (type(err).__name__, isinstance(err, DistCollectiveError), type(err.__cause__).__name__,
                        str(err))
    return out


CONFIGS = {   # scenario -> (TernGradConfig settings, train kwargs)
    "shared_allgather_2bit": ({"seed": 3}, {}),
    "shared_allgather_2bit_sync": ({"seed": 3}, {"asynchronous": False}),
    "sync_on_ddps_group": ({"seed": 19, "exchange": "sharded"},     # + find_unused: DDP's own collectives too
                           {"asynchronous": False, "dedicated_group": False, "find_unused_parameters": True}),
    "shared_sharded_base3": ({"seed": 5, "exchange": "sharded", "packing": "base3"}, {}),
    "shared_sharded_2bit_buckets": ({"seed": 6, "exchange": "sharded", "bucket_size": 100}, {}),
    "per_rank_allgather_2bit": ({"seed": 7, "shared_scaler": False}, {}),
    "per_rank_allgather_base3_buckets": ({"seed": 8, "shared_scaler": False, "packing": "base3",
                                          "bucket_size": 64}, {}),
    "reternarized_2bit": ({"seed": 12, "exchange": "reternarized"}, {}),
    "requantized_2bit": ({"seed": 13, "exchange": "requantized"}, {}),
    "small_fusion_groups": ({"seed": 9, "fusion_numel": 300}, {}),
    # per_rank_allgather_2bit's settings with each bucket's groups ramped from 8 elements (8, 16, 32, ...)
    "ramped_groups": ({"seed": 7, "shared_scaler": False}, {"ramp_numel": 8}),
    "auto_exchange": ({"seed": 17, "exchange": "auto"}, {"link_codec_s": 0.0}),        # ternarizing pays
    "auto_off": ({"seed": 17, "exchange": "auto"}, {"link_codec_s": 1e-3}),            # it does not
    "exclude_min_numel": ({"seed": 10, "exclude": ("^head",), "min_numel": 40}, {}),
    "worker_restarts": ({"seed": 18}, {"pause": 0.2}),
    "no_sync_accumulate": ({"seed": 11}, {"accumulate": 3}),
    "static_graph": ({"seed": 12}, {"static_graph": True}),
    "bucket_view": ({"seed": 13}, {"gradient_as_bucket_view": True}),
    "find_unused": ({"seed": 14}, {"find_unused_parameters": True}),   # 'extra' unused on rank 1, 'dead' on all
    "fp16": ({"seed": 15}, {"dtype": torch.float16}),
    "bf16": ({"seed": 16}, {"dtype": torch.bfloat16}),
}


def sc_exact(name):
    settings, kw = CONFIGS[name]
    kw = dict(kw)
    unused = kw.get("find_unused_parameters", False)
    kw.setdefault("bucket_cap_mb", 0.002)       # ~500 fp32 elements per bucket: several buckets
    model = Scrambled(skip=unused and RANK == 1, dead=unused)
    model.pause = kw.pop("pause", 0.0)
    idle, step, ramp = ddp_worker.IDLE_EXIT_S, tg_ddp.TernGradState._step, ddp_bucket.RAMP_NUMEL
    ddp_bucket.RAMP_NUMEL = kw.pop("ramp_numel", ramp)
    workers = []        # the threads that ran buckets (kept, so that they stay distinct objects)

    def counting_step(self, job):
        if threading.current_thread() not in workers:
            workers.append(threading.current_thread())
        return step(self, job)

    if model.pause:     # the worker thread ends in the pause, with a bucket in flight; the next one goes on
        ddp_worker.IDLE_EXIT_S = 0.02
        tg_ddp.TernGradState._step = counting_step
    link_codec_s = kw.pop("link_codec_s", None)
    try:
        with link_codec_cost(link_codec_s) if link_codec_s is not None else contextlib.nullcontext():
            res = exact(model, settings, **kw)
        link = LAST_STATE[0].engine.link
        res["link"] = None if link is None else (link.ranks, link.allreduce_Bps, link.compresses)
    finally:
        ddp_worker.IDLE_EXIT_S, tg_ddp.TernGradState._step, ddp_bucket.RAMP_NUMEL = idle, step, ramp
    res["workers"] = len(workers)
    res["dtype"] = str(kw.get("dtype", torch.float32))
    # what atexit does before the interpreter finalizes: the worker thread that has just run the buckets ends
    state = LAST_STATE[0]
    thread = state._worker.thread
    res["running_before_exit"] = (thread is not None and thread.is_alive(), state._worker in ddp_worker._RUNNING)
    ddp_worker._stop_workers_at_exit()
    res["running_after_exit"] = (thread is not None and thread.is_alive(), state._worker in ddp_worker._RUNNING,
                                 state._worker.thread is not None)
    return res


TWINS = {   # the scenarios of tests/workers/hvd_scenarios.py run through DDP: (settings, backward passes)
    "twin_exact": ({"seed": 3}, 1),
    "twin_exact_sharded": ({"exchange": "sharded", "seed": 8}, 1),
    "twin_exact_base3_buckets": ({"packing": "base3", "bucket_size": 100, "seed": 4}, 1),
    "twin_exact_per_rank_bpps2": ({"shared_scaler": False}, 2),
}


def sc_twin(name):
    """hvd_scenarios.train_steps through DDP: mlp(), SGD(lr=0.1), 3 steps, x ~ randn(8, 16) seeded 100 + rank,
    backward passes accumulated (no_sync) as Horovod's backward_passes_per_step does."""
    settings, bpps = TWINS[name]
    model = mlp()
    ddp, rec = wrap(model, settings)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + RANK)
    outputs = []
    for _ in range(3):
        opt.zero_grad()
        for k in range(bpps):
            with ddp.no_sync() if k < bpps - 1 else contextlib.nullcontext():
                ddp(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        outputs_of(model, outputs)
        opt.step()
    return {"config": rec.state.config, "inputs": rec.inputs, "outputs": outputs, "params": params(model),
            "names": [n for n, _ in model.named_parameters()]}


def sc_join(settings, my_steps):
    """Uneven inputs under DDP's Join: each rank trains its own number of steps (``my_steps[RANK]``).  While
    a rank is joined, DDP runs the comm hook on zero buckets there to match the other's collectives; the
    averages the training rank gets are TernGrad's of (zeros, its gradient), and nobody hangs."""
    res = exact(Scrambled(), settings, steps=my_steps[RANK], join=True, bucket_cap_mb=0.002)
    res["my_steps"] = my_steps[RANK]
    return res


def sc_compiled(backend):
    """A torch.compile'd DDP model (DDP's recommended order: wrap, then compile): dynamo splits the graph at
    bucket boundaries and DDP's reducer still calls the hook with every bucket.  DDP's own bucket sizes:
    dynamo wants the first bucket no larger than the rest."""
    res = exact(Scrambled(), {"seed": 22}, compile_backend=backend)
    res["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return res


def sc_nan(policy, **settings):
    """NaN on rank 1 at step 1: every rank sees it (raise: the same error from backward on every rank;
    zero: that step's averages are zero on every rank), and nothing hangs."""
    res = {}
    rec_out = []
    try:
        ddp, rec, _ = train(Scrambled(), {"seed": 2, "on_nonfinite": policy, **settings}, steps=3, inject=(1, 1),
                            bucket_cap_mb=0.002, rec_out=rec_out)
        res["error"] = None
        res["zeroed"] = rec.state.stats.nonfinite_zeroed
        res["params"] = params(ddp.module)
    except Exception as e:  # noqa: BLE001 - what each rank sees is the result
        res["error"] = (type(e).__name__, [c.__name__ for c in type(e).__mro__], str(e))
        res["last_error"] = type(LAST_STATE[0].last_error).__name__
    res["steps_done"] = len(rec_out) // len(list(Scrambled().parameters()))   # steps whose backward completed
    return res


def sc_fp_inf(policy):
    """An Inf in rank 1's gradient of 'body.weight' at step 1; with the default min_numel (4096) every tensor of
    the model (at most 1776 elements) goes through the plain fp32 allreduce, which on_nonfinite covers too."""
    model = Scrambled()
    calls = []

    def poison(g):
        calls.append(None)
        if len(calls) == 2 and RANK == 1:
            g = g.clone()
            g[2, 3] = float("inf")
        return g
    model.body.weight.register_hook(poison)
    res = {}
    try:
        ddp, rec, _ = train(model, {"min_numel": 4096, "on_nonfinite": policy}, steps=3, bucket_cap_mb=0.002)
        res.update(error=None, zeroed=rec.state.stats.nonfinite_zeroed, params=params(ddp.module),
                   uncompressed=rec.state.state.uncompressed_elements)
    except Exception as e:  # noqa: BLE001 - what each rank sees is the result
        res["error"] = str(e)
        res["last_error"] = type(LAST_STATE[0].last_error).__name__
    return res


def sc_nan_then_continue():
    """After a NaN step raised (on every rank), the same DDP model trains on: the next step's exchange works."""
    model = Scrambled()
    ddp, rec = wrap(model, {"seed": 2, "on_nonfinite": "raise"}, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches()
    seen = []
    for step in range(3):
        opt.zero_grad()
        loss = ddp(next(data)).pow(2).mean()
        if step == 1 and RANK == 1:
            loss = loss * float("nan")
        try:
            loss.backward()
            opt.step()
            seen.append(None)
        except Exception as e:  # noqa: BLE001
            seen.append(type(e).__name__)
    return {"seen": seen, "params": params(model)}


def sc_resume():
    """2 steps, state_dict (TernGrad's, the model's, the optimizer's) through a file, a new DDP model and
    TernGradState that load it, 2 more steps: the same parameters as 4 straight steps; without TernGrad's
    state (fresh step counters) the random streams repeat and the result differs."""
    settings = {"seed": 21}

    def run(steps, start=None, keep=None):
        model = Scrambled()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if start is not None:
            model.load_state_dict(start["model"])
            opt.load_state_dict(start["opt"])
        ddp, rec = wrap(model, settings, bucket_cap_mb=0.002)
        if start is not None and start.get("terngrad") is not None:
            rec.state.load_state_dict(start["terngrad"])
        data = batches(seed_offset=0 if start is None else 1000)
        for i in range(steps):
            if start is None and keep is not None and i == keep:
                data = batches(seed_offset=1000)
            opt.zero_grad()
            ddp(next(data)).pow(2).mean().backward()
            opt.step()
        return model, opt, rec.state

    straight, _, _ = run(4, keep=2)
    head, opt, state = run(2)
    ckpt = {"model": head.state_dict(), "opt": opt.state_dict(), "terngrad": state.state_dict()}
    path = os.path.join(OUTDIR, f"ckpt.rank{RANK}.pt")
    torch.save(ckpt, path)
    ckpt = torch.load(path, weights_only=False)
    resumed, _, _ = run(2, start=ckpt)
    forgot, _, _ = run(2, start=dict(ckpt, terngrad=None))
    return {"straight": params(straight), "resumed": params(resumed), "forgot": params(forgot),
            "ckpt_terngrad": ckpt["terngrad"]}


def sc_register():
    """The one-call API: tg.ddp.register(ddp_model, **settings) on a plain DDP model trains like the rest."""
    model = Scrambled()
    ddp = DDP(model, bucket_cap_mb=0.002)
    state = tg.ddp.register(ddp, seed=1, packing="base3", min_numel=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches()
    for _ in range(2):
        opt.zero_grad()
        ddp(next(data)).pow(2).mean().backward()
        opt.step()
    return {"params": params(model), "steps": dict(state.steps), "tensors": state.stats.tensors,
            "repr": repr(state)}


def sc_sparse():
    """A sparse embedding gradient: a clear error naming the parameter, on every rank (no hang)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Linear(8, 4))
    ddp, rec = wrap(model, {})
    try:
        ddp(torch.randint(0, 50, (6, 3))).pow(2).mean().backward()
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": str(e).splitlines()[0], "last_error": repr(rec.state.last_error)}


def sc_mismatch():
    """Ranks with different TernGrad settings: the state is checked at the first bucket; RankMismatchError
    fails that backward on every rank (no hang), and the next bucket's too, without new collectives."""
    model = Scrambled()
    ddp = DDP(model, bucket_cap_mb=0.002)
    state = tg_ddp.TernGradState(model.named_parameters(), packing="base3" if RANK == 1 else "2bit")
    ddp.register_comm_hook(state, tg_ddp.terngrad_hook)
    errors = []
    for _ in range(2):
        try:
            ddp(next(batches())).pow(2).mean().backward()
            errors.append(None)
        except RuntimeError:
            errors.append(repr(state.last_error))
    return {"error": str(state.last_error) if isinstance(state.last_error, tg.RankMismatchError) else None,
            "errors": errors}


def run(name):
    if name == "collectives":
        return sc_collectives()
    if name in CONFIGS:
        return sc_exact(name)
    if name in TWINS:
        return sc_twin(name)
    if name == "join_uneven":
        return sc_join({"seed": 23}, (2, 4))
    if name == "join_uneven_sharded":
        return sc_join({"seed": 24, "exchange": "sharded"}, (4, 1))
    if name == "compiled":
        return sc_compiled("aot_eager")
    if name == "nan_raise":
        return sc_nan("raise")
    if name == "nan_zero":
        return sc_nan("zero")
    if name == "nan_raise_per_rank":
        return sc_nan("raise", shared_scaler=False)
    if name in ("fp_inf_raise", "fp_inf_zero"):
        return sc_fp_inf(name[len("fp_inf_"):])
    if name == "nan_then_continue":
        return sc_nan_then_continue()
    if name == "resume":
        return sc_resume()
    if name == "register":
        return sc_register()
    if name == "sparse":
        return sc_sparse()
    if name == "mismatch":
        return sc_mismatch()
    raise SystemExit(f"unknown scenario {name}")


OUTDIR = None


def main():
    global RANK, SIZE, OUTDIR
    OUTDIR, names = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    RANK, SIZE = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    for name in names:
        started = time.perf_counter()
        try:
            res = run(name)
        except Exception:  # noqa: BLE001 - a crash is a result too
            res = {"crash": traceback.format_exc()}
        res["size"] = SIZE
        torch.save(res, os.path.join(OUTDIR, f"{name}.rank{RANK}.pt"))
        print(f"rank {RANK}: {name} done in {time.perf_counter() - started:.1f} s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
