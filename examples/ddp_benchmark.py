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
    local       no DDP at all: this rank's forward/backward/step alone (the compute floor)

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
from emulated_cluster_benchmark import cell_path, run_on_cluster, sweep  # noqa: E402 (cluster and table, shared)
from emulated_cluster_benchmark import run_case as horovod_cell  # noqa: E402
CONFIGS = {"fp32": ("DDP fp32", "none", {}), "fp16": ("DDP fp16_compress_hook", "fp16", {}),
           "powersgd1": ("DDP PowerSGD rank 1", "powersgd", {"powersgd_rank": 1}),
           "powersgd4": ("DDP PowerSGD rank 4", "powersgd", {"powersgd_rank": 4}),
           "terngrad": ("TernGrad-DDP (defaults)", "terngrad", {}),
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
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from horovod_terngrad.operations import ddp_hooks, models
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    warmup = max(args.warmup, POWERSGD_START + 1)
    setups = []
    for key in args.configs.split(","):
        label, hook, kw = CONFIGS[key]
        module, x = models.make(args.model, args.batch, image=args.image, context=args.context)
        model = module if hook is None else DDP(module)
        state = None if hook is None else ddp_hooks.install(model, hook, powersgd_start=POWERSGD_START, **kw)
        nparams = sum(q.numel() for q in module.parameters())
        bits = {"none": 32.0, "fp16": 16.0}.get(hook)
        if hook == "powersgd":
            bits = ddp_hooks.powersgd_bits(module, kw["powersgd_rank"])
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        setups.append({"key": key, "label": label, "hook": hook, "model": model, "opt": opt, "x": x,
                       "state": state, "times": [], "bits": bits, "nparams": nparams})
    described = f"{args.model} ({models.describe(setups[0]['model'])})"

    def one_step(su, timed=True):
        t = time.perf_counter()
        su["opt"].zero_grad()
        su["model"](su["x"]).square().mean().backward()
        su["opt"].step()
        if timed:
            su["times"].append(time.perf_counter() - t)

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
            for _ in range(args.steps):
                one_step(su)
            dist.barrier()

    def med(v):
        return sorted(v)[len(v) // 2]

    rows = []
    for su in setups:
        row = {"config": su["key"], "label": su["label"], "step_ms": 1000 * med(su["times"]),
               "step_ms_by_round": [1000 * med(su["times"][i * args.steps:(i + 1) * args.steps])
                                    for i in range(args.rounds)], "bits_per_param": su["bits"]}
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
            st.close()
        rows.append(row)
    if rank == 0:
        print(f"DDP step benchmark: {described}, batch {args.batch}, {size} ranks (gloo), median of {args.steps} "
              f"steps x {args.rounds} interleaved rounds", flush=True)
        for row in rows:
            print(f"  {row['label']:26s} {row['step_ms']:8.1f} ms/step  rounds: "
                  f"{', '.join(f'{v:.0f}' for v in row['step_ms_by_round'])}  "
                  + (f"{row['bits_per_param']:.2f} bits/param" if row["bits_per_param"] is not None else ""),
                  flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "model": args.model, "described": described, "batch": args.batch,
                           "steps": args.steps, "rounds": args.rounds, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------------------------
def run_case(model: str, hosts: int, rate: str, args) -> dict:
    out = cell_path(args.out, model, hosts, rate, args.tag)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    cmd = [DDP_TORCHRUN, "--netns", PREFIX, "--nproc", "1", "--port", "29613", "--", os.path.abspath(__file__),
           "worker", "--model", model, "--batch", str(args.batch), "--image", str(args.image),
           "--context", str(args.context), "--configs", args.configs, "--steps", str(args.steps),
           "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--json", out]
    run_on_cluster(hosts, rate, PREFIX, SUBNET, cmd, args.timeout, f"{model} N={hosts} {rate}", env=env)
    with open(out) as f:
        res = json.load(f)
    res.update(rate=rate, hosts=hosts, context=args.context, image=args.image)
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
                               steps=args.steps, rounds=args.rounds, warmup=args.warmup, timeout=args.timeout)
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
                     "step_ms_by_round": r["step_ms_by_round"], "bits_per_param": bits})
    return rows


def rows(res: dict, rate: str) -> list[str]:
    by = {r["config"]: r for r in res["rows"]}
    fp16, fp32 = by.get("fp16", {}).get("step_ms"), by.get("fp32", {}).get("step_ms")
    lines = []
    for r in res["rows"]:
        bits = f"{r['bits_per_param']:.2f}" if r.get("bits_per_param") is not None else ""
        cells = [res["model"], str(res["ranks"]), rate, r["label"], f"{r['step_ms']:.0f}",
                 ", ".join(f"{x:.0f}" for x in r["step_ms_by_round"]),
                 f"{r['step_ms'] / fp32:.2f}x" if fp32 else "", f"{r['step_ms'] / fp16:.2f}x" if fp16 else "", bits]
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


HEADER = ["| model | N | link | configuration | ms/step | by round | time vs fp32 | time vs fp16 | bits/param sent |",
          "|---|---|---|---|---|---|---|---|---|"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,resnet50,transformer")
    p.add_argument("--hosts", default="2")
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
    p.add_argument("--tag", default="", help="suffix of the cells' file names (and of the plot)")
    p.add_argument("--out", default="docs/ddp")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("ddp_benchmark: needs root (network namespaces)")
    plot_path = os.path.join(os.path.abspath(args.out), "steps" + (f"-{args.tag}" if args.tag else "") + ".png")
    sweep(args, run_case, rows, HEADER, "examples/ddp_benchmark.py", argv,
          footer=lambda results: plot(saved_cells(args.out, args.tag), plot_path))

if __name__ == "__main__":
    main()
