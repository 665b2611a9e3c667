"""What ``horovodrun --gloo`` does, across the emulated hosts of launch/netns-cluster.sh (horovodrun reaches hosts
by ssh, which namespaces have not): a rendezvous server on the first host and one process per slot started inside
its host's namespace with Horovod's gloo environment.  Run inside the first host's namespace:

    launch/netns-cluster.sh exec tgl-h0 python docs/cluster/link_measurement_gloo.py tgl-h0:2,tgl-h1:2 10.78.0.1 \\
        -- python docs/cluster/link_measurement.py
"""
import os
import subprocess
import sys

from horovod.runner.common.util import hosts as hosts_util
from horovod.runner.http.http_server import RendezvousServer

HERE = os.path.dirname(os.path.abspath(__file__))
NETNS = os.path.join(HERE, "..", "..", "launch", "netns-cluster.sh")


def main():
    spec, addr = sys.argv[1], sys.argv[2]
    command = sys.argv[sys.argv.index("--") + 1:]
    hosts = hosts_util.parse_hosts(spec)
    np_ = sum(h.slots for h in hosts)
    plan = hosts_util.get_host_assignments(hosts, np_)
    server = RendezvousServer(verbose=0)
    port = server.start()
    server.init(plan)
    procs = []
    for slot in plan:
        env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
               "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "eth0",
               "NCCL_SOCKET_IFNAME": "eth0", "HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank),
               "HOROVOD_SIZE": str(slot.size), "HOROVOD_LOCAL_RANK": str(slot.local_rank),
               "HOROVOD_LOCAL_SIZE": str(slot.local_size), "HOROVOD_CROSS_RANK": str(slot.cross_rank),
               "HOROVOD_CROSS_SIZE": str(slot.cross_size), "PYTHONUNBUFFERED": "1"}
        args = ["env"] + [f"{k}={v}" for k, v in env.items()] + command
        procs.append(subprocess.Popen([NETNS, "exec", slot.hostname] + args))   # its own host name, as gloo resolves it
    rc = max(p.wait() for p in procs)
    server.stop()
    sys.exit(rc)


if __name__ == "__main__":
    main()
