"""Step times of real model shapes on an emulated cluster, launched as users launch: plain ``mpirun``, no
terngrad-launch, TernGrad at its defaults.  Needs root and iproute2 (launch/netns-cluster.sh).

    .venv/bin/python examples/realshapes_benchmark.py --models resnet50,transformer --hosts 2,4 \\
        --rates 1gbit,none --out docs/realshapes

For each (model, hosts, rate): bring up the cluster, run ``python -m horovod_terngrad.operations.bench step
--calibrate`` with one rank per emulated host (``OMP_NUM_THREADS=1`` and ``OMPI_MCA_mpi_yield_when_idle=1``:
the hosts share this machine's cores, see README), tear the cluster down, and print one table row per
configuration with the step-time limit beside every TernGrad figure:

    limit = compute (every rank computing, no exchange, measured in the same run)
            + codec (TernGrad's own clock in the timed steps)
            + the bytes this rank receives per step at the link rate.

Configurations take turns in ``--rounds`` rounds (medians over all rounds), so a slow spell of the shared
machine lands on all of them.  Results go to ``<out>/<model>-n<hosts>-<rate>.json`` and ``<out>/table.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETNS = os.path.join(ROOT, "launch", "netns-cluster.sh")
RSH = os.path.join(ROOT, "launch", "netns-rsh")
PREFIX, SUBNET = "tgr", "10.79.0"
RATES_BPS = {"1gbit": 1e9, "10gbit": 1e10}


def run_on_cluster(hosts: int, rate: str, prefix: str, subnet: str, cmd: list, timeout: int, what: str,
                   **run_kw) -> None:
    """Bring up an emulated cluster of ``hosts`` at ``rate``, run ``cmd`` (printing the tail of its output),
    and tear the cluster down, also when the command fails (``SystemExit`` naming ``what``)."""
    subprocess.run([NETNS, "down", "--prefix", prefix], capture_output=True)
    subprocess.run([NETNS, "up", str(hosts), "--rate", rate, "--prefix", prefix, "--subnet", subnet],
                   check=True, capture_output=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **run_kw)
        print(p.stdout[-3000:], flush=True)
        if p.returncode != 0:
            raise SystemExit(f"{what} failed:\n{p.stderr[-3000:]}")
    finally:
        subprocess.run([NETNS, "down", "--prefix", prefix], capture_output=True)


def sweep(args, run_case, rows, header: list, script: str, argv: list) -> None:
    """Every (model, hosts, rate) of ``args`` in turn: ``rows(run_case(...), rate)`` under ``header``, printed
    as it grows and appended to ``<out>/table.md`` with the command line."""
    os.makedirs(args.out, exist_ok=True)
    table = list(header)
    for model in args.models.split(","):
        for hosts in (int(h) for h in args.hosts.split(",")):
            for rate in args.rates.split(","):
                table += rows(run_case(model, hosts, rate, args), rate)
                print("\n".join(table), flush=True)
    with open(os.path.join(args.out, "table.md"), "a") as f:
        f.write(f"\n`{' '.join([script] + argv)}`\n\n")
        f.write("\n".join(table) + "\n")


def run_case(model: str, hosts: int, rate: str, args) -> dict:
    out = os.path.join(os.path.abspath(args.out), f"{model}-n{hosts}-{rate}.json")
    host_list = ",".join(f"{PREFIX}-h{i}:1" for i in range(hosts))
    venv_bin = os.path.dirname(sys.executable)
    cmd = [NETNS, "exec", f"{PREFIX}-h0", "env", f"PATH={venv_bin}:{os.environ['PATH']}",
           "mpirun", "--allow-run-as-root", "-np", str(hosts), "-H", host_list, "--bind-to", "none",
           "--mca", "plm_rsh_agent", RSH, "--mca", "pml", "ob1", "--mca", "btl", "tcp,self,vader",
           "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
           "-x", "OMP_NUM_THREADS=1", "-x", "OMPI_MCA_mpi_yield_when_idle=1", "-x", f"PYTHONPATH={ROOT}",
           "-x", "PATH", sys.executable, "-m", "horovod_terngrad.operations.bench", "step",
           "--model", model, "--batch", str(args.batch), "--steps", str(args.steps),
           "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--configs", args.configs,
           "--calibrate", "--json", out]
    run_on_cluster(hosts, rate, PREFIX, SUBNET, cmd, args.timeout, f"{model} N={hosts} {rate}")
    with open(out) as f:
        return json.load(f)


def rows(res: dict, rate: str) -> list[str]:
    by = {r["config"]: r for r in res["rows"]}
    fp16, fp32 = by.get("fp16", {}).get("step_ms"), by.get("fp32", {}).get("step_ms")
    compute = res["calibration"]["compute_ms"]
    lines = []
    for r in res["rows"]:
        cells = [res["model"], str(res["ranks"]), rate, r["config"], f"{r['step_ms']:.0f}",
                 ", ".join(f"{x:.0f}" for x in r["step_ms_by_round"]),
                 f"{1000 * res['batch'] / r['step_ms']:.1f}",
                 f"{fp32 / r['step_ms']:.2f}x" if fp32 else "", f"{fp16 / r['step_ms']:.2f}x" if fp16 else ""]
        if "codec_ms" in r:
            wire_ms = 1000 * 8 * r["bytes_received_per_step"] / RATES_BPS[rate] if rate in RATES_BPS else 0.0
            limit = compute + r["codec_ms"] + wire_ms
            cells += [f"{limit:.0f} = {compute:.0f} + {r['codec_ms']:.0f} + {wire_ms:.0f}",
                      f"{r['step_ms'] / limit:.2f}x", f"{r['bits_per_element']:.2f}"]
        else:
            cells += ["", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


HEADER = ["| model | N | link | configuration | ms/step | by round | img/s per worker | vs fp32 | vs fp16 | "
          "limit ms (compute + codec + wire) | step / limit | bits/element sent |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="resnet50,transformer")
    p.add_argument("--hosts", default="2")
    p.add_argument("--rates", default="1gbit")
    p.add_argument("--configs", default="fp32,fp16,terngrad,terngrad-shared")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--out", default="docs/realshapes")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("realshapes_benchmark: needs root (network namespaces)")
    sweep(args, run_case, rows, HEADER, "examples/realshapes_benchmark.py",
          argv if argv is not None else sys.argv[1:])

if __name__ == "__main__":
    main()
