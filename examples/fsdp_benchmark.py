"""Step times of HSDP (FSDP2) on an emulated cluster in the calibrated regime: native HSDP in fp32 and with a bf16
reduce, HSDP with TernGrad between hosts (``horovod_terngrad.fsdp.register``), and compute alone.  Needs root and
iproute2 (launch/netns-cluster.sh).

    flock /tmp/cpu.lock .venv/bin/python examples/fsdp_benchmark.py --regime 8 --out docs/fsdp

Cluster: ``--hosts`` emulated hosts (network namespaces, tc-shaped links; launch/netns-cluster.sh) of
``--ranks-per-host`` ranks each, one ``torchrun`` per host (launch/ddp-torchrun --netns), gloo on eth0,
OMP_NUM_THREADS=1 and ``torch.set_num_threads(1)`` on every rank.  The mesh is ``init_device_mesh("cpu", (hosts,
ranks per host), mesh_dim_names=("replicate", "shard"))``: torchrun numbers a host's ranks one after another, so
the mesh's rows are hosts, the shard groups lie inside a host (FSDP's all-gathers and reduce-scatters go through
the host's own address, i.e. lo, never its shaped eth0) and the replicate groups span the hosts.  The worker
checks this (every rank's host name) and refuses to run otherwise.

Model: a transformers GPT-2 (examples/transformers_lm.make_model: GPT2Config, byte vocabulary of 256, no
weights downloaded), ``--n-layer`` x ``--n-embd``, ``--seq-len`` tokens, ``--batch`` sequences per rank.  A
step is ``model(input_ids=x, labels=x).loss.backward(); SGD.step()`` on this rank's own fixed batch.

Configurations (``--configs``; each a fresh copy of the model, same seed; every GPT2Block an FSDP unit, then
the root):

    hsdp-fp32       native HSDP: ``fully_shard(m, mesh=mesh)`` on the 2-D mesh (fp32 all-reduce across hosts)
    hsdp-bf16       the same with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` (params stay fp32)
    hsdp-terngrad   ``fully_shard(m, mesh=mesh["shard"])`` + ``tg_fsdp.register(model, mesh)``, TernGrad's defaults
    local           no FSDP, no communication: each rank a plain model (the compute of the limit)

They take turns in ``--rounds`` rounds (one untimed step, then ``--steps`` timed steps each turn) after
``--warmup`` untimed steps each, all in ONE launch, so a slow spell of the shared machine lands on all of them.
A step's time is the slowest rank's; figures are medians over all rounds.  Local rank 0 of each host reads its
eth0 counters (/sys/class/net/eth0/statistics inside the host's namespace) around the timed steps of every turn
(a barrier at either end), so "host-link bytes" are what crossed that host's link per step (tx, rx; the table
gives tx+rx per host, averaged over hosts).  After the timed steps every rank's local shards are checksummed and
the replicas of every shard (same shard index, other hosts) must match.

Calibrated regime (``--regime RATIO[,RATIO...]``, emulated_cluster_benchmark's): one rank's compute alone (one
process, one thread, this script's ``compute`` subcommand) is measured first, and every link is shaped to

    rate = 8 x B / (RATIO x compute alone),  B = 2(N-1)/N x 4 bytes x parameters   (N = hosts x ranks per host)

(emulated_cluster_benchmark.regime_rate).  The emulated hosts share this machine's cores, so in the job every
rank computes several times slower than one rank alone, and a link calibrated on compute alone is, relative to
the job's compute, faster than RATIO says; ``--regime-compute every-rank`` calibrates instead on the compute of
N such processes running at once (measured before the cluster comes up; the slowest one's median), which is the
compute the job sees.  Native fp32 HSDP puts less than B on a host's link: each of its G
ranks all-reduces its 1/G shard with its replica on the other host, 2(H-1)/H x 4 bytes x parameters per host
and direction for H hosts (4 x parameters at H = 2: 2/3 of B at N = 4).

Beside every step time its limit, measured in the same run:

    limit = local (compute with every rank computing at once, no communication: the ``local`` row)
            + codec (TernGrad's own clock, stats.codec_s per step, slowest rank)
            + the bytes the busier direction of the busiest host link carried per step, at the link rate.

``local`` rather than one rank alone: the emulated hosts share this machine's cores, so every rank computes
slower than one rank alone does (both are shown).  Ratios vs hsdp-bf16 (step time, host-link bytes) and the
goals (TernGrad's host-link bytes <= 0.15x and step time <= 0.6x HSDP bf16's, replicas identical) are
printed under the table.  Results: ``<out>/gpt2-L<layers>-E<embd>-n<H>x<G>-regime<RATIO>[-every-rank][-<tag>].json``
and the
table appended to ``<out>/table.md`` with the command line.

``python examples/fsdp_benchmark.py worker ...`` is what each rank runs (under torchrun); ``... compute ...``
one rank's compute alone (prints one JSON line).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DDP_TORCHRUN = os.path.join(ROOT, "launch", "ddp-torchrun")
PREFIX, SUBNET, PORT = "tgf", "10.86.0", 29647
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulated_cluster_benchmark import _commit, link_gbps, regime_rate, run_on_cluster  # noqa: E402

CONFIGS = {"hsdp-fp32": "native HSDP, fp32 all-reduce across hosts",
           "hsdp-bf16": "native HSDP, reduce_dtype bf16",
           "hsdp-terngrad": "HSDP + TernGrad across hosts (defaults)",
           "local": "compute alone, no communication"}
STAT_FIELDS = ("tensors", "elements", "payload_bytes_sent", "handshake_bytes_sent", "bytes_received", "collectives",
               "gather_wait_s", "codec_s")


def model_args(args) -> argparse.Namespace:
    return argparse.Namespace(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len)


def add_model_arguments(p) -> None:
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seed", type=int, default=0)
    from horovod_terngrad.operations.devices import add_device_argument
    add_device_argument(p)


def _median(v):
    return statistics.median(v) if v else float("nan")


def fresh_model(args, device="cpu"):
    """The GPT-2 of every configuration: the same seed, so the same initial weights (drawn on the CPU, then moved
    to ``device``)."""
    import torch

    from transformers_lm import make_model
    torch.manual_seed(args.seed)
    return make_model(model_args(args)).to(device)


def batch_of(args, rank: int, device="cpu"):
    import torch
    gen = torch.Generator().manual_seed(1000 + args.seed + rank)
    return torch.randint(0, 256, (args.batch, args.seq_len), generator=gen).to(device)


def train_step(model, opt, x) -> None:
    opt.zero_grad(set_to_none=True)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    if x.is_cuda:
        import torch
        torch.cuda.synchronize(x.device)      # a step's time is its kernels', not their launch


# -- one rank's compute alone (the regime's yardstick) ------------------------------------------------------------
def compute(argv) -> dict:
    p = argparse.ArgumentParser(prog="fsdp_benchmark.py compute")
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=7)
    args = p.parse_args(argv)
    import torch

    from horovod_terngrad.operations.devices import setup_device
    torch.set_num_threads(1)
    device = setup_device(args.device).device
    model = fresh_model(args, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = batch_of(args, 0, device)
    for _ in range(2):
        train_step(model, opt, x)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        train_step(model, opt, x)
        times.append(time.perf_counter() - t)
    params = list(model.parameters())
    res = {"compute_ms": 1000 * _median(times), "times_ms": [1000 * t for t in times],
           "params": sum(q.numel() for q in params), "tensors": len(params),
           "tensors_small": sum(q.numel() < 4096 for q in params)}
    print(json.dumps(res), flush=True)
    return res


# -- the worker (one rank, under torchrun) ------------------------------------------------------------------------
def _link(iface: str = "eth0") -> list:
    from horovod_terngrad.operations.bench import _iface_bytes
    return _iface_bytes(iface)


def check_mesh(mesh, hosts: list) -> dict:
    """The shard groups lie inside a host and the replicate groups span distinct hosts (else SystemExit)."""
    import torch.distributed as dist
    shard = dist.get_process_group_ranks(mesh.get_group("shard"))
    rep = dist.get_process_group_ranks(mesh.get_group("replicate"))
    ok = len({hosts[r] for r in shard}) == 1 and len({hosts[r] for r in rep}) == len(rep)
    return {"shard_ranks": shard, "replicate_ranks": rep, "ok": ok}


def build(key: str, args, mesh, device="cpu"):
    """A fresh model set up as configuration ``key``: (module, TernGrad state or None)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from horovod_terngrad import fsdp as tg_fsdp
    model = fresh_model(args, device)
    if key == "local":
        return model, None
    kw = {"mesh": mesh["shard"] if key == "hsdp-terngrad" else mesh}
    if key == "hsdp-bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for block in model.transformer.h:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    state = tg_fsdp.register(model, mesh) if key == "hsdp-terngrad" else None
    return model, state


def _tg_snapshot(state) -> dict:
    st = state.stats
    snap = {f: getattr(st, f) for f in STAT_FIELDS}
    snap["uncompressed_elements"] = state.state.uncompressed_elements
    snap["hook_s"] = state._bench_hook_s
    return snap


def _time_hook(state) -> None:
    """Wall time inside TernGrad's all-reduce hook (every unit), as an attribute of the state (diagnosis only)."""
    state._bench_hook_s = 0.0
    reduce = state.reduce

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return reduce(*a, **kw)
        finally:
            state._bench_hook_s += time.perf_counter() - t

    state.reduce = timed


def worker(argv):
    sys.path.insert(0, ROOT)
    p = argparse.ArgumentParser(prog="fsdp_benchmark.py worker")
    add_model_arguments(p)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    import socket

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from horovod_terngrad.operations.devices import setup_device
    from transformers_lm import checksum
    torch.set_num_threads(1)
    placement = setup_device(args.device)          # cuda:LOCAL_RANK with NCCL, or the CPU with gloo
    device = placement.device
    dist.init_process_group(placement.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    G = int(os.environ["LOCAL_WORLD_SIZE"])
    local0 = int(os.environ["LOCAL_RANK"]) == 0
    hosts = [None] * size
    dist.all_gather_object(hosts, socket.gethostname())
    mesh = init_device_mesh(device.type, (size // G, G), mesh_dim_names=("replicate", "shard"))
    mesh_check = check_mesh(mesh, hosts)
    checks = [None] * size
    dist.all_gather_object(checks, mesh_check)
    if not all(c["ok"] for c in checks):
        raise SystemExit(f"fsdp_benchmark: the mesh's shard groups are not intra-host: {checks} on hosts {hosts}")
    x = batch_of(args, rank, device)
    setups = []
    for key in args.configs.split(","):
        if key not in CONFIGS:
            raise SystemExit(f"fsdp_benchmark: unknown configuration {key!r} (known: {', '.join(CONFIGS)})")
        model, state = build(key, args, mesh, device)
        if state is not None:
            _time_hook(state)
        setups.append({"key": key, "model": model, "state": state, "times": [], "link": [0, 0], "tg": None,
                       "opt": torch.optim.SGD(model.parameters(), lr=1e-4)})
    plain = fresh_model(args)
    params = list(plain.parameters())
    nparams, ntensors = sum(q.numel() for q in params), len(params)
    del plain, params

    def one_step(su, timed=True):
        t = time.perf_counter()
        train_step(su["model"], su["opt"], x)
        if timed:
            su["times"].append(time.perf_counter() - t)

    for su in setups:
        for _ in range(args.warmup):
            one_step(su, timed=False)
        dist.barrier()
    t_start = time.time()
    for _ in range(args.rounds):
        for su in setups:
            one_step(su, timed=False)
            dist.barrier()
            before = _link() if local0 else [0, 0]
            tg0 = _tg_snapshot(su["state"]) if su["state"] is not None else None
            for _ in range(args.steps):
                one_step(su)
            if tg0 is not None:
                tg1 = _tg_snapshot(su["state"])
                su["tg"] = {k: (su["tg"] or {}).get(k, 0) + tg1[k] - tg0[k] for k in tg0}
            dist.barrier()
            if local0:
                su["link"] = [a + b1 - b0 for a, b0, b1 in zip(su["link"], before, _link())]
    wall = time.time() - t_start
    steps = args.rounds * args.steps
    rows = []
    for su in setups:
        every = [None] * size
        dist.all_gather_object(every, {"times": su["times"], "link": su["link"] if local0 else None,
                                       "tg": su["tg"], "checksum": checksum(su["model"]),
                                       "shard": mesh.get_coordinate()[1], "host": hosts[rank]})
        job = [max(e["times"][i] for e in every) for i in range(steps)]      # a step lasts as long as its slowest rank
        link = {e["host"]: [v / steps for v in e["link"]] for e in every if e["link"] is not None}
        if su["key"] == "local":
            identical = None                      # every rank trains its own model on its own batch
        else:
            identical = all(len({e["checksum"] for e in every if e["shard"] == s}) == 1
                            for s in {e["shard"] for e in every})
        row = {"config": su["key"], "label": CONFIGS[su["key"]], "step_ms": 1000 * _median(job),
               "step_ms_by_round": [1000 * _median(job[r * args.steps:(r + 1) * args.steps]) for r in range(args.rounds)],
               "rank0_step_ms": 1000 * _median(su["times"]), "link_bytes_per_step": link,
               "replicas_identical": identical}
        if su["tg"] is not None:
            per_rank = [{k: v / steps for k, v in e["tg"].items()} for e in every]
            row["terngrad_per_rank_per_step"] = per_rank
            row["codec_ms"] = 1000 * max(r["codec_s"] for r in per_rank)
            row["hook_ms"] = 1000 * max(r["hook_s"] for r in per_rank)
            # what TernGrad handed to collectives, summed over each host's ranks: payloads + headers, and the
            # fp32 allreduce of the shards under min_numel (2(R-1)/R x 4 bytes per element)
            R = size // G
            host_payload = {}
            for e, r in zip(every, per_rank):
                b = r["payload_bytes_sent"] + r["handshake_bytes_sent"] + 2 * (R - 1) / R * 4 * r["uncompressed_elements"]
                host_payload[e["host"]] = host_payload.get(e["host"], 0.0) + b
            row["terngrad_bytes_sent_per_host"] = host_payload
            row["terngrad_config"] = {k: getattr(su["state"].config, k) for k in ("packing", "min_numel", "bucket_size",
                                                                                  "shared_scaler")}
            row["layout"] = dict(su["state"].layout)
        rows.append(row)
    if rank == 0:
        print(f"HSDP step benchmark: GPT-2 {args.n_layer} layers x {args.n_embd}, {nparams} parameters in {ntensors} "
              f"tensors, batch {args.batch} x {args.seq_len} per rank, {size} ranks ({size // G} hosts x {G}), "
              f"{placement.backend}; "
              f"median of {args.steps} steps x {args.rounds} interleaved rounds", flush=True)
        for row in rows:
            mb = sum(sum(v) for v in row["link_bytes_per_step"].values()) / max(1, len(row["link_bytes_per_step"])) / 1e6
            print(f"  {row['config']:14s} {row['step_ms']:8.1f} ms/step  rounds: "
                  f"{', '.join(f'{v:.0f}' for v in row['step_ms_by_round'])}  host link {mb:.2f} MB/step (tx+rx)  "
                  f"replicas identical: {row['replicas_identical']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "hosts": size // G, "ranks_per_host": G, "params": nparams,
                           "tensors": ntensors, "n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head,
                           "seq_len": args.seq_len, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
                           "warmup": args.warmup, "mesh": {"hosts_by_rank": hosts, "groups": checks},
                           "torch": torch.__version__, "rounds_wall_s": wall, "rows": rows}, f, indent=1)
    dist.barrier()
    setups.clear()
    dist.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------------------------
_ALONE: dict = {}


def compute_alone(args, processes: int = 1) -> dict:
    """One rank's compute (this script's ``compute``: one thread per process), once per run: one process alone,
    or ``processes`` at once (every rank of the emulated cluster computing on this machine's shared cores; then
    the slowest process's median, and every process's)."""
    argv = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head),
            "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--seed", str(args.seed),
            "--steps", str(args.compute_steps), "--device", args.device]
    key = (" ".join(argv), processes)
    if key not in _ALONE:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "compute"] + argv, stdout=subprocess.PIPE,
                                  text=True, cwd=ROOT, env=env) for _ in range(processes)]
        outs = []
        for pr in procs:
            out, _ = pr.communicate(timeout=1800)
            if pr.returncode != 0:
                raise SystemExit(f"fsdp_benchmark: compute failed (exit {pr.returncode})")
            outs.append(json.loads(out.strip().splitlines()[-1]))
        res = dict(max(outs, key=lambda o: o["compute_ms"]), processes=processes)
        if processes > 1:
            res["compute_ms_by_process"] = [o["compute_ms"] for o in outs]
        _ALONE[key] = res
    return _ALONE[key]


def cell_path(args, ratio: float) -> str:
    name = f"gpt2-L{args.n_layer}-E{args.n_embd}-n{args.hosts}x{args.ranks_per_host}-regime{ratio:g}"
    if args.regime_compute != "alone":
        name += f"-{args.regime_compute}"
    return os.path.join(os.path.abspath(args.out), name + (f"-{args.tag}" if args.tag else "") + ".json")


def run_case(ratio: float, args) -> dict:
    N = args.hosts * args.ranks_per_host
    alone = compute_alone(args)
    basis = alone if args.regime_compute == "alone" else compute_alone(args, N)
    regime = regime_rate(ratio, basis["compute_ms"] / 1000, alone["params"], N, args.ranks_per_host)
    regime.update(compute_basis=args.regime_compute, compute_every_rank=basis if basis is not alone else None)
    out = cell_path(args, ratio)
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    cmd = [DDP_TORCHRUN, "--netns", args.prefix, "--nproc", str(args.ranks_per_host), "--port", str(args.port), "--",
           os.path.abspath(__file__), "worker", "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
           "--n-head", str(args.n_head), "--seq-len", str(args.seq_len), "--batch", str(args.batch),
           "--seed", str(args.seed), "--device", args.device, "--configs", args.configs, "--steps", str(args.steps),
           "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--json", out]
    t0 = time.time()
    print(f"fsdp_benchmark: regime {ratio:g}: one rank's compute alone {alone['compute_ms']:.0f} ms, "
          f"links {regime['rate']}", flush=True)
    run_on_cluster(args.hosts, regime["rate"], args.prefix, args.subnet, cmd, args.timeout,
                   f"HSDP N={args.hosts}x{args.ranks_per_host} regime {ratio:g}", env=env)
    with open(out) as f:
        res = json.load(f)
    res.update(rate=regime["rate"], regime=regime, compute_alone=alone, tag=args.tag, commit=_commit(),
               launcher="launch/ddp-torchrun --netns", wall_s=time.time() - t0)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return res


def host_link(row: dict) -> tuple[float, float]:
    """(tx+rx bytes per step through a host's link, averaged over hosts; the busier direction of the busiest
    host link, what the link's rate limits)."""
    lb = row["link_bytes_per_step"]
    return (sum(sum(v) for v in lb.values()) / len(lb), max(max(v) for v in lb.values()))


def limit_ms(res: dict, row: dict) -> tuple[float, float, float, float] | None:
    """(limit, compute, codec, wire) in ms: the local row's step + codec + the busier direction at the link rate."""
    local = next((r for r in res["rows"] if r["config"] == "local"), None)
    if local is None:
        return None
    compute, codec = local["step_ms"], row.get("codec_ms", 0.0)
    wire = 1000 * 8 * host_link(row)[1] / (link_gbps(res) * 1e9)
    return compute + codec + wire, compute, codec, wire


def summary(res: dict) -> dict:
    """Ratios vs hsdp-bf16 and the goals, from one cell."""
    by = {r["config"]: r for r in res["rows"]}
    bf16, tg = by.get("hsdp-bf16"), by.get("hsdp-terngrad")
    out = {"ratios_vs_bf16": {}}
    if bf16 is not None:
        for r in res["rows"]:
            out["ratios_vs_bf16"][r["config"]] = {"step": r["step_ms"] / bf16["step_ms"],
                                                  "host_link_bytes": host_link(r)[0] / host_link(bf16)[0]}
    if bf16 is not None and tg is not None:
        ratio = out["ratios_vs_bf16"]["hsdp-terngrad"]
        out["goals"] = {"host_link_bytes_le_0.15x_bf16": ratio["host_link_bytes"] <= 0.15,
                        "step_le_0.6x_bf16": ratio["step"] <= 0.6}
    out["goals"] = dict(out.get("goals", {}), replicas_identical=all(
        r["replicas_identical"] for r in res["rows"] if r["replicas_identical"] is not None))
    return out


HEADER = ["| configuration | ms/step | by round | limit ms (local + codec + link) | step / limit | "
          "host-link MB/step (tx+rx, per host) | h0 tx / rx MB | payload handed to collectives MB/host | "
          "step vs hsdp-bf16 | host-link bytes vs hsdp-bf16 | replicas identical |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]


def table(res: dict) -> list[str]:
    reg, alone = res["regime"], res["compute_alone"]
    G, P = res["ranks_per_host"], res["params"]
    lines = ["", f"**GPT-2 ({res['n_layer']} layers x {res['n_embd']}, seq {res['seq_len']}, batch {res['batch']} per "
             f"rank; {P / 1e6:.2f}M parameters in {res['tensors']} tensors, {alone['tensors_small']} of them under "
             f"4096 elements), {res['hosts']} hosts x {G} ranks (mesh (replicate, shard) = ({res['hosts']}, {G}), shard "
             f"groups intra-host), links {link_gbps(res):.4f} Gbit/s each way** (`--regime {reg['ratio']:g}`: "
             f"2(N-1)/N x 4 B x {P / 1e6:.2f}M = {reg['bytes_per_host'] / 1e6:.1f} MB takes {reg['ratio']:g} x "
             + ("one rank's compute alone" if reg.get("compute_basis", "alone") == "alone" else
                f"one rank's compute with all {res['ranks']} ranks computing at once (`--regime-compute every-rank`)")
             + f", {reg['compute_alone_ms']:.0f} ms; tc rate {reg['rate']})", ""] + HEADER
    s = summary(res)
    for r in res["rows"]:
        per_host, _ = host_link(r)
        lim = limit_ms(res, r)
        h0 = sorted(r["link_bytes_per_step"])[0]
        tx, rx = r["link_bytes_per_step"][h0]
        if r["config"] == "hsdp-terngrad":
            payload = sum(r["terngrad_bytes_sent_per_host"].values()) / len(r["terngrad_bytes_sent_per_host"])
        elif r["config"].startswith("hsdp-"):
            R = res["hosts"]      # native: each rank all-reduces its 1/G shard, 2(R-1)/R x dtype bytes each way
            payload = 2 * (R - 1) / R * (2 if r["config"] == "hsdp-bf16" else 4) * P
        else:
            payload = 0.0
        rat = s["ratios_vs_bf16"].get(r["config"], {})
        same = {None: "n/a", True: "yes", False: "**no**"}[r["replicas_identical"]]
        cells = [r["config"], f"{r['step_ms']:.0f}", ", ".join(f"{v:.0f}" for v in r["step_ms_by_round"]),
                 f"{lim[0]:.0f} = {lim[1]:.0f} + {lim[2]:.0f} + {lim[3]:.0f}" if lim else "",
                 f"{r['step_ms'] / lim[0]:.2f}x" if lim else "", f"{per_host / 1e6:.3f}",
                 f"{tx / 1e6:.3f} / {rx / 1e6:.3f}", f"{payload / 1e6:.3f}" if payload else "",
                 f"{rat['step']:.2f}x" if rat else "", f"{rat['host_link_bytes']:.3f}x" if rat else "", same]
        lines.append("| " + " | ".join(cells) + " |")
    local = next((r for r in res["rows"] if r["config"] == "local"), None)
    every = reg.get("compute_every_rank")
    lines += ["", f"Compute per step: one rank alone {alone['compute_ms']:.0f} ms (one process, one thread)"
              + (f"; {every['processes']} such processes at once before the run: slowest {every['compute_ms']:.0f} ms "
                 f"(each: {', '.join(f'{v:.0f}' for v in every['compute_ms_by_process'])})" if every else "")
              + (f"; in the run, with all {res['ranks']} ranks computing at once on this machine's shared cores (the "
                 f"local row, slowest rank per step) {local['step_ms']:.0f} ms." if local else ".")]
    tg = next((r for r in res["rows"] if r["config"] == "hsdp-terngrad"), None)
    if tg is not None:
        pr = tg["terngrad_per_rank_per_step"]
        lines += ["", "TernGrad per rank and step (max over ranks): codec {:.0f} ms, inside the all-reduce hook {:.0f} ms "
                  "(of which waiting in allgathers {:.0f} ms), {:.0f} tensors ternarized ({:.0f} elements), {:.0f} "
                  "elements in fp32 (under min_numel {}), {:.0f} collectives".format(
                      tg["codec_ms"], tg["hook_ms"], 1000 * max(p["gather_wait_s"] for p in pr),
                      max(p["tensors"] for p in pr), max(p["elements"] for p in pr),
                      max(p["uncompressed_elements"] for p in pr), tg["terngrad_config"]["min_numel"],
                      max(p["collectives"] for p in pr))]
    g = s.get("goals", {})
    rat = s["ratios_vs_bf16"].get("hsdp-terngrad")
    if rat:
        lines += ["", f"Goals (hsdp-terngrad vs hsdp-bf16, same run): host-link bytes {rat['host_link_bytes']:.3f}x "
                  f"(<= 0.15x: {'met' if g['host_link_bytes_le_0.15x_bf16'] else 'MISSED'}); step time "
                  f"{rat['step']:.2f}x (<= 0.6x: {'met' if g['step_le_0.6x_bf16'] else 'MISSED'}); replicas of every "
                  f"shard identical in every HSDP configuration: {'met' if g['replicas_identical'] else 'MISSED'}."]
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "worker":
        return worker(argv[1:])
    if argv and argv[0] == "compute":
        return compute(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regime", default="8", metavar="RATIO[,RATIO]",
                   help="links at which fp32's ring payload per host link takes RATIO x one rank's compute alone")
    p.add_argument("--regime-compute", default="alone", choices=["alone", "every-rank"],
                   help="the compute the regime calibrates on: one rank alone (emulated_cluster_benchmark's), or "
                        "every rank of the cluster computing at once on this machine (the compute the job sees)")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    add_model_arguments(p)
    p.add_argument("--compute-steps", type=int, default=7, help="timed steps of the compute-alone measurement")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefix", default=PREFIX, help="name prefix of the emulated cluster's namespaces")
    p.add_argument("--subnet", default=SUBNET)
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    p.add_argument("--tag", default="", help="suffix of the cells' file names, e.g. r2 for a repeat")
    p.add_argument("--out", default="docs/fsdp")
    args = p.parse_args(argv)
    ratios = [float(r) for r in args.regime.split(",") if r.strip()]
    if not ratios or any(r <= 0 for r in ratios):
        raise SystemExit(f"fsdp_benchmark: --regime takes ratios > 0, got {args.regime!r}")
    if args.hosts < 2:
        raise SystemExit("fsdp_benchmark: HSDP across hosts needs --hosts >= 2")
    if os.geteuid() != 0:
        raise SystemExit("fsdp_benchmark: needs root (network namespaces)")
    os.makedirs(args.out, exist_ok=True)
    lines = []
    for ratio in ratios:
        res = run_case(ratio, args)
        res["summary"] = summary(res)
        with open(cell_path(args, ratio), "w") as f:
            json.dump(res, f, indent=1)
        lines += table(res)
        print("\n".join(lines), flush=True)
    with open(os.path.join(args.out, "table.md"), "a") as f:
        f.write(f"\n`{' '.join(['flock /tmp/cpu.lock .venv/bin/python examples/fsdp_benchmark.py'] + argv)}`\n")
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
