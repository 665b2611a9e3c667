"""Step times of PyTorch DDP with its communication hooks on an emulated cluster, launched as users launch DDP:
one ``torchrun`` per emulated host (launch/ddp-torchrun --netns), gloo, one rank per host.  Needs root and
iproute2 (launch/netns-cluster.sh).

    .venv/bin/python examples/ddp_benchmark.py --models mlp,resnet50,transformer --hosts 2,4 \\
        --rates 1gbit,none --out docs/ddp

Configurations (``--configs``, every one a fresh copy of the same model, same seed):

    fp32        DDP without a hook (fp32 allreduce)
    fp16        ``default_hooks.fp16_compress_hook``
    powersgd1   ``powerSGD_hook``, matrix_approximation_rank=1, error feedback and warm start on
    powersgd4   the same with rank 4
    terngrad    TernGrad-DDP, ``horovod_terngrad.ddp.register(model)`` at its defaults
    local       no DDP at all: every rank's forward/backward/step at once, then a barrier (the compute floor
                of a synchronous step where ranks share cores)

and, with ``--horovod fp16,terngrad`` (the default; ``--horovod ""`` skips them), Horovod's rows for the same
model, batch and cluster: examples/emulated_cluster_benchmark.py's cell (plain mpirun, one rank per host,
``Compression.fp16`` and TernGrad at its defaults), run right after the DDP one on a fresh cluster of the same
shape, its JSON under ``<out>/horovod/``.  They are separate processes run back to back, not interleaved
with the DDP rounds, so compare them with that in mind.

PowerSGD runs plain allreduce before ``start_powerSGD_iter`` (2 here); the warm-up steps (``--warmup``, at
least 3) take every configuration past it before anything is timed.  On gloo PowerSGD's buckets are exchanged
one after another (horovod_terngrad/operations/ddp_hooks.py explains why), which costs it overlap with backward.

A step is ``model(x).square().mean().backward(); opt.step()`` (SGD) on ``--batch`` samples per rank.  The
configurations take turns in ``--rounds`` rounds (one untimed step, then ``--steps`` timed steps each turn;
figures are medians over all rounds), so a slow spell of the shared machine lands on all of them.  bits/param:
what one rank hands to collectives per parameter per step (fp32 32, fp16 16; PowerSGD r·(n+m) fp32 values per
n x m matrix that it compresses and every 1-D tensor whole; TernGrad as counted by its stats, uncompressed
tensors at 32).  Results go to ``<out>/<model>-n<hosts>-<rate>.json`` and ``<out>/table.md``.

``python examples/ddp_benchmark.py worker ...`` is the part each rank runs (under torchrun).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DDP_TORCHRUN = os.path.join(ROOT, "launch", "ddp-torchrun")
PREFIX, SUBNET = "tgd", "10.78.0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulated_cluster_benchmark import cell_path, link_gbps, run_on_cluster, sweep  # noqa: E402 (shared)
from emulated_cluster_benchmark import run_case as horovod_cell  # noqa: E402
CONFIGS = {"fp32": ("DDP fp32", "none", {}), "fp16": ("DDP fp16_compress_hook", "fp16", {}),
           "powersgd1": ("DDP PowerSGD rank 1", "powersgd", {"powersgd_rank": 1}),
           "powersgd4": ("DDP PowerSGD rank 4", "powersgd", {"powersgd_rank": 4}),
           "terngrad": ("TernGrad-DDP (defaults)", "terngrad", {}),
           "terngrad-tgadamw": ("TernGrad-DDP, horovod_terngrad.optim.AdamW", "terngrad", {"optim": "tg-adamw"}),
           # each exchange named (the defaults' exchange="default" picks allgather up to 4 ranks or nodes,
           # requantized beyond)
           "terngrad-allgather": ("TernGrad-DDP exchange=allgather", "terngrad", {"exchange": "allgather"}),
           "terngrad-sharded": ("TernGrad-DDP exchange=sharded", "terngrad", {"exchange": "sharded"}),
           "terngrad-reternarized": ("TernGrad-DDP exchange=reternarized", "terngrad",
                                     {"exchange": "reternarized"}),
           "terngrad-requantized": ("TernGrad-DDP exchange=requantized", "terngrad", {"exchange": "requantized"}),
           "terngrad-requantized-tgadamw": ("TernGrad-DDP exchange=requantized, horovod_terngrad.optim.AdamW",
                                            "terngrad", {"exchange": "requantized", "optim": "tg-adamw"}),
           "terngrad-flat": ("TernGrad-DDP hierarchical=False", "terngrad", {"hierarchical": False}),
           "terngrad-flat-tgadamw": ("TernGrad-DDP hierarchical=False, horovod_terngrad.optim.AdamW", "terngrad",
                                     {"hierarchical": False, "optim": "tg-adamw"}),
           # the node-aware exchange's stages inside a node in bf16 or fp32, with horovod_terngrad.optim.AdamW
           "terngrad-bf16-tgadamw": ("TernGrad-DDP intra_node_dtype=bfloat16, horovod_terngrad.optim.AdamW",
                                     "terngrad", {"intra_node_dtype": "bfloat16", "optim": "tg-adamw"}),
           "terngrad-fp32intra-tgadamw": ("TernGrad-DDP intra_node_dtype=float32, horovod_terngrad.optim.AdamW",
                                          "terngrad", {"intra_node_dtype": "float32", "optim": "tg-adamw"}),
           # OwnerStepOptimizer (AdamW at its defaults): DDP hands each bucket back unaveraged
           # (local_gradients_hook) and the optimizer's step exchanges ternary gradients and weights
           "owner-step": ("TernGrad OwnerStepOptimizer (AdamW), DDP + local_gradients_hook", "owner-step", {}),
           "local": ("local compute, no DDP", None, {})}
POWERSGD_START = 2


# -- the worker (one rank) ---------------------------------------------------------------------------------------
def worker(argv):
    p = argparse.ArgumentParser(prog="ddp_benchmark.py worker")
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--configs", default="fp32,fp16,powersgd1,powersgd4,terngrad")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--optim", default="sgd", choices=("sgd", "adamw"))
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--profile", action="store_true", help="TernGrad's step broken down (see profile)")
    p.add_argument("--link-counters", default="", metavar="IFACE",
                   help="bytes through this interface of each host per timed step, per configuration")
    p.add_argument("--json", default="")
    sys.path.insert(0, ROOT)
    from horovod_terngrad.operations.devices import add_device_argument, setup_device
    add_device_argument(p)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from horovod_terngrad.operations import ddp_hooks, models
    from horovod_terngrad.operations.bench import _iface_bytes, link_bytes_per_host
    torch.set_num_threads(1)
    placement = setup_device(args.device)          # cuda:LOCAL_RANK with NCCL, or the CPU with gloo
    dist.init_process_group(placement.backend)

    def sync():           # on a GPU, a step's phases end when their kernels do, not when they are launched
        if placement.is_cuda:
            torch.cuda.synchronize(placement.device)

    rank, size = dist.get_rank(), dist.get_world_size()
    warmup = max(args.warmup, POWERSGD_START + 1)
    setups = []
    for key in args.configs.split(","):
        label, hook, kw = CONFIGS[key]
        kw = dict(kw)
        row_optim = kw.pop("optim", None)     # a row's own Adam (terngrad-tgadamw), only with --optim adamw
        optim = row_optim if row_optim and args.optim == "adamw" else args.optim
        module, x = models.make(args.model, args.batch, image=args.image, context=args.context)
        module, x = module.to(placement.device), x.to(placement.device)
        model = module if hook is None else DDP(module, device_ids=placement.device_ids,
                                                **({} if args.bucket_cap_mb is None else
                                                   {"bucket_cap_mb": args.bucket_cap_mb}))
        nparams = sum(q.numel() for q in module.parameters())
        bits = {"none": 32.0, "fp16": 16.0}.get(hook)
        if hook == "owner-step":
            from horovod_terngrad.ddp import local_gradients_hook
            from horovod_terngrad.optim import OwnerStepOptimizer
            model.register_comm_hook(None, local_gradients_hook)
            state, opt = None, OwnerStepOptimizer(module.named_parameters(), collectives="torch", lr=1e-4)
        else:
            state = None if hook is None else ddp_hooks.install(model, hook, powersgd_start=POWERSGD_START, **kw)
            if hook == "powersgd":
                bits = ddp_hooks.powersgd_bits(module, kw["powersgd_rank"])
            opt = make_optimizer(optim, model)
        setups.append({"key": key, "label": label, "hook": hook, "model": model, "opt": opt, "x": x, "marks": [],
                       "state": state, "times": [], "bits": bits, "nparams": nparams, "link": [0, 0]})
    described = f"{args.model} ({models.describe(setups[0]['model'])})"

    def one_step(su, timed=True):
        t = time.perf_counter()
        su["opt"].zero_grad()
        su["model"](su["x"]).square().mean().backward()
        sync()
        t_backward = time.perf_counter()
        su["opt"].step()
        sync()
        if su["hook"] is None:
            # the local row is the floor of a synchronous step: it ends when every rank's compute has, as a DDP
            # step does.  Unsynchronized, rank 0's steps measured its own share of the shared cores, which swung
            # from 2x one rank's compute alone to below it (1291 / 837 / 618 ms by round, compute alone 633 ms)
            dist.barrier()
        if timed:
            su["times"].append(time.perf_counter() - t)
            su["marks"].append((t, t_backward, time.perf_counter()))

    for su in setups:
        for _ in range(warmup):
            one_step(su, timed=False)
        dist.barrier()
    tg_before = {}
    for r in range(args.rounds):
        for su in setups:
            one_step(su, timed=False)
            if su["hook"] == "terngrad" and su["key"] not in tg_before:
                st = su["state"]
                tg_before[su["key"]] = (st.stats.payload_bytes_sent + st.stats.handshake_bytes_sent,
                                        st.state.uncompressed_elements, st.stats.elements, len(su["times"]))
            if su["hook"] == "owner-step" and su["key"] not in tg_before:
                ex = su["opt"].exchange
                tg_before[su["key"]] = (ex.bytes_received, ex.codec_s, su["opt"].steps)
            if args.profile and su["hook"] == "terngrad" and su["state"].trace is None:
                su["state"].trace = []
            if args.link_counters:        # every rank at the start line, so the counters see only timed steps
                dist.barrier()
                before = _iface_bytes(args.link_counters)
            for _ in range(args.steps):
                one_step(su)
            dist.barrier()
            if args.link_counters:
                su["link"] = [a + b1 - b0 for a, b0, b1 in zip(su["link"], before, _iface_bytes(args.link_counters))]

    def med(v):
        return sorted(v)[len(v) // 2]

    hosts = [None] * size
    if args.link_counters:
        import socket
        dist.all_gather_object(hosts, socket.gethostname())
    rows = []
    for su in setups:
        if args.link_counters:           # {host: [sent, received] bytes per step}, the first rank of each host
            deltas = [None] * size
            dist.all_gather_object(deltas, su["link"])
            su["link_per_host"] = link_bytes_per_host(hosts, deltas, args.rounds * args.steps)
        row = {"config": su["key"], "label": su["label"], "step_ms": 1000 * med(su["times"]),
               "step_ms_by_round": [1000 * med(su["times"][i * args.steps:(i + 1) * args.steps])
                                    for i in range(args.rounds)], "bits_per_param": su["bits"]}
        if su.get("link_per_host"):
            row["link_bytes_per_step"] = su["link_per_host"]
        if su.get("marks"):
            row["forward_backward_ms"] = 1000 * med([b - a for a, b, _ in su["marks"]])
            row["optimizer_ms"] = 1000 * med([c - b for _, b, c in su["marks"]])
        if su["hook"] == "owner-step":
            row.update(owner_step_row(su["opt"], tg_before[su["key"]]))
        if su["hook"] == "terngrad":
            st = su["state"]
            sent0, unc0, el0, _ = tg_before[su["key"]]
            steps = args.rounds * (args.steps + 1) - 1     # exchanges counted since the first snapshot
            sent = st.stats.payload_bytes_sent + st.stats.handshake_bytes_sent - sent0
            unc = st.state.uncompressed_elements - unc0
            el = st.stats.elements - el0
            row["bits_per_param"] = (8.0 * sent + 32.0 * unc) / (steps * su["nparams"])
            row["terngrad_bits_per_element"] = 8.0 * sent / max(1, el)
            row["compressed_fraction"] = el / max(1, el + unc)
            row["payload_bytes_per_step"] = sent / steps
            if st.trace is not None:
                row["profile"] = profile(st.trace, su["marks"])
            st.close()
        rows.append(row)
    if rank == 0:
        print(f"DDP step benchmark: {described}, batch {args.batch}, {size} ranks ({placement.backend}), median of {args.steps} "
              f"steps x {args.rounds} interleaved rounds", flush=True)
        for row in rows:
            print(f"  {row['label']:26s} {row['step_ms']:8.1f} ms/step  rounds: "
                  f"{', '.join(f'{v:.0f}' for v in row['step_ms_by_round'])}  "
                  f"(forward+backward {row['forward_backward_ms']:.0f}, optimizer {row['optimizer_ms']:.0f})  "
                  + (f"{row['bits_per_param']:.2f} bits/param" if row["bits_per_param"] is not None else ""),
                  flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "model": args.model, "described": described, "batch": args.batch,
                           "params": setups[0]["nparams"], "optim": args.optim,
                           "steps": args.steps, "rounds": args.rounds, "rows": rows}, f, indent=1)
        if args.profile:
            for row in rows:
                if "profile" in row:
                    print("  TernGrad-DDP's step, ms (median over timed steps): " + ", ".join(
                        f"{k} {v:.1f}" for k, v in row["profile"].items() if isinstance(v, float)), flush=True)
                    print("\n".join(bucket_table(row["profile"]["per_bucket"])), flush=True)
    dist.destroy_process_group()


def owner_step_row(opt, before: tuple) -> dict:
    """An owner-step row's figures since ``before`` (bytes received, codec seconds, steps at the first timed
    round): payload bits received per ternarized element per step (both stages), bits per parameter with the
    full-precision tensors at 32, and the codec's ms per step (its own clock: encode, decode, the weights'
    rounding and application)."""
    ex = opt.exchange
    steps = max(1, opt.steps - before[2])
    tern = sum(lay.numel for lay in ex.layout)
    total = sum(p.numel() for p in opt.params)
    per_element = 8.0 * (ex.bytes_received - before[0]) / (steps * max(1, tern))
    return {"terngrad_bits_per_element": per_element, "compressed_fraction": tern / max(1, total),
            "bits_per_param": (per_element * tern + 32.0 * (total - tern)) / max(1, total),
            "codec_ms": 1000 * (ex.codec_s - before[1]) / steps}


def make_optimizer(kind: str, model):
    """SGD, torch's AdamW, or (``tg-adamw``, the ``terngrad-tgadamw`` row with ``--optim adamw``) TernGrad's
    AdamW, horovod_terngrad.optim.AdamW, at its defaults (torch's AdamW, bit for bit, where nothing is
    ternarized)."""
    import torch
    if kind == "tg-adamw":
        from horovod_terngrad.optim import AdamW
        return AdamW(model.parameters(), lr=1e-4)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4)
    return torch.optim.SGD(model.parameters(), lr=1e-4)


def profile(trace: list, marks: list) -> dict:
    """TernGrad-DDP's step broken down from the hook's trace (``TernGradState.trace``) and the main thread's
    marks (step begin, backward returned, optimizer step done), medians over the timed steps, in ms:

    * ``forward_backward``: step begin to the last bucket handed to the hook (backward's compute, slowed by
      whatever the worker thread takes from this rank's core);
    * ``tail``: last bucket handed over to backward's return: DDP waiting for the exchanges still in flight;
    * ``optimizer``: the optimizer's step;
    * on the worker thread: ``encode`` (the start spans: prepare, ternarize and pack, launch), ``codec``
      (the engine's codec_s: encode + decode), ``wait`` (blocked on collectives: payloads and the
      full-precision allreduce), ``copies`` (averages copied back into DDP's bucket), ``finish`` (whole finish
      spans), ``worker_busy`` (start + finish spans), ``worker_idle_in_step`` (the step's wall time the
      worker spent neither starting nor finishing: waiting for DDP's next bucket)."""
    def med(v):
        v = sorted(v)
        return v[len(v) // 2] if v else 0.0

    per = {k: [] for k in ("step", "forward_backward", "tail", "optimizer", "encode", "codec", "wait", "copies",
                           "finish", "worker_busy", "worker_idle_in_step", "buckets")}
    for t0, t_bwd, t_end in marks:
        ev = [e for e in trace if t0 <= e[2] <= t_end]
        hooks = [e[2] for e in ev if e[0] == "hook"]
        spans = [e for e in ev if e[0] in ("start", "finish")]
        if not hooks:
            continue
        busy = sum(e[3] - e[2] for e in spans)
        per["step"].append(t_end - t0)
        per["forward_backward"].append(max(hooks) - t0)
        per["tail"].append(t_bwd - max(hooks))
        per["optimizer"].append(t_end - t_bwd)
        per["encode"].append(sum(e[3] - e[2] for e in spans if e[0] == "start"))
        per["finish"].append(sum(e[3] - e[2] for e in spans if e[0] == "finish"))
        per["codec"].append(sum(e[4] for e in spans))
        per["wait"].append(sum(e[5] for e in spans) + sum(e[3] - e[2] for e in ev if e[0] == "plain"))
        per["copies"].append(sum(e[3] - e[2] for e in ev if e[0] == "copy"))
        per["worker_busy"].append(busy)
        per["worker_idle_in_step"].append((t_bwd - t0) - busy)
        per["buckets"].append(len(hooks))
    out = {k: 1000 * med(v) for k, v in per.items() if k != "buckets"}
    out["buckets"] = int(med(per["buckets"]))
    # each timed step's own split (medians of the parts need not add up to the median step)
    out["by_step"] = {k: [1000 * x for x in per[k]] for k in ("step", "forward_backward", "tail", "optimizer")}
    out["per_bucket"] = per_bucket(trace, marks)
    t0, t_bwd, t_end = marks[-1]       # the last timed step's spans, in ms from its start, for reading
    out["last_step"] = {"backward_returned": 1000 * (t_bwd - t0), "end": 1000 * (t_end - t0),
                        "spans": [(e[0], e[1], round(1000 * (e[2] - t0), 1), round(1000 * (e[3] - t0), 1),
                                   round(1000 * e[4], 1), round(1000 * e[5], 1))
                                  for e in trace if t0 <= e[2] <= t_end]}
    return out


BUCKET_FIELDS = ("handed_over", "start", "codec", "wait", "write_back", "finish", "done")


def per_bucket(trace: list, marks: list) -> list:
    """The hook's host time per bucket and timed step, from the same trace, in ms: one entry per bucket index
    (DDP's buckets after its rebuild, the same every timed step), with its elements, the medians (``ms``) and
    the values of every timed step (``by_step``, in step order):

    * ``handed_over``: when DDP handed the bucket over, from the step's begin;
    * ``start``: its start span (prepare, ternarize, pack, launch);
    * ``codec``: the engine's codec seconds in its start and finish spans (encode + decode);
    * ``wait``: blocked on its collectives (payloads, the full-precision allreduce);
    * ``write_back``: its finish span less codec and wait (copies into DDP's bucket, on_nonfinite, futures);
    * ``finish``: its finish span;
    * ``done``: from handed over to its finish's end (its average in DDP's bucket)."""
    steps: dict = {}             # bucket index -> {field: [ms per step]}
    elements: dict = {}
    for t0, _, t_end in marks:
        ev = [e for e in trace if t0 <= e[2] <= t_end]
        for e in ev:
            if e[0] == "hook":
                elements[e[1]] = e[6] if len(e) > 6 else None
        for index in sorted({e[1] for e in ev if e[0] == "hook"}):
            mine = [e for e in ev if e[1] == index]
            hook = next(e[2] for e in mine if e[0] == "hook")
            spans = [e for e in mine if e[0] in ("start", "finish")]
            finish = [e for e in mine if e[0] == "finish"]
            waits = sum(e[5] for e in spans) + sum(e[3] - e[2] for e in mine if e[0] == "plain")
            fin_s = sum(e[3] - e[2] for e in finish)
            fin_wait = sum(e[5] for e in finish) + sum(e[3] - e[2] for e in mine if e[0] == "plain")
            values = {"handed_over": hook - t0, "start": sum(e[3] - e[2] for e in mine if e[0] == "start"),
                      "codec": sum(e[4] for e in spans), "wait": waits,
                      "write_back": fin_s - sum(e[4] for e in finish) - fin_wait, "finish": fin_s,
                      "done": max((e[3] for e in finish), default=hook) - hook}
            row = steps.setdefault(index, {k: [] for k in BUCKET_FIELDS})
            for k in BUCKET_FIELDS:
                row[k].append(round(1000 * values[k], 2))
    return [{"bucket": i, "elements": elements.get(i), "ms": {k: sorted(v)[len(v) // 2] for k, v in row.items()},
             "by_step": row} for i, row in sorted(steps.items())]


def bucket_table(buckets: list) -> list:
    """The per-bucket medians (``per_bucket``) as printed lines."""
    lines = ["  TernGrad-DDP's buckets, ms (median over timed steps; handed over: from the step's begin; done: from "
             "handed over to its average in DDP's bucket):",
             f"  {'bucket':>6s} {'elements':>10s} " + " ".join(f"{k.replace('_', ' '):>11s}" for k in BUCKET_FIELDS)]
    for b in buckets:
        n = f"{b['elements']:,}" if b["elements"] is not None else "?"
        lines.append(f"  {b['bucket']:>6d} {n:>10s} " + " ".join(f"{b['ms'][k]:11.1f}" for k in BUCKET_FIELDS))
    return lines


# -- the driver ----------------------------------------------------------------------------------------------------
def compute_alone(model: str, args) -> dict:
    """One rank's compute alone with this run's optimizer (``bench compute``: one process, one thread, no DDP):
    the regime's yardstick and the limit's compute."""
    import subprocess
    p = subprocess.run([sys.executable, "-m", "horovod_terngrad.operations.bench", "compute", "--model", model,
                        "--batch", str(args.batch), "--image", str(args.image), "--context", str(args.context),
                        "--layers", "4", "--width", "2500",      # the worker's mlp: models.make's defaults
                        "--optim", args.optim], capture_output=True, text=True, check=True, timeout=1800, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_case(model: str, hosts: int, rate: str, args) -> dict:
    """One cell.  ``rate``: a tc rate, ``none``, or ``regime<RATIO>``: the link at which fp32's ring payload
    per host link takes RATIO x one rank's compute alone (measured here first, with the same optimizer)."""
    from emulated_cluster_benchmark import regime_rate
    G = args.ranks_per_host
    out = cell_path(args.out, model, hosts, rate, args.tag, G)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    regime, tc = None, rate
    if rate.startswith("regime"):
        measured = compute_alone(model, args)
        regime = regime_rate(float(rate[len("regime"):]), measured["compute_ms"] / 1000, measured["params"],
                             hosts * G, G)
        tc = regime["rate"]
        print(f"regime {regime['ratio']:g}: compute alone {regime['compute_alone_ms']:.1f} ms; fp32's ring payload "
              f"{regime['bytes_per_host'] / 1e6:.1f} MB per host link -> {regime['gbps']:.3f} Gbit/s ({tc})",
              flush=True)
    prefix = getattr(args, "prefix", PREFIX)
    cmd = [DDP_TORCHRUN, "--netns", prefix, "--nproc", str(G), "--port", "29613", "--", os.path.abspath(__file__),
           "worker", "--model", model, "--batch", str(args.batch), "--image", str(args.image),
           "--context", str(args.context), "--configs", args.configs, "--steps", str(args.steps),
           "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--optim", args.optim, "--json", out,
           "--link-counters", "eth0", "--device", getattr(args, "device", "auto")]
    if args.profile:
        cmd.append("--profile")
    if args.bucket_cap_mb is not None:
        cmd += ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    run_on_cluster(hosts, tc, prefix, SUBNET, cmd, args.timeout, f"{model} N={hosts}x{G} {rate}", env=env)
    with open(out) as f:
        res = json.load(f)
    res.update(rate=rate, hosts=hosts, ranks_per_host=G, context=args.context, image=args.image, optim=args.optim,
               regime=regime)
    if args.horovod:
        res["rows"] += horovod_rows(model, hosts, rate, args)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return res


def horovod_rows(model: str, hosts: int, rate: str, args) -> list:
    """Horovod's fp16 and TernGrad on the same model, batch and cluster shape (emulated_cluster_benchmark's
    cell, no calibration rows needed beyond its own), as rows of this table.  bits/param: fp16 16; TernGrad
    its payload bits per ternarized element over those elements, plus 32 for the tensors its policy leaves
    at full precision (min_numel)."""
    from horovod_terngrad.operations.bench import step_config
    hargs = argparse.Namespace(out=os.path.join(args.out, "horovod"), tag=args.tag, configs=args.horovod,
                               batch=args.batch, image=args.image, context=args.context, layers=4, width=2500,
                               steps=args.steps, rounds=args.rounds, warmup=args.warmup, timeout=args.timeout,
                               ranks_per_host=getattr(args, "ranks_per_host", 1),
                               prefix=getattr(args, "prefix", PREFIX))
    os.makedirs(hargs.out, exist_ok=True)
    cell = horovod_cell(model, hosts, rate, hargs)
    rows = []
    for r in cell["rows"]:
        key = r["config"]
        bits = 16.0 if key == "fp16" else 32.0 if key == "fp32" else None
        cfg = step_config(key)
        if cfg is not None:
            small = sum(n for n, name in zip(cell["sizes"], cell["names"]) if not cfg.compresses(name, n))
            bits = (r["bits_per_element"] * (cell["params"] - small) + 32.0 * small) / cell["params"]
        rows.append({"config": f"horovod-{key}", "label": f"Horovod {r['label']}", "step_ms": r["step_ms"],
                     "step_ms_by_round": r["step_ms_by_round"], "bits_per_param": bits,
                     **({"link_bytes_per_step": r["link_bytes_per_step"]} if r.get("link_bytes_per_step") else {}),
                     **({"codec_ms": r["codec_ms"]} if "codec_ms" in r else {})})
    return rows


def link_bps(res: dict):
    """The cell's link rate in bit/s: the regime's, or its tc rate (``link_gbps``); None unshaped."""
    if res.get("regime"):
        return res["regime"]["gbps"] * 1e9
    gbps = link_gbps(res)
    return gbps * 1e9 if gbps else None


def wire_bytes(row: dict, params: int, ranks: int):
    """Bytes one host's link carries each way per step for a row: a ring allreduce of what it hands over
    (2(N-1)/N of it), except TernGrad's allgather, which receives N-1 payloads (its full-precision tensors
    still ring-allreduced)."""
    bits = row.get("bits_per_param")
    if bits is None or row["config"].startswith("horovod"):
        return None
    ring = 2 * (ranks - 1) / ranks
    if "payload_bytes_per_step" in row:
        plain = params * (1 - row["compressed_fraction"]) * 4 if "compressed_fraction" in row else 0.0
        return (ranks - 1) * row["payload_bytes_per_step"] + ring * plain
    return ring * bits / 8 * params


def link_bytes(row: dict):
    """The most bytes any host's link carried in one direction per step (measured: ``link_bytes_per_step``),
    or None where the row was not counted."""
    per_host = row.get("link_bytes_per_step")
    return max(max(v) for v in per_host.values()) if per_host else None


def limit_terms(res: dict, row: dict):
    """(codec ms, wire ms) of a row's limit: its codec clock (TernGrad's profile, or the configuration's own
    ``codec_ms``; 0 without one) and the bytes its busiest host link carried one way per step (measured; else its
    ring payload) at the link rate; None without a link rate or bytes."""
    bps = link_bps(res)
    params = res.get("params") or (res["regime"]["params"] if res.get("regime") else None)
    nbytes = link_bytes(row)
    if nbytes is None and params:
        nbytes = wire_bytes(row, params, res["ranks"])
    if not bps or nbytes is None:
        return None
    return row.get("profile", {}).get("codec", row.get("codec_ms", 0.0)), 1000 * 8 * nbytes / bps


def rows(res: dict, rate: str) -> list[str]:
    """Table rows; with a known link rate and a compute alone (the regime's, or the cell's local row), each
    row's limit: compute alone + codec (TernGrad's, when profiled, or Horovod's own clock) + the bytes its
    busiest host link carried in one direction per step (measured on eth0; else its ring payload) at link rate.
    With a ``local`` row, a second limit puts that row's step (every rank computing at once, no DDP: what the
    emulated hosts' shared cores allow) in place of compute alone."""
    by = {r["config"]: r for r in res["rows"]}
    fp16, fp32 = by.get("fp16", {}).get("step_ms"), by.get("fp32", {}).get("step_ms")
    alone = res["regime"]["compute_alone_ms"] if res.get("regime") else by.get("local", {}).get("step_ms")
    shared = by.get("local", {}).get("step_ms")
    lines = []
    for r in res["rows"]:
        bits = f"{r['bits_per_param']:.2f}" if r.get("bits_per_param") is not None else ""
        per_host = r.get("link_bytes_per_step")
        link = ", ".join(f"{h.split('-')[-1]} {v[0] / 1e6:.1f} / {v[1] / 1e6:.1f}" for h, v in sorted(per_host.items())) \
            if per_host else ""
        cells = [res["model"], f"{res.get('hosts', res['ranks'])} x {res.get('ranks_per_host', 1)}", rate, r["label"],
                 f"{r['step_ms']:.0f}", ", ".join(f"{x:.0f}" for x in r["step_ms_by_round"]),
                 f"{r['step_ms'] / fp32:.2f}x" if fp32 else "", f"{r['step_ms'] / fp16:.2f}x" if fp16 else "", bits,
                 link]
        terms = limit_terms(res, r)
        if alone and terms is not None and r["config"] != "local":
            codec, wire = terms
            limit = alone + codec + wire
            cells += [f"{limit:.0f} = {alone:.0f} + {codec:.0f} + {wire:.0f}", f"{r['step_ms'] / limit:.2f}x"]
            if shared:
                cells += [f"{shared + codec + wire:.0f}", f"{r['step_ms'] / (shared + codec + wire):.2f}x"]
            else:
                cells += ["", ""]
        else:
            cells += ["", "", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def saved_cells(out: str, tag: str = "") -> list:
    """Every cell of this tag saved in ``out`` (this run's and earlier runs' into the same folder), by model,
    N and link: the plot shows them all."""
    import glob
    cells = []
    for path in glob.glob(os.path.join(os.path.abspath(out), "*.json")):
        stem = os.path.basename(path)[:-5]
        if stem.endswith(f"-{tag}") if tag else stem.count("-") == 2:
            with open(path) as f:
                cells.append(json.load(f))
    return sorted((c for c in cells if "rate" in c), key=lambda c: (c["model"], c["ranks"], c["rate"]))


def plot(results: list, path: str) -> list:
    """Grouped bars: ms/step of every configuration per cell (model, N, link); returns the table's footer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = []
    for res in results:
        keys += [r["config"] for r in res["rows"] if r["config"] not in keys]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(results)), 4.2))
    width = 0.8 / len(keys)
    for k, key in enumerate(keys):
        xs, ys, label = [], [], key
        for i, res in enumerate(results):
            row = next((r for r in res["rows"] if r["config"] == key), None)
            if row is not None:
                xs.append(i + (k - (len(keys) - 1) / 2) * width)
                ys.append(row["step_ms"])
                label = row["label"]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([f"{r['model']}\nN={r['ranks']} {r.get('rate', '')}" for r in results])
    ax.set_ylabel("ms per step (median)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("DDP hooks and Horovod on the emulated cluster")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return ["", f"Plot: `{os.path.relpath(path, ROOT)}`"]


HEADER = ["| model | hosts x ranks | link | configuration | ms/step | by round | time vs fp32 | time vs fp16 "
          "| bits/param sent | MB/step through each host link (sent / received) "
          "| limit ms = compute alone + codec + wire | step / limit "
          "| limit with shared cores (local row + codec + wire) | step / that limit |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,resnet50,transformer")
    p.add_argument("--hosts", default="2")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="torchrun --nproc_per_node on each emulated host (ranks of a host talk through lo)")
    p.add_argument("--rates", default="1gbit")
    p.add_argument("--configs", default="fp32,fp16,powersgd1,powersgd4,terngrad,local")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image", type=int, default=64, help="resnet50: input height and width")
    p.add_argument("--context", type=int, default=64, help="transformer: tokens per sample")
    p.add_argument("--horovod", default="fp16,terngrad", help="Horovod rows (bench.STEP_CONFIGS keys); '' for none")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--regime", default="", metavar="RATIO[,RATIO]",
                   help="calibrated regime instead of --rates: links at which fp32's ring payload per host link "
                        "takes RATIO x one rank's compute alone (8: the paper's Ethernet regime)")
    p.add_argument("--optim", default="sgd", choices=("sgd", "adamw"))
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb for every DDP row "
                   "(default: DDP's own, 25)")
    p.add_argument("--profile", action="store_true",
                   help="break TernGrad-DDP's step down (forward/backward, tail, optimizer; the worker's encode, "
                        "wait, copies) into the cell's JSON and docs")
    p.add_argument("--tag", default="", help="suffix of the cells' file names (and of the plot)")
    p.add_argument("--prefix", default=PREFIX, help="name prefix of the emulated hosts' namespaces (two benchmarks "
                   "at once need two)")
    p.add_argument("--out", default="docs/ddp")
    from horovod_terngrad.operations.devices import add_device_argument
    add_device_argument(p)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("ddp_benchmark: needs root (network namespaces)")
    if args.regime:
        args.rates = ",".join(f"regime{float(r):g}" for r in args.regime.split(","))
    plot_path = os.path.join(os.path.abspath(args.out), "steps" + (f"-{args.tag}" if args.tag else "") + ".png")
    sweep(args, run_case, rows, HEADER, "examples/ddp_benchmark.py", argv,
          footer=lambda results: plot(saved_cells(args.out, args.tag), plot_path))

if __name__ == "__main__":
    main()
