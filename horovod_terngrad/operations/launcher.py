"""One entry point to start a TernGrad training job with the right network settings.

    python -m horovod_terngrad.operations.launcher -np 8 -H node1:4,node2:4 --network ethernet -- python train.py
    launch/terngrad-launch --hostfile hosts.txt --network auto --launcher mpirun -- python train.py

It runs ``horovodrun``, ``mpirun`` or ``srun`` (inside a Slurm allocation) with what each network needs:

* ``infiniband``: NCCL over IB verbs (GPUDirect RDMA where the system allows), Open MPI over UCX, a large
  fusion buffer and a short cycle (latency is low, bandwidth high).
* ``ethernet``: NCCL and MPI over TCP pinned to one interface (a wrong interface, e.g. docker0 or a
  management port, silently wipes out what TernGrad saves), Gloo pinned to the same interface, a
  large fusion buffer and a longer cycle so that more tensors share one round trip.
* ``auto``: ``infiniband`` when an IB port is ACTIVE under /sys/class/infiniband, else ``ethernet`` on
  the interface that carries the default route.

Processes are not bound to cores (``--bind-to none``): PyTorch and Horovod run several threads per rank.
``--no-terngrad`` sets HOROVOD_TERNGRAD=0, which makes the TernGrad compressor pass tensors through
(a fp32 baseline without editing the script).  Before training, a preflight runs on every rank with the
same launcher and settings and prints host, device, Horovod build, network and TernGrad backend.
``--dry-run`` prints the exact commands and environment instead of running them.
What the cost model assumes about the links (HOROVOD_TERNGRAD_GBPS between nodes, and the other RATE_SETTINGS):
``--gbps`` first, then what the user exported, then the profile's figures.
Arguments are passed as argv lists, never through a shell, so any characters in them are safe.
"""
from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys

PROFILES = ("infiniband", "ethernet", "auto")
LAUNCHERS = ("horovodrun", "mpirun", "srun")
FUSION_MB = 64


class LaunchError(Exception):
    """A problem with the request; printed as 'terngrad-launch: error: ...' with exit code 2."""


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """'a:4,b:2,c' -> [('a', 4), ('b', 2), ('c', 1)]."""
    hosts = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, slots = item.partition(":")
        if not name or (slots and not slots.isdigit()) or (slots and int(slots) < 1):
            raise LaunchError(f"bad host entry {item!r}: expected HOST or HOST:SLOTS with SLOTS >= 1")
        hosts.append((name, int(slots) if slots else 1))
    if not hosts:
        raise LaunchError("no hosts given")
    return hosts


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """Lines 'host slots=N', 'host:N' or 'host'; '#' starts a comment."""
    if not os.path.isfile(path):
        raise LaunchError(f"hostfile {path!r} does not exist")
    hosts = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            name, slots = parts[0], 1
            if ":" in name:
                name, _, s = name.partition(":")
                slots = s
            for p in parts[1:]:
                if p.startswith("slots="):          # (max_slots= is a limit, not a slot count)
                    slots = p.split("=", 1)[1]
            if not str(slots).isdigit() or int(slots) < 1:
                raise LaunchError(f"{path}:{lineno}: bad slot count in {line!r}")
            hosts.append((name, int(slots)))
    if not hosts:
        raise LaunchError(f"hostfile {path!r} lists no hosts")
    return hosts


def default_route_iface() -> str | None:
    try:
        with open("/proc/net/route") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) > 2 and fields[1] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return None


def active_ib_devices(root: str = "/sys/class/infiniband") -> list[str]:
    found = []
    for state in sorted(glob.glob(os.path.join(root, "*", "ports", "*", "state"))):
        try:
            with open(state) as f:
                if "ACTIVE" in f.read():
                    parts = state.split(os.sep)
                    found.append(f"{parts[-4]}:{parts[-2]}")
        except OSError:
            continue
    return found


LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def all_local(hosts: list[tuple[str, int]]) -> bool:
    import socket
    return all(h in LOCAL_NAMES or h == socket.gethostname() for h, _ in hosts)


def resolve_network(profile: str, iface: str | None, hosts: list[tuple[str, int]] | None = None,
                    ib_root: str = "/sys/class/infiniband") -> tuple[str, str | None, list]:
    ib = active_ib_devices(ib_root)
    if profile == "auto":
        profile = "infiniband" if ib else "ethernet"
    if profile == "ethernet" and not iface and hosts is not None and all_local(hosts):
        iface = "lo"        # one machine: ranks talk over loopback (horovodrun maps localhost to 127.0.0.1)
    if profile == "ethernet" and not iface:
        iface = default_route_iface()
        if not iface:
            raise LaunchError("ethernet profile: no default route to pick an interface from; pass --iface")
    return profile, iface, ib


#: what the cost model assumes about the links (exchange/cost.py, configured_network): a rate the user gives,
#: exported or by --gbps, wins; the profile fills in only what the user left unset
RATE_SETTINGS = ("HOROVOD_TERNGRAD_GBPS", "HOROVOD_TERNGRAD_ALPHA_US", "HOROVOD_TERNGRAD_INTRA_GBPS",
                 "HOROVOD_TERNGRAD_INTRA_ALPHA_US", "HOROVOD_TERNGRAD_INTRA_LINKS")


def network_env(profile: str, iface: str | None, ib: list, terngrad: bool, given: dict | None = None,
                gbps: float | None = None) -> dict:
    """The environment the job runs with.  ``given``: the user's environment (default os.environ): a rate setting
    (RATE_SETTINGS) found there is passed on as it is, instead of the profile's; ``gbps`` (--gbps) sets
    HOROVOD_TERNGRAD_GBPS over both."""
    given = os.environ if given is None else given
    rates = {
        # what exchange='auto' and hierarchical='auto' assume about the network (horovod_terngrad/exchange/cost.py;
        # a rate given here also turns hierarchical='auto''s measurement of the links off)
        "HOROVOD_TERNGRAD_GBPS": "100" if profile == "infiniband" else "1",
        "HOROVOD_TERNGRAD_ALPHA_US": "5" if profile == "infiniband" else "50",
        # the link inside a node, for hierarchical="auto" (the performance model's: NVLink ~20 GB/s per
        # link, 3 links from each GPU to its peers in a fully connected node of 4; PCIe 3.0 switch ~10 GB/s
        # through each GPU's one port)
        "HOROVOD_TERNGRAD_INTRA_GBPS": "160" if profile == "infiniband" else "80",
        "HOROVOD_TERNGRAD_INTRA_ALPHA_US": "5" if profile == "infiniband" else "10",
        "HOROVOD_TERNGRAD_INTRA_LINKS": "3" if profile == "infiniband" else "1",
    }
    rates.update({k: given[k] for k in RATE_SETTINGS if k in given})
    if gbps is not None:
        rates["HOROVOD_TERNGRAD_GBPS"] = f"{gbps:g}"
    env = {
        "HOROVOD_FUSION_THRESHOLD": str(FUSION_MB * 1024 * 1024),
        "HOROVOD_CYCLE_TIME": "1" if profile == "infiniband" else "5",
        "HOROVOD_TERNGRAD": "1" if terngrad else "0",
        "HOROVOD_TERNGRAD_NETWORK": profile,
        **rates,
        # the node-aware exchange runs its groups as world collectives by default and needs no process sets;
        # with HOROVOD_TERNGRAD_NODE_GROUPS=process_sets, a shared scaler or the sharded exchange it adds them
        # after hvd.init(), which Horovod 0.28.1 allows only with dynamic process sets on at hvd.init()
        "HOROVOD_DYNAMIC_PROCESS_SETS": "1",
    }
    if profile == "infiniband":
        env.update({"NCCL_IB_DISABLE": "0", "NCCL_NET_GDR_LEVEL": "PHB"})
        if ib:
            env["UCX_TLS"] = "rc,sm,self"
            env["NCCL_IB_HCA"] = ",".join(d.split(":")[0] for d in ib)
            env["UCX_NET_DEVICES"] = ",".join(ib)
        else:
            print("terngrad-launch: warning: --network infiniband but no ACTIVE InfiniBand port under "
                  "/sys/class/infiniband on this host; UCX and NCCL will use what they find (TCP)",
                  file=sys.stderr)
        if iface:   # IPoIB or management interface for bootstrap
            env["NCCL_SOCKET_IFNAME"] = iface
            env["HOROVOD_GLOO_IFACE"] = iface
    else:
        # NCCL_IB_DISABLE is left alone: RoCE NICs (Ethernet with RDMA) are driven by NCCL's IB-verbs transport,
        # which NCCL_IB_DISABLE=1 would turn off for TCP sockets at a fraction of the rate.  On Ethernet without
        # verbs devices NCCL finds no IB device and uses sockets anyway, on the interface named here (also
        # its bootstrap's); a user who wants sockets over a RoCE NIC exports NCCL_IB_DISABLE=1 themselves.
        env.update({"NCCL_SOCKET_IFNAME": iface, "HOROVOD_GLOO_IFACE": iface})
    return env


def mpi_args(profile: str, iface: str | None, ib: list) -> list[str]:
    if profile == "infiniband" and ib:
        return ["--mca", "pml", "ucx", "--mca", "btl", "^openib,tcp"]
    # Ethernet, or an "infiniband" request on a host without an active port (Open MPI's UCX PML refuses
    # to run without one): TCP, pinned to the interface when there is one
    args = ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self,vader"]
    if iface:
        args += ["--mca", "btl_tcp_if_include", iface, "--mca", "oob_tcp_if_include", iface]
    return args


def build_command(args, hosts: list[tuple[str, int]], env: dict, profile: str, iface: str | None, ib: list,
                  command: list[str]) -> list[str]:
    host_list = ",".join(f"{h}:{s}" for h, s in hosts)
    if args.launcher == "horovodrun":
        exe = shutil.which("horovodrun", path=_bin_path()) or "horovodrun"
        cmd = [exe, "-np", str(args.np), "-H", host_list, "--fusion-threshold-mb", str(FUSION_MB),
               "--cycle-time-ms", env["HOROVOD_CYCLE_TIME"]]
        if iface:
            cmd += ["--network-interface", iface]
        cmd += ["--gloo"] if args.controller == "gloo" else ["--mpi", "--mpi-args", " ".join(mpi_args(profile, iface, ib))]
        return cmd + command
    if args.launcher == "mpirun":
        cmd = ["mpirun", "-np", str(args.np), "-H", host_list, "--bind-to", "none", "--map-by", "slot"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if args.rsh_agent:
            cmd += ["--mca", "plm_rsh_agent", args.rsh_agent]
        cmd += mpi_args(profile, iface, ib)
        for k in sorted(env):
            cmd += ["-x", k]
        for k in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH"):
            if k in os.environ:
                cmd += ["-x", k]
        return cmd + command
    # srun: inside an allocation; Slurm places the tasks, PMIx wires up MPI
    return ["srun", f"--ntasks={args.np}", f"--mpi={args.srun_mpi}", "--cpu-bind=none", "--export=ALL"] + command


def _gbps(text: str) -> float:
    """--gbps: a positive finite number of Gbit/s."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"--gbps takes a rate in Gbit/s > 0, got {text!r}")
    return value


def _bin_path() -> str:
    return os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])


def plan(argv=None):
    """Parse arguments and return (parsed arguments, commands, environment) without running anything."""
    p = argparse.ArgumentParser(prog="terngrad-launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-np", type=int, required=True, help="number of processes")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", default=None, help="host:slots,... (default localhost:NP)")
    hosts.add_argument("--hostfile", default=None, help="file of 'host slots=N' lines")
    p.add_argument("--network", default="auto", choices=PROFILES, help="network profile (default auto)")
    p.add_argument("--iface", default=None, help="network interface to pin (default: detected)")
    p.add_argument("--gbps", type=_gbps, default=None,
                   help="the link rate between nodes in Gbit/s, for exchange='auto' and hierarchical='auto' "
                        "(HOROVOD_TERNGRAD_GBPS; default: an exported HOROVOD_TERNGRAD_GBPS, else the profile's)")
    p.add_argument("--launcher", default="horovodrun", choices=LAUNCHERS)
    p.add_argument("--controller", default="gloo", choices=("gloo", "mpi"), help="horovodrun controller")
    p.add_argument("--srun-mpi", default="pmix", help="srun --mpi plugin (default pmix)")
    p.add_argument("--rsh-agent", default=None, help="mpirun: program that starts remote daemons (plm_rsh_agent)")
    tg = p.add_mutually_exclusive_group()
    tg.add_argument("--terngrad", dest="terngrad", action="store_true", default=True, help="TernGrad on (default)")
    tg.add_argument("--no-terngrad", dest="terngrad", action="store_false", help="TernGrad off (fp32 baseline)")
    p.add_argument("--shared-cores", action="store_true",
                   help="ranks of different hosts share CPU cores (an emulated cluster on one machine): Open MPI "
                        "ranks yield the CPU while they wait instead of busy-polling (mpi_yield_when_idle)")
    p.add_argument("--no-preflight", dest="preflight", action="store_false")
    p.add_argument("--dry-run", action="store_true", help="print the commands and environment, run nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if not command:
            raise LaunchError("no training command given (put it after --)")
        if args.np < 1:
            raise LaunchError(f"-np must be >= 1, got {args.np}")
        if args.hostfile:
            host_list = read_hostfile(args.hostfile)
        elif args.hosts:
            host_list = parse_hosts(args.hosts)
        else:
            host_list = [("localhost", args.np)]
        slots = sum(s for _, s in host_list)
        if args.launcher != "srun" and args.np > slots:
            raise LaunchError(f"-np {args.np} exceeds the {slots} slot(s) of "
                              f"{', '.join(f'{h}:{s}' for h, s in host_list)}")
        profile, iface, ib = resolve_network(args.network, args.iface, host_list)
    except LaunchError as e:
        p.error(str(e))
    env = network_env(profile, iface, ib, args.terngrad, gbps=args.gbps)
    if args.shared_cores:
        # Open MPI only yields by itself when it knows a node is oversubscribed; emulated hosts hide that,
        # and a rank spinning in MPI then takes the core another rank computes on (2x the step at N = 4)
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    preflight = [sys.executable, "-m", "horovod_terngrad.operations.preflight"]
    commands = []
    if args.preflight:
        commands.append(build_command(args, host_list, env, profile, iface, ib, preflight))
    commands.append(build_command(args, host_list, env, profile, iface, ib, command))
    return args, commands, env


def main(argv=None) -> int:
    args, commands, env = plan(argv)
    if args.dry_run:
        for k in sorted(env):
            print(f"export {k}={shlex.quote(env[k])}")
        for cmd in commands:
            print(shlex.join(cmd))
        return 0
    run_env = dict(os.environ)
    run_env.update(env)
    run_env["PATH"] = _bin_path()
    for cmd in commands:
        print("terngrad-launch: " + shlex.join(cmd), file=sys.stderr, flush=True)
        rc = subprocess.call(cmd, env=run_env)
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
