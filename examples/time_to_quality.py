"""Time to quality on DDP in the calibrated regime: the training wall time each method takes until its held-out
loss reaches the final held-out loss of plain fp32 DDP with torch's AdamW.  Bits are a means;
users pay for hours.  Needs root and iproute2 (launch/netns-cluster.sh).

    .venv/bin/python examples/time_to_quality.py --ratio 8 --steps 1000 --out docs/time_to_quality

The model and recipe are examples/transformers_lm.py's as the Adam study ran them (docs/adam/run_lm.sh): GPT-2
4 x 128 (``--n-layer``) from a GPT2Config, byte vocabulary, Python's reference docs (every 20th 4 KB block held
out), ``--recipe nanogpt`` (16 sequences of 64 bytes per rank, warm-up and cosine decay, clip 1.0), one thread
per rank, the same ``--seed`` for every method.  Methods (``--methods``, in this order by default):

    fp32        DDP without a hook (fp32 allreduce), torch.optim.AdamW      --compression none --optim adamw
    fp16        DDP's fp16_compress_hook, torch.optim.AdamW                 --compression fp16 --optim adamw
    powersgd4   DDP's PowerSGD, rank 4, torch.optim.AdamW                   --compression powersgd --powersgd-rank 4
    terngrad    TernGrad-DDP at its defaults, horovod_terngrad.optim.AdamW  --compression terngrad --optim tg-adamw

Regime (``--ratio``, 8 = the paper's Ethernet regime): first one rank's compute alone is measured for this model,
batch and optimizer (``compute-alone``: one process, OMP_NUM_THREADS=1, no torch.distributed; the training step
of transformers_lm.py, median of ``--compute-steps`` steps after 3 untimed ones), then the link rate is chosen
so that fp32's ring payload per host link takes RATIO times that compute (emulated_cluster_benchmark's
``regime_rate``, 2 hosts x 1 rank: 2(N-1)/N x 4 bytes x parameters each way).  The regime is saved in
``<out>/regime.json`` and reused by later invocations into the same ``--out``, so a resumed sweep runs every
method at the same rate.  One 2-host emulated cluster at that rate is brought up for the methods that still
have to run, and they run one after another (launch/ddp-torchrun --netns: one torchrun per emulated host, gloo
over eth0).

Every run evaluates the held-out loss every ``--eval-every`` steps and after the last one (transformers_lm.py
``--eval-every``: every rank evaluates, and the evaluations' own time is left out of ``train_s``).  The target is
fp32's final held-out loss; a method "reaches" it at the first evaluation whose held-out loss is <= the target
(no interpolation between evaluations; fp32 reaches it at its last evaluation at the latest), and its time to
quality is that evaluation's ``train_s``.  "never": no evaluation of the run got there.  The speed-up of a row
is the time to quality of the fastest other method that reaches the target divided by the row's own.  The goal
of the benchmark: TernGrad reaches the target first, at least 1.5x sooner than the best of the others.

Results: ``<out>/<method>.json`` (transformers_lm.py's result with its ``curve``, plus the method and the regime)
and ``<out>/<method>.log``; a method whose JSON exists is skipped unless ``--force`` (which also measures the
regime anew).  The table (per method: ms per step = training wall time / steps, final held-out loss, the target,
the first evaluation at or below it and its training time, the speed-up; above it the regime) is printed and
appended to ``<out>/table.md`` with the command line.  ``--table-only`` recomputes it from the saved JSONs.

``python examples/time_to_quality.py compute-alone ...`` is the compute-alone measurement on its own.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DDP_TORCHRUN = os.path.join(ROOT, "launch", "ddp-torchrun")
LM = os.path.join(HERE, "transformers_lm.py")
PREFIX, SUBNET, PORT = "tgq", "10.88.0", 29671
HOSTS = 2
GOAL = 1.5
# key: (label, transformers_lm.py flags)
METHODS = {"fp32": ("DDP fp32 (no hook), torch AdamW", ["--compression", "none", "--optim", "adamw"]),
           "fp16": ("DDP fp16_compress_hook, torch AdamW", ["--compression", "fp16", "--optim", "adamw"]),
           "powersgd4": ("DDP PowerSGD rank 4, torch AdamW",
                         ["--compression", "powersgd", "--powersgd-rank", "4", "--optim", "adamw"]),
           "terngrad": ("TernGrad-DDP defaults, horovod_terngrad.optim.AdamW",
                        ["--compression", "terngrad", "--optim", "tg-adamw"])}
TARGET, MINE = "fp32", "terngrad"


# -- one rank's compute alone ----------------------------------------------------------------------------------
def compute_alone_worker(argv) -> dict:
    """transformers_lm.py's training step (nanoGPT recipe, torch AdamW, clip) in one process, one thread, no
    torch.distributed: median step time after 3 untimed steps, and the parameter count."""
    p = argparse.ArgumentParser(prog="time_to_quality.py compute-alone")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--steps", type=int, default=1000, help="the run's steps (the lr schedule's length)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compute-steps", type=int, default=10)
    a = p.parse_args(argv)
    import torch
    sys.path.insert(0, HERE)
    import transformers_lm as lm
    torch.set_num_threads(1)
    args = lm.parse_args(["--recipe", "nanogpt", "--optim", "adamw", "--n-layer", str(a.n_layer),
                          "--steps", str(a.steps), "--seed", str(a.seed)])
    torch.manual_seed(args.seed)
    train, _, _ = lm.load_corpus(args.corpus)
    model = lm.make_model(args)
    opt = lm.make_optimizer(args, model)
    gen = torch.Generator().manual_seed(1000 + args.seed)
    amp = lm.mixed_precision.MixedPrecision()          # off: the plain backward, clip, step
    clip = (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)) if args.clip_grad else None
    model.train()
    times = []
    for step in range(1, 3 + a.compute_steps + 1):
        t = time.perf_counter()
        lm.train_step(args, step, model, opt, amp, clip, train, gen).item()
        if step > 3:
            times.append(time.perf_counter() - t)
    res = {"compute_ms": 1000 * sorted(times)[len(times) // 2], "times_ms": [1000 * t for t in times],
           "params": sum(q.numel() for q in model.parameters()), "threads": torch.get_num_threads(),
           "batch_size": args.batch_size, "seq_len": args.seq_len, "n_layer": args.n_layer}
    print(json.dumps(res), flush=True)
    return res


def compute_alone(args) -> dict:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "compute-alone", "--n-layer", str(args.n_layer),
                        "--steps", str(args.steps), "--seed", str(args.seed), "--compute-steps",
                        str(args.compute_steps)], capture_output=True, text=True, check=True, timeout=1800, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
    return json.loads(p.stdout.strip().splitlines()[-1])


def regime(args) -> dict:
    """The saved regime of ``--out`` (same ratio and model), or a new one measured now (and with ``--force``)."""
    from emulated_cluster_benchmark import regime_rate
    path = os.path.join(args.out, "regime.json")
    if os.path.exists(path) and not args.force:
        with open(path) as f:
            saved = json.load(f)
        if saved["ratio"] != args.ratio or saved["n_layer"] != args.n_layer:
            raise SystemExit(f"{path} was calibrated for ratio {saved['ratio']:g}, {saved['n_layer']} layers; this run "
                             f"asks for {args.ratio:g}, {args.n_layer}: --force (every method again) or another --out")
        return saved
    alone = compute_alone(args)
    reg = regime_rate(args.ratio, alone["compute_ms"] / 1000, alone["params"], HOSTS)
    reg.update(n_layer=args.n_layer, hosts=HOSTS, compute_alone=alone)
    with open(path, "w") as f:
        json.dump(reg, f, indent=1)
    return reg


# -- the runs ------------------------------------------------------------------------------------------------------
def lm_argv(args, method: str, json_path: str) -> list:
    return [LM, "--frontend", "ddp", "--recipe", "nanogpt", "--n-layer", str(args.n_layer), "--steps", str(args.steps),
            "--seed", str(args.seed), "--eval-every", str(args.eval_every), "--log-every", str(args.eval_every),
            "--threads", "1", "--json", json_path] + METHODS[method][1]


def run_methods(args, todo: list) -> None:
    """Every method of ``todo`` in turn on one 2-host emulated cluster at the regime's rate."""
    from emulated_cluster_benchmark import emulated_cluster
    reg = regime(args)
    print(f"regime {reg['ratio']:g}: one rank computes alone in {reg['compute_alone_ms']:.1f} ms ({reg['params']} "
          f"parameters); fp32's ring payload per host link {reg['bytes_per_host'] / 1e6:.2f} MB -> links "
          f"{reg['gbps']:.4f} Gbit/s ({reg['rate']})", flush=True)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    with emulated_cluster(HOSTS, reg["rate"], PREFIX, SUBNET):
        for i, method in enumerate(todo):
            final = os.path.join(args.out, f"{method}.json")
            partial = final + ".part"           # a run that dies leaves no <method>.json to skip next time
            if os.path.exists(partial):
                os.remove(partial)
            # a port of its own per run: no wait for the previous rendezvous's socket to be released
            cmd = [DDP_TORCHRUN, "--netns", PREFIX, "--nproc", "1", "--port", str(PORT + i), "--"] + \
                lm_argv(args, method, partial)
            print(f"{method}: {METHODS[method][0]} ...", flush=True)
            t = time.perf_counter()
            with open(os.path.join(args.out, f"{method}.log"), "w") as log:
                p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, cwd=ROOT, env=env)
            if p.returncode != 0 or not os.path.exists(partial):
                with open(os.path.join(args.out, f"{method}.log")) as f:
                    tail = f.read()[-3000:]
                raise SystemExit(f"{method} failed (exit {p.returncode}); {args.out}/{method}.log ends:\n{tail}")
            with open(partial) as f:
                res = json.load(f)
            res.update(method=method, label=METHODS[method][0], hosts=HOSTS, regime=reg,
                       command=" ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd))
            with open(final, "w") as f:
                json.dump(res, f, indent=1)
            os.remove(partial)
            c = res["curve"][-1]
            print(f"{method}: {1000 * c['train_s'] / res['steps']:.0f} ms/step, held-out {res['held_out_loss']:.4f} "
                  f"({time.perf_counter() - t:.0f} s with start-up and evaluations)", flush=True)


# -- the table -----------------------------------------------------------------------------------------------------
def first_reach(curve: list, target: float):
    """The first point of ``curve`` whose held-out loss is <= ``target``, or None."""
    return next((c for c in curve if c["held_out_loss"] <= target), None)


def load(out: str, methods: list) -> dict:
    res = {}
    for m in methods:
        path = os.path.join(out, f"{m}.json")
        if os.path.exists(path):
            with open(path) as f:
                res[m] = json.load(f)
    return res


def table(out: str, methods: list) -> list:
    """The markdown lines: the setting and regime, one row per method with a saved JSON, the verdict."""
    res = load(out, methods)
    if not res:
        raise SystemExit(f"no results of {', '.join(methods)} in {out}")
    reg = None
    if os.path.exists(os.path.join(out, "regime.json")):
        with open(os.path.join(out, "regime.json")) as f:
            reg = json.load(f)
    reg = reg or next((r["regime"] for r in res.values() if r.get("regime")), None)
    first = res.get(TARGET) or next(iter(res.values()))
    lines = [f"**Time to fp32 AdamW's final held-out loss**: GPT-2 {first.get('params', '?')} parameters, "
             f"--recipe {first.get('recipe', '?')}, {first['steps']} steps, seed {first.get('seed', '?')}, "
             f"DDP on {HOSTS} emulated hosts x 1 rank (gloo), held-out loss every {first.get('eval_every', '?')} "
             f"steps; times are training wall time without the evaluations."]
    if reg:
        lines.append(f"Regime {reg['ratio']:g}: one rank computes alone in {reg['compute_alone_ms']:.1f} ms "
                     f"({reg['params']} parameters); fp32's ring payload per host link "
                     f"{reg['bytes_per_host'] / 1e6:.2f} MB -> links {reg['gbps']:.4f} Gbit/s ({reg['rate']}).")
        odd = [m for m, r in res.items() if r.get("regime") and r["regime"].get("rate") != reg["rate"]]
        if odd:
            lines.append(f"**Warning**: {', '.join(odd)} ran at another rate than the saved regime's "
                         f"({', '.join(res[m]['regime']['rate'] for m in odd)}): rerun with --force.")
    target = res[TARGET]["held_out_loss"] if TARGET in res else None
    reach = {}
    for m, r in res.items():
        hit = first_reach(r.get("curve", []), target) if target is not None else None
        reach[m] = hit["train_s"] if hit else None
    lines += ["", "| method | ms/step | final held-out loss | target (fp32 final) | first eval <= target: step "
                  "| its train s | speed-up vs best other |", "|---|---|---|---|---|---|---|"]
    for m, r in res.items():
        curve = r.get("curve") or []
        ms = 1000 * curve[-1]["train_s"] / r["steps"] if curve else float("nan")
        hit = first_reach(curve, target) if target is not None else None
        others = [t for k, t in reach.items() if k != m and t is not None]
        if hit is None:
            speed = ""
        elif not others:
            speed = "only one to reach it"
        else:
            speed = f"{min(others) / hit['train_s']:.2f}x"
        if target is None:
            tgt, step, secs = "no fp32 run", "", ""
        else:
            tgt = f"{target:.4f}"
            step, secs = (str(hit["step"]), f"{hit['train_s']:.1f}") if hit else ("never", "")
        lines.append("| " + " | ".join([r.get("label", m), f"{ms:.0f}", f"{r['held_out_loss']:.4f}", tgt, step, secs,
                                        speed]) + " |")
    lines += ["", verdict(reach)]
    return lines


def verdict(reach: dict) -> str:
    if TARGET not in reach:
        return "No fp32 run: no target."
    if MINE not in reach:
        return "No TernGrad run."
    mine = reach[MINE]
    others = {k: t for k, t in reach.items() if k != MINE and t is not None}
    if mine is None:
        return "Goal not met: TernGrad never reaches the target."
    best = min(others.values()) if others else None
    if best is None:
        return "Goal met: TernGrad is the only method to reach the target."
    speed = best / mine
    who = min(others, key=others.get)
    ok = speed >= GOAL
    return (f"Goal {'met' if ok else 'not met'}: TernGrad reaches the target in {mine:.1f} s, the best other "
            f"({who}) in {best:.1f} s: {speed:.2f}x sooner (goal: first, at least {GOAL:g}x).")


def write_table(args, argv: list) -> list:
    lines = table(args.out, args.methods)
    print("\n".join(lines), flush=True)
    with open(os.path.join(args.out, "table.md"), "a") as f:
        f.write(f"\n`{' '.join(['examples/time_to_quality.py'] + list(argv))}`\n\n" + "\n".join(lines) + "\n")
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "compute-alone":
        return compute_alone_worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ratio", type=float, default=8.0,
                   help="fp32's ring payload per host link takes RATIO x one rank's compute alone (8: Ethernet)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--compute-steps", type=int, default=10, help="timed steps of the compute-alone measurement")
    p.add_argument("--timeout", type=int, default=4 * 3600, help="seconds per method's run")
    p.add_argument("--force", action="store_true", help="measure the regime and run every method again")
    p.add_argument("--table-only", action="store_true", help="only the table, from the saved JSONs")
    p.add_argument("--out", default="docs/time_to_quality")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}: choose from {', '.join(METHODS)}")
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    if not args.table_only:
        todo = [m for m in args.methods if args.force or not os.path.exists(os.path.join(args.out, f"{m}.json"))]
        for m, r in load(args.out, [m for m in args.methods if m not in todo]).items():
            if (r["steps"], r["seed"], r.get("eval_every")) != (args.steps, args.seed, args.eval_every):
                raise SystemExit(f"{args.out}/{m}.json ran {r['steps']} steps, seed {r['seed']}, eval every "
                                 f"{r.get('eval_every')}: not this run's; --force or another --out")
        if todo:
            if os.geteuid() != 0:
                raise SystemExit("time_to_quality: needs root (network namespaces)")
            sys.path.insert(0, HERE)
            run_methods(args, todo)
    return write_table(args, argv)


if __name__ == "__main__":
    main()
