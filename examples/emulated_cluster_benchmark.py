"""Step times on an emulated cluster (network namespaces, tc-shaped links), launched as users launch Horovod:
plain ``mpirun``, no terngrad-launch, TernGrad at its defaults; beside every TernGrad figure its step-time
limit, and beside every figure the scheduled model's prediction.  Needs root and iproute2.

    .venv/bin/python examples/emulated_cluster_benchmark.py --models resnet50,transformer --hosts 2,4 \\
        --rates 1gbit,none --out docs/cluster

For each (model, hosts, rate): bring up the cluster (launch/netns-cluster.sh; on unshaped links the rate is
measured first with a TCP stream between two hosts), run ``python -m horovod_terngrad.operations.bench step
--calibrate`` with one rank per emulated host (``--ranks-per-host``: several), tear the cluster down, and
print one table row per configuration (``--configs``, entries of bench.STEP_CONFIGS: fp32 = ``Compression.none``, fp16 =
``Compression.fp16``, terngrad = TernGrad's defaults, terngrad-sharded, terngrad-auto = ``exchange="sharded"``
/ ``"auto"``, ...).  Models: whatever ``bench step --model`` takes (mlp, resnet50, transformer, tiny:
operations/models.py).

Launch: ``mpirun --bind-to none`` over launch/netns-rsh, TCP on eth0, and the two settings the shared cores
need: ``OMP_NUM_THREADS=1`` and ``OMPI_MCA_mpi_yield_when_idle=1`` (the emulated hosts share this machine's
cores, which real hosts do not: a rank busy-polling in MPI would take the core another rank computes on;
Open MPI sets the same itself when it knows a node is oversubscribed).  Horovod runs at its own defaults
(cycle 1 ms, fusion threshold 128 MiB).

Timing (bench step): a warm-up round (every configuration runs ``--warmup`` untimed steps before any is
timed), then ``--rounds`` rounds in which the calibration and the configurations take turns, one untimed
and ``--steps`` timed steps each; figures are medians over all rounds, and the per-round medians are shown.

Beside every TernGrad figure, its step-time limit:

    limit = compute (every rank computing, no exchange: the calibration, in the same run)
            + codec (TernGrad's own clock in the timed steps)
            + the bytes this rank received per step at the link rate (the nominal rate, or the measured one).

Beside every figure, the scheduled model (horovod_terngrad.modelling.timeline.timeline_step): the step as
Horovod and the engine run it, on the calibration of the same run (slowest rank's compute, alpha from a
4-byte allreduce, per-collective efficiencies from one large allreduce / allgather / alltoall, the codec's
per-element rates measured on every rank at once), each TernGrad configuration with the TernGradConfig it
ran with (recorded in the JSON) and Horovod's cycle time.  Its error is (model - measured) / measured.

Several ranks per host (``--ranks-per-host G``, e.g. ``--hosts 2 --ranks-per-host 2``): mpirun places G ranks
on each emulated host (by slot: ranks 0..G-1 on the first host); ranks of one host talk through shared memory
(Open MPI's vader) or the host's own address (lo), never through its eth0, so the link carries only what
crosses hosts.  Every configuration records the bytes through each host's eth0 per step (``bench step
--link-counters eth0``, read around its turns); these cells get their own table (below).

Calibrated regime (``--regime RATIO``, in place of ``--rates``): a fixed link rate emulates a different cluster
on every CPU (these cores compute a step 20-100x slower than a GPU).  So first measure one rank's compute
alone (``bench compute``: one process, one thread, no Horovod, the benchmark's training step), then shape
every link so that fp32's ring-allreduce payload takes RATIO times that compute:

    rate = 8 x B / (RATIO x compute alone),  B = 2(N-1)/N x 4 bytes x parameters   (N = hosts x G ranks)

B is what a ring over all N ranks puts on each host's link in each direction when the ring visits a host's
ranks one after another (one ring edge leaves and one enters each host, whatever G is): gloo's ring does
exactly this (measured: 150 MB per host for a 100 MB allreduce on 2 hosts x 2 ranks), as NCCL's
node-aware rings do.  Open MPI's allreduce (recursive halving at these sizes, mpirun's by-slot placement)
puts less on it, 2(H-1)/H x 4 bytes x parameters for H hosts (measured 100 MB), and a ring that ignores
hosts (``--map-by node``) puts G x B (measured 200 MB with Open MPI).  ``--regime-payload every-rank``
calibrates on G x B instead (every rank's ring payload through its host's link: a faster link).  RATIO 8 is
the paper's Ethernet regime: ResNet-50 on a V100-class GPU computes a step in about 0.1 s, and its 102 MB
take 0.82 s at 1 Gbit/s.  The chosen rate stands above every table (and in the cell's ``regime``).

Table of these cells (several ranks per host or a regime), per configuration (``--hierarchical true,false``
adds TernGrad with ``hierarchical=True`` / ``False``; the defaults' ``"auto"`` is the plain terngrad row):
ms per step, images/s of all ranks together, speedup vs fp16 and fp32 of the same run, MB per step through
each host's link (sent / received), and the limit

    limit = compute alone (one rank, bench compute) + codec (TernGrad's own clock)
            + the most bytes any host's link carried in one direction per step, at the link rate.

Results: ``<out>/<model>-n<hosts>[x<G>]-<rate or regime<RATIO>>[-<tag>].json`` per cell (``--tag r2`` keeps a repeat beside the
first run), the table appended to ``<out>/table.md`` with the command line.  ``--predict-only PATH...``
recomputes the predictions and the table of saved cells (files or folders of them, including the
``emulated_cluster.json`` of the earlier MLP runs and docs/realshapes/) without running anything, and writes
the table to ``<out>/predicted.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from horovod_terngrad.exchange.cost import HOROVOD_FUSION_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETNS = os.path.join(ROOT, "launch", "netns-cluster.sh")
RSH = os.path.join(ROOT, "launch", "netns-rsh")
PY = sys.executable
PREFIX, SUBNET = "tgc", "10.79.0"
CONFIGS = "fp32,fp16,terngrad,terngrad-sharded,terngrad-auto"
# Horovod 0.28's defaults (``horovodrun --help``), which a plain mpirun launch keeps
HOROVOD_CYCLE_MS = 1.0
# what the earlier MLP runs (docs/cluster/emulated_cluster.json) ran with: terngrad-launch's Ethernet
# settings and the TernGrad defaults of then (shared scaler, every tensor ternarized)
LEGACY = {"cycle_ms": 5.0, "fusion_bytes": 64 * 1024 * 1024,
          "configs": {"terngrad": {"shared_scaler": True, "min_numel": 0},
                      "terngrad-sharded": {"exchange": "sharded", "min_numel": 0}}}
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
CELL = re.compile(r"^(?P<model>.+)-n(?P<hosts>\d+)(?:x(?P<rph>\d+))?-(?P<rate>[^-]+)(?:-(?P<tag>.+))?\.json$")
# --hierarchical: TernGradConfig(hierarchical=...) of each value, as bench.STEP_CONFIGS entries
HIERARCHICAL = {"auto": "terngrad", "true": "terngrad-hier", "false": "terngrad-flat"}
REGIME_PAYLOADS = ("host-ring", "every-rank")


# -- the emulated cluster (also examples/ddp_benchmark.py's) ---------------------------------------------------
@contextlib.contextmanager
def emulated_cluster(hosts: int, rate: str, prefix: str, subnet: str):
    """``hosts`` emulated hosts ``<prefix>-h0..`` at ``rate`` (or unshaped: ``none``) for the ``with`` block."""
    subprocess.run([NETNS, "down", "--prefix", prefix], capture_output=True)
    subprocess.run([NETNS, "up", str(hosts), "--rate", rate, "--prefix", prefix, "--subnet", subnet],
                   check=True, capture_output=True)
    try:
        yield [f"{prefix}-h{i}" for i in range(hosts)]
    finally:
        subprocess.run([NETNS, "down", "--prefix", prefix], capture_output=True)


def run_on_cluster(hosts: int, rate: str, prefix: str, subnet: str, cmd: list, timeout: int, what: str,
                   probe=None, **run_kw):
    """Bring up an emulated cluster of ``hosts`` at ``rate``, call ``probe(host names)`` (if given), run
    ``cmd`` (printing the tail of its output), and tear the cluster down, also when the command fails
    (``SystemExit`` naming ``what``).  Returns what ``probe`` returned."""
    with emulated_cluster(hosts, rate, prefix, subnet) as names:
        probed = probe(names) if probe is not None else None
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **run_kw)
        print(p.stdout[-3000:], flush=True)
        if p.returncode != 0:
            # the tail is usually the launcher's summary: the first rank's own error is further up
            with tempfile.NamedTemporaryFile("w", prefix="cluster-run-", suffix=".log", delete=False) as f:
                f.write(p.stdout + "\n--- stderr ---\n" + p.stderr)
            raise SystemExit(f"{what} failed (its whole output: {f.name}):\n{p.stderr[-3000:]}")
    return probed


def sweep(args, run_case, rows, header: list, script: str, argv: list, footer=None) -> None:
    """Every (model, hosts, rate) of ``args`` in turn: ``rows(run_case(...), rate)`` under ``header`` (then
    ``footer(results)``), printed as it grows and appended to ``<out>/table.md`` with the command line."""
    os.makedirs(args.out, exist_ok=True)
    table, results = list(header), []
    for model in args.models.split(","):
        for hosts in (int(h) for h in args.hosts.split(",")):
            for rate in args.rates.split(","):
                results.append(run_case(model, hosts, rate, args))
                table += rows(results[-1], rate)
                print("\n".join(table), flush=True)
    if footer is not None:
        table += footer(results)
    with open(os.path.join(args.out, "table.md"), "a") as f:
        f.write(f"\n`{' '.join([script] + argv)}`\n\n")
        f.write("\n".join(table) + "\n")


def measure_link_gbps(h0: str, h1: str, ip1: str, nbytes: int = 200_000_000) -> float:
    """TCP throughput from h0 to h1 (Python sockets inside the namespaces)."""
    server = subprocess.Popen(["ip", "netns", "exec", h1, PY, "-c",
                               "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
                               "s.bind(('0.0.0.0',5999));s.listen(1);c,_=s.accept()\n"
                               "n=0\nwhile True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\nprint(n)"],
                              stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    client = subprocess.run(["ip", "netns", "exec", h0, PY, "-c",
                             f"import socket,time;s=socket.create_connection(('{ip1}',5999));b=bytes(1<<20);t=time.time()\n"
                             f"for _ in range({nbytes >> 20}): s.sendall(b)\n"
                             "s.shutdown(socket.SHUT_WR);s.recv(1);print(time.time()-t)"],
                            capture_output=True, text=True, timeout=300)
    server.wait(60)
    return nbytes * 8 / float(client.stdout.strip()) / 1e9


# -- the calibrated regime -------------------------------------------------------------------------------------
def ring_bytes_per_host(params: int, ranks: int, ranks_per_host: int = 1, payload: str = "host-ring") -> float:
    """Bytes fp32's ring allreduce of ``params`` parameters on ``ranks`` ranks puts on one host's link in
    each direction: one rank's ring payload 2(N-1)/N x 4 x params (a ring that visits a host's ranks one
    after another), or with ``payload="every-rank"`` that of every rank on the host."""
    if ranks < 2 or ranks % ranks_per_host:
        raise ValueError(f"need >= 2 ranks, a multiple of {ranks_per_host} per host; got {ranks}")
    if payload not in REGIME_PAYLOADS:
        raise ValueError(f"payload must be one of {REGIME_PAYLOADS}, got {payload!r}")
    ring = 2 * (ranks - 1) / ranks * 4 * params
    return ring * (ranks_per_host if payload == "every-rank" else 1)


def tc_rate(bits_per_s: float) -> str:
    """A tc rate for ``bits_per_s`` (whole kbit/s, tc's 1000 bit/s)."""
    return f"{max(1, round(bits_per_s / 1e3))}kbit"


def regime_rate(ratio: float, compute_alone_s: float, params: int, ranks: int, ranks_per_host: int = 1,
                payload: str = "host-ring") -> dict:
    """The link rate at which fp32's ring payload per host link takes ``ratio`` x one rank's compute alone."""
    if not (ratio > 0 and compute_alone_s > 0):
        raise ValueError(f"ratio and compute time must be > 0, got {ratio!r}, {compute_alone_s!r}")
    nbytes = ring_bytes_per_host(params, ranks, ranks_per_host, payload)
    bps = 8 * nbytes / (ratio * compute_alone_s)
    return {"ratio": ratio, "compute_alone_ms": 1000 * compute_alone_s, "params": params, "ranks": ranks,
            "ranks_per_host": ranks_per_host, "payload": payload, "bytes_per_host": nbytes,
            "gbps": bps / 1e9, "rate": tc_rate(bps)}


_COMPUTE = {}


def compute_alone(model: str, args) -> dict:
    """One rank's compute alone (``bench compute``: one process, OMP_NUM_THREADS=1, no Horovod), measured
    once per model and workload in this run."""
    argv = ["--model", model, "--batch", str(args.batch), "--image", str(args.image), "--context",
            str(args.context), "--layers", str(args.layers), "--width", str(args.width),
            "--steps", str(getattr(args, "compute_steps", 7))]
    key = " ".join(argv)
    if key not in _COMPUTE:
        p = subprocess.run([PY, "-m", "horovod_terngrad.operations.bench", "compute"] + argv, capture_output=True,
                           text=True, timeout=1800, cwd=ROOT, check=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT))
        _COMPUTE[key] = json.loads(p.stdout.strip().splitlines()[-1])
    return _COMPUTE[key]


# -- one cell: a model on N hosts at one rate ----------------------------------------------------------------------
def cell_path(out: str, model: str, hosts: int, rate: str, tag: str = "", ranks_per_host: int = 1) -> str:
    shape = f"{hosts}x{ranks_per_host}" if ranks_per_host > 1 else f"{hosts}"
    return os.path.join(os.path.abspath(out), f"{model}-n{shape}-{rate}" + (f"-{tag}" if tag else "") + ".json")


def _commit() -> str:
    p = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return p.stdout.strip() or "unknown"


def run_case(model: str, hosts: int, rate: str, args) -> dict:
    """One cell: ``hosts`` emulated hosts of ``--ranks-per-host`` ranks each at ``rate`` (a tc rate, ``none``,
    or ``regime<RATIO>``: the calibrated regime's rate, chosen here from one rank's compute alone)."""
    G = getattr(args, "ranks_per_host", 1)
    out = cell_path(args.out, model, hosts, rate, args.tag, G)
    alone = compute_alone(model, args) if G > 1 or rate.startswith("regime") else None
    regime = None
    if rate.startswith("regime"):
        regime = regime_rate(float(rate[len("regime"):]), alone["compute_ms"] / 1000, alone["params"], hosts * G,
                             G, getattr(args, "regime_payload", "host-ring"))
        print(f"regime {regime['ratio']:g}: one rank computes alone in {regime['compute_alone_ms']:.1f} ms; fp32's "
              f"ring payload per host link {regime['bytes_per_host'] / 1e6:.1f} MB -> link {regime['gbps']:.3f} "
              f"Gbit/s ({regime['rate']})", flush=True)
    tc = regime["rate"] if regime else rate
    prefix = getattr(args, "prefix", PREFIX)
    host_list = ",".join(f"{prefix}-h{i}:{G}" for i in range(hosts))
    venv_bin = os.path.dirname(PY)
    cmd = [NETNS, "exec", f"{prefix}-h0", "env", f"PATH={venv_bin}:{os.environ['PATH']}",
           "mpirun", "--allow-run-as-root", "-np", str(hosts * G), "-H", host_list, "--bind-to", "none",
           "--mca", "plm_rsh_agent", RSH, "--mca", "pml", "ob1", "--mca", "btl", "tcp,self,vader",
           # ranks of one host: shared memory without CMA, as the tests run mpirun (CMA needs ptrace rights)
           "--mca", "btl_vader_single_copy_mechanism", "none",
           "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
           "-x", "OMP_NUM_THREADS=1", "-x", "OMPI_MCA_mpi_yield_when_idle=1", "-x", f"PYTHONPATH={ROOT}",
           # how the node-aware exchange's groups run on Horovod (frontends/hierarchy.py): world collectives
           # (the default) or process sets (added after hvd.init(): dynamic process sets on)
           *(["-x", f"HOROVOD_TERNGRAD_NODE_GROUPS={args.node_groups}", "-x", "HOROVOD_DYNAMIC_PROCESS_SETS=1"]
             if getattr(args, "node_groups", "") else []),
           "-x", "PATH", PY, "-m", "horovod_terngrad.operations.bench", "step",
           "--model", model, "--batch", str(args.batch), "--image", str(args.image),
           "--context", str(args.context), "--layers", str(args.layers),
           "--width", str(args.width), "--steps", str(args.steps), "--rounds", str(args.rounds),
           "--warmup", str(args.warmup), "--configs", args.configs, "--calibrate", "--link-counters", "eth0",
           "--json", out]

    def probe(names):                  # unshaped links: their rate, for the limit and the model
        return measure_link_gbps(names[0], names[1], f"{SUBNET}.2") if tc == "none" and hosts > 1 else None

    t0 = time.time()
    gbps = run_on_cluster(hosts, tc, prefix, SUBNET, cmd, args.timeout, f"{model} N={hosts}x{G} {rate}", probe=probe)
    with open(out) as f:
        res = json.load(f)
    res.update(hosts=hosts, rate=tc, measured_gbps=gbps, tag=args.tag, launcher="mpirun", commit=_commit(),
               cycle_ms=HOROVOD_CYCLE_MS, fusion_bytes=HOROVOD_FUSION_BYTES, wall_s=time.time() - t0,
               ranks_per_host=G, regime=regime, compute_alone=alone)
    # the scheduled model (timeline) knows one rank per host: with several, no prediction
    res["scheduled"] = predict(res) if G == 1 else None
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return res


def link_gbps(res: dict) -> float | None:
    """The link rate of a cell in Gbit/s: the nominal rate, or the one measured on unshaped links."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", res["rate"])
    return float(m.group(1)) * RATE_UNITS[m.group(2)] / 1e9 if m else res.get("measured_gbps")


def row_config(res: dict, row: dict):
    """The TernGradConfig a row ran with (None for fp32/fp16): recorded by bench step, or for saved runs
    before that, the one its configuration name stood for then."""
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.operations.bench import step_config
    if "terngrad_config" in row:
        return TernGradConfig(**row["terngrad_config"])
    if res.get("legacy"):
        return TernGradConfig(**LEGACY["configs"][row["config"]]) if row["config"] in LEGACY["configs"] else None
    return step_config(row["config"])


def predict(res: dict) -> dict:
    """The scheduled model of every row of a cell: {config: {ms, collectives, rounds, codec_ms}}, from the
    cell's own calibration.  Also puts the fitted ``alpha_us`` and ``efficiency`` into ``res``."""
    from horovod_terngrad.exchange import cost
    from horovod_terngrad.modelling import perfmodel as pm
    from horovod_terngrad.modelling.codec_rates import CodecRates
    from horovod_terngrad.modelling.timeline import method_of, timeline_step
    N, cal = res["hosts"], res["calibration"]
    # unmeasured unshaped links: 10 Gbit/s; the fitted efficiencies absorb the rate for every collective
    gbps = link_gbps(res) or 10.0
    # alpha from a 4-byte allreduce (2(N-1) latency terms); then each collective's bandwidth efficiency
    alpha_us = 1e3 * cal["small_allreduce_ms"] / max(1, 2 * (N - 1))
    net = pm.calibrated_efficiency(pm.Network.from_gbps("emulated", gbps, alpha_us), N,
                                   {k: tuple(cal[k]) for k in ("allreduce", "allgather", "alltoall")}, strict=False)
    res["alpha_us"] = alpha_us
    res["efficiency"] = {k: net.eff(k) for k in ("allreduce", "allgather", "alltoall")}
    rates = CodecRates(**cal["codec_s_per_element"]) if "codec_s_per_element" in cal else None   # None: free
    out = {}
    for row in res["rows"]:
        cfg = row_config(res, row)
        link = row.get("link")               # exchange="auto": the link it measured, and what it decided
        if link is not None and not link["compresses"]:
            cfg = None                       # every tensor went by Horovod's fp32 allreduce
        if cfg is None:                      # fp32/fp16 rows, and auto rows that sent everything at fp32
            method = row["config"] if row["config"] in ("fp32", "fp16") else "fp32"
        else:
            method = method_of(cfg)
        auto_network = (pm.Network.from_gbps("measured", link["gbps"], cost.configured_network().latency_s * 1e6)
                        if link is not None else cost.configured_network())   # what the job's "auto" decided on
        # a synchronous step waits for its slowest rank: the schedule starts from that rank's compute
        t = timeline_step(res["sizes"], cal.get("compute_slowest_ms", cal["compute_ms"]) / 1000, N, net, method,
                          codec=rates, fusion_bytes=res["fusion_bytes"],
                          cycle_s=res["cycle_ms"] / 1000, config=cfg, names=res.get("names"),
                          auto_network=auto_network)
        out[row["config"]] = {"ms": 1000 * t.step_s, "collectives": t.collectives, "rounds": t.rounds,
                              "codec_ms": 1000 * t.codec_s}
    return out


HEADER = ["| model | N | link | configuration | ms/step | by round | img/s per worker | speedup vs fp32 | "
          "vs fp16 | limit ms (compute + codec + wire) | step / limit | scheduled model ms | error | "
          "TernGrad collectives/step (measured / model) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]


def rows(res: dict, rate: str) -> list[str]:
    by = {r["config"]: r["step_ms"] for r in res["rows"]}
    fp16, fp32 = by.get("fp16"), by.get("fp32")
    compute, gbps = res["calibration"]["compute_ms"], link_gbps(res)
    link = rate if rate != "none" else ("unshaped" + (f" ({gbps:.1f} Gbit/s measured)" if gbps else ""))
    lines = []
    for r in res["rows"]:
        m, model = r["step_ms"], res["scheduled"][r["config"]]
        cells = [res["model"] + (f" ({res['tag']})" if res.get("tag") else ""), str(res["hosts"]), link, r["config"],
                 f"{m:.0f}",
                 ", ".join(f"{x:.0f}" for x in r["step_ms_by_round"]), f"{1000 * res['batch'] / m:.1f}",
                 f"{fp32 / m:.2f}x" if fp32 else "", f"{fp16 / m:.2f}x" if fp16 else ""]
        if "link" in r and not r["link"]["compresses"]:     # auto sent everything at full precision
            cells += [f"auto: off ({r['link']['gbps']:.1f} Gbit/s, codec {r['link']['codec_ns']:.1f} ns/element)", ""]
        elif "bytes_received_per_step" in r and gbps:
            wire_ms = 1000 * 8 * r["bytes_received_per_step"] / (gbps * 1e9)
            limit = compute + r["codec_ms"] + wire_ms
            cells += [f"{limit:.0f} = {compute:.0f} + {r['codec_ms']:.0f} + {wire_ms:.0f}", f"{m / limit:.2f}x"]
        else:
            cells += ["", ""]
        cells += [f"{model['ms']:.0f}", f"{100 * (model['ms'] - m) / m:+.0f}%",
                  f"{r['collectives_per_step']:.0f} / {model['collectives']}" if "collectives_per_step" in r else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def calibration_rows(results: list) -> list[str]:
    lines = ["", "Calibration (per cell, every round before the timed steps; medians): compute ms per step with "
             "every rank computing and no exchange (median, and the slowest rank's), alpha from a 4-byte allreduce, "
             "each collective's efficiency (fraction of the link rate the alpha-beta model reaches), the codec's "
             "ns per element (slowest rank):", "",
             "| model | N | link | compute ms | slowest rank | alpha us | allreduce | allgather | alltoall | "
             "statistics | ternarize+pack | decode |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        cal, e = res["calibration"], res["efficiency"]
        c = cal.get("codec_s_per_element", dict.fromkeys(("prepare", "encode", "decode_base", "decode_per_payload"),
                                                          float("nan")))
        lines.append(f"| {res['model']} | {res['hosts']} | {res['rate']} | {cal['compute_ms']:.0f} | "
                     f"{cal.get('compute_slowest_ms', float('nan')):.0f} | {res['alpha_us']:.0f} | "
                     f"{e['allreduce']:.2f} | {e['allgather']:.2f} | {e['alltoall']:.2f} | {1e9 * c['prepare']:.2f} | "
                     f"{1e9 * c['encode']:.2f} | {1e9 * (c['decode_base'] + res['hosts'] * c['decode_per_payload']):.2f} |")
    return lines


# -- cells of several ranks per host, or in the calibrated regime: a table per cell, its link rate above it --------
HOST_HEADER = ["| configuration | ms/step | by round | img/s (all ranks) | vs fp16 | vs fp32 | MB/step through each host "
               "link (sent / received) | link bytes vs fp32 | limit ms (compute alone + codec + link) | step / limit | "
               "node-aware |", "|---|---|---|---|---|---|---|---|---|---|---|"]


def _most_link_bytes(row: dict) -> float | None:
    """The most bytes any host's link carried in one direction per step (what the link's rate limits)."""
    lb = row.get("link_bytes_per_step")
    return max(max(v) for v in lb.values()) if lb else None


def cell_title(res: dict) -> str:
    """The cell's shape and link rate, and how the rate was chosen."""
    G, gbps, reg = res.get("ranks_per_host", 1), link_gbps(res), res.get("regime")
    head = (f"**{res['model']} ({res['params'] / 1e6:.1f}M parameters, batch {res['batch']} per rank), "
            f"{res['hosts']} hosts x {G} ranks, ")
    alone = res.get("compute_alone")
    if reg:
        return (head + f"links {gbps:.3f} Gbit/s each way** (`--regime {reg['ratio']:g}`: fp32's ring payload per "
                f"host link, 2(N-1)/N x 4 B x {reg['params'] / 1e6:.2f}M" + (f" x {G} ranks" if reg["payload"] == "every-rank"
                                                                              else "") +
                f" = {reg['bytes_per_host'] / 1e6:.1f} MB, takes {reg['ratio']:g} x one rank's compute alone, "
                f"{reg['compute_alone_ms']:.1f} ms; tc rate {reg['rate']})")
    link = res["rate"] if res["rate"] != "none" else "unshaped" + (f" ({gbps:.1f} Gbit/s measured)" if gbps else "")
    return head + f"links {link}**" + (f" (one rank's compute alone {alone['compute_ms']:.1f} ms)" if alone else "")


def host_rows(res: dict, rate: str = "") -> list[str]:
    """The cell's table: per configuration its step, throughput, speedups, bytes per host link and limit."""
    by = {r["config"]: r for r in res["rows"]}
    fp16, fp32 = by.get("fp16"), by.get("fp32")
    gbps, N = link_gbps(res), res["hosts"] * res.get("ranks_per_host", 1)
    alone = res["compute_alone"]["compute_ms"] if res.get("compute_alone") else None
    fp32_bytes = _most_link_bytes(fp32) if fp32 else None
    lines = ["", cell_title(res), ""] + HOST_HEADER
    for r in res["rows"]:
        m, b = r["step_ms"], _most_link_bytes(r)
        lb = r.get("link_bytes_per_step") or {}
        cells = [r["config"], f"{m:.0f}", ", ".join(f"{x:.0f}" for x in r["step_ms_by_round"]),
                 f"{1000 * N * res['batch'] / m:.1f}", f"{fp16['step_ms'] / m:.2f}x" if fp16 else "",
                 f"{fp32['step_ms'] / m:.2f}x" if fp32 else "",
                 ", ".join(f"{h.rsplit('-', 1)[-1]} {tx / 1e6:.1f} / {rx / 1e6:.1f}" for h, (tx, rx) in sorted(lb.items())),
                 f"{b / fp32_bytes:.2f}x" if b is not None and fp32_bytes else ""]
        if b is not None and gbps and alone is not None:
            wire, codec = 1000 * 8 * b / (gbps * 1e9), r.get("codec_ms", 0.0)
            limit = alone + codec + wire
            cells += [f"{limit:.0f} = {alone:.0f} + {codec:.0f} + {wire:.0f}", f"{m / limit:.2f}x"]
        else:
            cells += ["", ""]
        cells.append("" if "node_aware" not in r else "yes" if r["node_aware"] else "no")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def host_footer(results: list) -> list[str]:
    """Compute per step: one rank alone (the regime's yardstick and the limit's) and every rank at once (the
    calibration in the job: G ranks per host share this machine's cores)."""
    lines = ["", "Compute per step, ms: one rank alone (`bench compute`, one thread) and with every rank computing "
             "at once (the job's calibration; every emulated host shares this machine's cores):", "",
             "| model | hosts x ranks | link | one rank alone | every rank at once (median) | slowest rank |",
             "|---|---|---|---|---|---|"]
    for res in results:
        cal, alone = res["calibration"], res.get("compute_alone") or {}
        lines.append(f"| {res['model']} | {res['hosts']} x {res.get('ranks_per_host', 1)} | "
                     f"{link_gbps(res) or float('nan'):.3f} Gbit/s | {alone.get('compute_ms', float('nan')):.1f} | "
                     f"{cal['compute_ms']:.1f} | {cal.get('compute_slowest_ms', float('nan')):.1f} |")
    return lines


def hierarchical_configs(configs: str, values: str) -> str:
    """``configs`` plus the bench.STEP_CONFIGS entries of ``--hierarchical`` values (auto = the defaults'
    terngrad row); values other than auto are left out, with a note, where TernGradConfig has no
    ``hierarchical`` setting."""
    import dataclasses

    from horovod_terngrad import TernGradConfig
    has = "hierarchical" in {f.name for f in dataclasses.fields(TernGradConfig)}
    names = [c for c in configs.split(",") if c]
    for v in (v.strip().lower() for v in values.split(",") if v.strip()):
        if v not in HIERARCHICAL:
            raise SystemExit(f"--hierarchical takes {','.join(HIERARCHICAL)}, got {v!r}")
        if v != "auto" and not has:
            print(f"emulated_cluster_benchmark: TernGradConfig has no 'hierarchical' setting; --hierarchical {v} "
                  "left out", file=sys.stderr)
        elif HIERARCHICAL[v] not in names:
            names.append(HIERARCHICAL[v])
    return ",".join(names)


# -- saved runs --------------------------------------------------------------------------------------------------
def load_saved(paths: list) -> list[dict]:
    """The cells of saved runs: cell JSONs (this script's, or bench step's named as cells are), folders of
    them, and the earlier MLP runs' emulated_cluster.json (every case a legacy cell)."""
    files = []
    for p in paths:
        files += sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(".json")) if os.path.isdir(p) else [p]
    cells = []
    for path in files:
        with open(path) as f:
            saved = json.load(f)
        if "cases" in saved:                 # the earlier driver: MLP cases, terngrad-launch
            for case in saved["cases"]:
                cells.append(dict(case, model="mlp", sizes=[case["width"] ** 2, case["width"]] * case["layers"],
                                  batch=saved["batch"], legacy=True, cycle_ms=LEGACY["cycle_ms"],
                                  fusion_bytes=LEGACY["fusion_bytes"]))
            continue
        m = CELL.match(os.path.basename(path))
        if "calibration" not in saved or m is None:
            print(f"emulated_cluster_benchmark: {path} is not a saved cell; skipped", file=sys.stderr)
            continue
        saved.setdefault("hosts", saved.get("ranks", int(m["hosts"])))
        saved.setdefault("rate", m["rate"])
        saved.setdefault("tag", m["tag"] or "")
        saved.setdefault("cycle_ms", HOROVOD_CYCLE_MS)        # plain mpirun: Horovod's defaults
        saved.setdefault("fusion_bytes", HOROVOD_FUSION_BYTES)
        cells.append(saved)
    return cells


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet50,transformer", help="comma list of bench step --model names")
    p.add_argument("--hosts", default="2,4")
    p.add_argument("--rates", default="1gbit,none", help="tc rates (1gbit, 100mbit, ...) or none (unshaped)")
    p.add_argument("--configs", default=CONFIGS, help="comma list of bench.STEP_CONFIGS entries")
    p.add_argument("--ranks-per-host", type=int, default=1, help="ranks on each emulated host (mpirun by slot)")
    p.add_argument("--regime", default="", metavar="RATIO[,RATIO]",
                   help="calibrated regime instead of --rates: links at which fp32's ring payload per host link takes "
                        "RATIO x one rank's compute alone (8: the paper's Ethernet regime)")
    p.add_argument("--regime-payload", default="host-ring", choices=REGIME_PAYLOADS,
                   help="fp32's bytes per host link the regime calibrates on: one ring payload 2(N-1)/N x 4 x params "
                        "(a ring visiting each host's ranks in turn), or every rank's (x ranks per host)")
    p.add_argument("--hierarchical", default="", metavar="auto,true,false",
                   help="add TernGrad with hierarchical=True / False (terngrad-hier, terngrad-flat; auto = terngrad)")
    p.add_argument("--node-groups", default="", choices=["", "world", "process_sets"],
                   help="HOROVOD_TERNGRAD_NODE_GROUPS for the ranks (default: the library's, world collectives)")
    p.add_argument("--prefix", default=PREFIX, help="name prefix of the emulated cluster's namespaces")
    p.add_argument("--compute-steps", type=int, default=7, help="timed steps of the compute-alone measurement")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image", type=int, default=64, help="resnet50: input height and width")
    p.add_argument("--context", type=int, default=64, help="transformer: tokens per sample")
    p.add_argument("--layers", type=int, default=4, help="mlp: layers")
    p.add_argument("--width", type=int, default=2500, help="mlp: width")
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds in which the configurations take turns")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration before the rounds")
    p.add_argument("--tag", default="", help="suffix of the cells' file names, e.g. r2 for a repeat")
    p.add_argument("--timeout", type=int, default=3000, help="seconds per cell")
    p.add_argument("--out", default="docs/cluster")
    p.add_argument("--predict-only", nargs="+", default=None, metavar="PATH",
                   help="saved cells (files or folders): recompute the predictions and the table; runs nothing")
    args = p.parse_args(argv)
    if args.predict_only:
        cells = [c for c in load_saved(args.predict_only) if c.get("ranks_per_host", 1) == 1]  # model: 1 rank/host
        table = list(HEADER)
        for res in cells:
            res["scheduled"] = predict(res)
            table += rows(res, res["rate"])
        table += calibration_rows(cells)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "predicted.md"), "w") as f:
            f.write(f"`{' '.join(['examples/emulated_cluster_benchmark.py'] + argv)}`\n\n" + "\n".join(table) + "\n")
        print("\n".join(table))
        return
    if args.hierarchical:
        args.configs = hierarchical_configs(args.configs, args.hierarchical)
    if args.regime:
        args.rates = ",".join(f"regime{float(r):g}" for r in args.regime.split(","))
    if os.geteuid() != 0:
        raise SystemExit("emulated_cluster_benchmark: needs root (network namespaces)")
    if args.ranks_per_host > 1 or args.regime:
        sweep(args, run_case, host_rows, [], "examples/emulated_cluster_benchmark.py", argv, footer=host_footer)
    else:
        sweep(args, run_case, rows, HEADER, "examples/emulated_cluster_benchmark.py", argv, footer=calibration_rows)


if __name__ == "__main__":
    main()
