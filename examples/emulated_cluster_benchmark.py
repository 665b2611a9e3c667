"""Measured step times on an emulated cluster (network namespaces, tc-shaped links) beside the
performance model's predictions (issue: paper §5 / Fig. 5 validation).  Needs root and iproute2.

    .venv/bin/python examples/emulated_cluster_benchmark.py --hosts 2,4 --rates 1gbit,none --out docs/cluster

For each (hosts, rate): bring up the cluster (launch/netns-cluster.sh), run
``python -m horovod_terngrad.operations.bench step`` on one rank per host through launch/terngrad-launch (mpirun
with the netns rsh agent), for fp32, fp16, TernGrad (allgather) and TernGrad (sharded) on a
communication-heavy MLP of about 25M parameters, then tear the cluster down.  Predictions use
horovod_terngrad.operations.perfmodel with the compute time profiled here (scaled by ranks per core, since the
emulated hosts share this machine's cores), the link rate (for unshaped veth links: measured with a TCP
stream) and the codec throughput measured here ("link-rate model"), and again with the inputs the
model takes from a calibration inside each emulated cluster, repeated in every round before the timed steps
(``bench step --calibrate``: compute time of a step with all ranks computing at once and no exchange,
the latency alpha from a 4-byte allreduce, one large allreduce, allgather and alltoall at this
model's sizes, which set per-collective efficiencies, ``perfmodel.calibrated_efficiency``, and the
codec's per-element rates, every rank at once) ("calibrated model"), and a third time with
horovod_terngrad.operations.timeline, which schedules the step as Horovod runs it (collectives overlap backward,
concurrent ones fuse into one round, codec stages on the main thread) on the calibrated inputs
("scheduled model").  None uses the timed steps; ``--predict-only`` recomputes the predictions of a
saved run.

Timing: a warm-up round first (every configuration runs its warm-up steps before any is timed), then
``--rounds`` rounds in which the calibration and the configurations take turns, ``--steps`` timed
steps each; figures are medians over all rounds.

The emulated hosts share this machine's cores, which real hosts do not: Open MPI's busy-polling in one
rank would steal the core another rank computes on, so ranks are started with
``terngrad-launch --shared-cores`` (OMPI_MCA_mpi_yield_when_idle=1: waiting ranks yield the CPU), as
Open MPI does itself when it knows a node is oversubscribed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETNS = os.path.join(ROOT, "launch", "netns-cluster.sh")
LAUNCH = os.path.join(ROOT, "launch", "terngrad-launch")
RSH = os.path.join(ROOT, "launch", "netns-rsh")
PY = sys.executable
CONFIGS = "fp32,fp16,terngrad,terngrad-sharded"
METHOD = {"fp32": "fp32", "fp16": "fp16", "terngrad": "terngrad_allgather", "terngrad-sharded": "terngrad_sharded"}


def sh(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


def measure_link_gbps(h0: str, h1: str, ip1: str, nbytes: int = 200_000_000) -> float:
    """TCP throughput from h0 to h1 (Python sockets inside the namespaces)."""
    server = subprocess.Popen(["ip", "netns", "exec", h1, PY, "-c",
                               "import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
                               "s.bind(('0.0.0.0',5999));s.listen(1);c,_=s.accept()\n"
                               "n=0\nwhile True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\nprint(n)"],
                              stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    client = sh(["ip", "netns", "exec", h0, PY, "-c",
                 f"import socket,time;s=socket.create_connection(('{ip1}',5999));b=bytes(1<<20);t=time.time()\n"
                 f"for _ in range({nbytes >> 20}): s.sendall(b)\n"
                 "s.shutdown(socket.SHUT_WR);s.recv(1);print(time.time()-t)"], timeout=300)
    server.wait(60)
    return nbytes * 8 / float(client.stdout.strip()) / 1e9


def model_sizes(layers: int, width: int) -> list[int]:
    return [width * width, width] * layers


def profile(layers: int, width: int, batch: int) -> float:
    from horovod_terngrad.operations import models
    from horovod_terngrad.operations.perfmodel import profile_compute
    torch.manual_seed(0)
    return profile_compute(models.mlp(layers, width), batch, (width,), steps=5)


def codec_rate(rates) -> float:
    """Elements per second of (prepare + encode) on one core: the additive model's codec throughput."""
    return 1.0 / (rates.prepare + rates.encode)


def run_case(hosts: int, rate: str, args) -> dict:
    prefix = "tgb"
    sh([NETNS, "down", "--prefix", prefix])
    up = sh([NETNS, "up", str(hosts), "--rate", rate, "--prefix", prefix, "--subnet", "10.78.0"])
    if up.returncode:
        raise RuntimeError(up.stderr)
    try:
        names = [f"{prefix}-h{i}" for i in range(hosts)]
        gbps = measure_link_gbps(names[0], names[1], "10.78.0.2") if rate == "none" else None
        out = f"/tmp/emulated-{hosts}-{rate}.json"
        cmd = [NETNS, "exec", names[0], LAUNCH, "-np", str(hosts), "-H", ",".join(f"{h}:1" for h in names),
               "--launcher", "mpirun", "--network", "ethernet", "--iface", "eth0", "--rsh-agent", RSH, "--no-preflight",
               "--shared-cores",
               "--", PY, "-m", "horovod_terngrad.operations.bench", "step", "--layers", str(args.layers), "--width", str(args.width),
               "--batch", str(args.batch), "--steps", str(args.steps), "--rounds", str(args.rounds), "--warmup", "2", "--configs", CONFIGS,
               "--calibrate", "--json", out]
        p = sh(cmd, timeout=3000, env=dict(os.environ, PYTHONPATH=ROOT))
        if p.returncode:
            raise RuntimeError(p.stdout[-2000:] + p.stderr[-2000:])
        with open(out) as f:
            res = json.load(f)
        res.update(hosts=hosts, rate=rate, measured_gbps=gbps)
        return res
    finally:
        sh([NETNS, "down", "--prefix", prefix])


def predict(res: dict, compute_1: float, rates, cpus: int | None = None) -> tuple[dict, dict, dict]:
    """(link-rate model, calibrated model, scheduled model) step times in ms per configuration."""
    from horovod_terngrad.operations.launcher import network_env
    from horovod_terngrad.operations.perfmodel import Network, calibrated_efficiency, predict_step
    from horovod_terngrad.operations.timeline import CodecRates, timeline_step
    rate_elems = codec_rate(rates)
    cycle_s = float(network_env("ethernet", "eth0", [], True)["HOROVOD_CYCLE_TIME"]) / 1000
    hosts = res["hosts"]
    gbps = 1.0 if res["rate"] == "1gbit" else res["measured_gbps"]
    net = Network.from_gbps("emulated", gbps, 30.0)
    share = max(1.0, hosts / (cpus or os.cpu_count() or 2))   # emulated hosts share the run's machine's cores
    sizes = model_sizes(res["layers"], res["width"])
    cal = res["calibration"]
    # alpha from a 4-byte allreduce (2(N-1) latency terms); then each collective's bandwidth efficiency
    alpha_us = 1e3 * cal["small_allreduce_ms"] / max(1, 2 * (hosts - 1))
    cal_net = calibrated_efficiency(Network.from_gbps("emulated", gbps, alpha_us), hosts,
                                    {k: tuple(cal[k]) for k in ("allreduce", "allgather", "alltoall")}, strict=False)
    res["alpha_us"] = alpha_us
    res["efficiency"] = {k: cal_net.eff(k) for k in ("allreduce", "allgather", "alltoall")}
    # The codec's rates as the calibration measured them inside the cluster (every rank at once, slowest
    # rank); older runs have none: this machine's rates, slowed by the ranks sharing each core.
    if "codec_s_per_element" in cal:
        cal_rates, res["codec_source"] = CodecRates(**cal["codec_s_per_element"]), "calibration"
    else:
        cal_rates, res["codec_source"] = rates.slowed(share), "this machine, slowed by sharing"
    plain, calibrated, scheduled = {}, {}, {}
    for key, method in METHOD.items():
        # a synchronous step waits for its slowest rank: the schedule starts from that rank's compute
        slowest = cal.get("compute_slowest_ms", cal["compute_ms"]) / 1000
        scheduled[key] = 1000 * timeline_step(sizes, slowest, hosts, cal_net, method,
                                              codec=cal_rates, cycle_s=cycle_s).step_s
        plain[key] = 1000 * predict_step(sizes, compute_1 * share, hosts, net, method=method,
                                         codec_elements_per_s=rate_elems / share).step_s
        calibrated[key] = 1000 * predict_step(sizes, cal["compute_ms"] / 1000, hosts, cal_net, method=method,
                                              codec_elements_per_s=codec_rate(cal_rates)).step_s
    return plain, calibrated, scheduled


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", default="2,4")
    p.add_argument("--rates", default="1gbit,none")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=2500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds in which the configurations (and the calibration) take turns; medians over all")
    p.add_argument("--out", default="docs/cluster")
    p.add_argument("--predict-only", default="", metavar="JSON",
                   help="recompute the predictions (and the table) of a saved emulated_cluster.json; runs nothing")
    args = p.parse_args(argv)
    from horovod_terngrad.operations.timeline import CodecRates, measure_codec_rates
    torch.set_num_threads(1)
    if args.predict_only:
        with open(args.predict_only) as f:
            saved = json.load(f)
        compute_1, rows = saved["compute_ms_one_core"] / 1000, saved["cases"]
        if "codec_s_per_element" in saved:
            rates = CodecRates(**saved["codec_s_per_element"])
        else:
            print("emulated_cluster_benchmark: the saved run has no codec rates; measuring them on this machine")
            rates = measure_codec_rates()
        args.layers, args.width, args.batch = rows[0]["layers"], rows[0]["width"], saved.get("batch", args.batch)
        args.steps = saved.get("steps", args.steps)
        args.rounds = saved.get("rounds", 1)
        cpus = saved.get("cpus")
        for res in rows:
            res["predicted_ms"], res["calibrated_ms"], res["scheduled_ms"] = predict(res, compute_1, rates, cpus)
    else:
        if os.geteuid() != 0:
            sys.exit("emulated_cluster_benchmark: needs root (network namespaces)")
        compute_1 = profile(args.layers, args.width, args.batch)
        rates = measure_codec_rates()
        cpus = os.cpu_count()
        print(f"compute per step on one core: {1000 * compute_1:.1f} ms; codec ns/element: "
              f"{ {k: round(1e9 * v, 3) for k, v in rates.__dict__.items()} }", flush=True)
        rows = []
        for hosts in (int(h) for h in args.hosts.split(",")):
            for rate in args.rates.split(","):
                res = run_case(hosts, rate, args)
                res.update(layers=args.layers, width=args.width)
                res["predicted_ms"], res["calibrated_ms"], res["scheduled_ms"] = predict(res, compute_1, rates, cpus)
                rows.append(res)
                print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
                for r in res["rows"]:
                    print(f"  {hosts} hosts {rate}: {r['config']:18s} measured {r['step_ms']:8.1f} ms  "
                          f"link-rate model {res['predicted_ms'][r['config']]:8.1f} ms  "
                          f"calibrated model {res['calibrated_ms'][r['config']]:8.1f} ms  "
                          f"scheduled model {res['scheduled_ms'][r['config']]:8.1f} ms", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "emulated_cluster.json"), "w") as f:
        json.dump({"compute_ms_one_core": 1000 * compute_1, "codec_s_per_element": rates.__dict__,
                   "cpus": cpus or 2, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
                   "cases": rows}, f, indent=1)
    lines = [f"MLP {args.layers}x{args.width}x{args.width} ({sum(model_sizes(args.layers, args.width))} parameters), "
             f"batch {args.batch} per rank, one rank per emulated host, median of {args.steps * args.rounds} steps "
             f"({args.rounds} interleaved rounds of {args.steps}: fp32, fp16, TernGrad, sharded, then again).", "",
             "| hosts | link | exchange | measured ms/step | link-rate model | error | calibrated model | error | "
             "scheduled model | error | vs fp32 | vs fp16 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in rows:
        by = {r["config"]: r["step_ms"] for r in res["rows"]}
        link = res["rate"] if res["rate"] != "none" else f"unshaped ({res['measured_gbps']:.1f} Gbit/s measured)"
        for r in res["rows"]:
            pr, pc, m = res["predicted_ms"][r["config"]], res["calibrated_ms"][r["config"]], r["step_ms"]
            ps = res["scheduled_ms"][r["config"]]
            lines.append(f"| {res['hosts']} | {link} | {r['config']} | {m:.1f} | {pr:.1f} | {100 * (pr - m) / m:+.0f}% | "
                         f"{pc:.1f} | {100 * (pc - m) / m:+.0f}% | {ps:.1f} | {100 * (ps - m) / m:+.0f}% | "
                         f"{m / by['fp32']:.2f}x | {m / by['fp16']:.2f}x |")
    lines += ["", "Calibration (per cluster, measured in every round before the timed steps; medians): compute ms/step with every rank computing, "
              "and the efficiency of each collective (fraction of the link rate the alpha-beta model assumes):", "",
              "| hosts | link | compute ms (median) | compute ms (slowest rank) | alpha us (4-byte allreduce) | allreduce | allgather | alltoall |",
              "|---|---|---|---|---|---|---|---|"]
    for res in rows:
        e = res["efficiency"]
        slow = res["calibration"].get("compute_slowest_ms", float("nan"))
        lines.append(f"| {res['hosts']} | {res['rate']} | {res['calibration']['compute_ms']:.1f} | {slow:.1f} | {res['alpha_us']:.0f} | "
                     f"{e['allreduce']:.2f} | "
                     f"{e['allgather']:.2f} | {e['alltoall']:.2f} |")
    with open(os.path.join(args.out, "emulated_cluster.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
