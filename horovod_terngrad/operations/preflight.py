"""Preflight: every rank reports where it runs and how TernGrad will run there.

Launched by the launcher (``python -m horovod_terngrad.operations.preflight``) with the same launcher and settings
as the training that follows; rank 0 prints one line per rank.  Exits non-zero when the ranks' Horovod
builds or TernGrad switches disagree.
"""
from __future__ import annotations

import os
import socket
import sys


def report() -> dict:
    import horovod.torch as hvd
    import torch

    from ..backends import cpu_fused, cuda_kernels
    cuda = torch.cuda.is_available()
    if cuda:
        dev = torch.cuda.current_device() if hvd.local_rank() >= torch.cuda.device_count() else hvd.local_rank()
        device = f"cuda:{dev} {torch.cuda.get_device_name(dev)}"
        backend = "cuda-kernels (CuPy)" if cuda_kernels() is not None else "torch reference on CUDA (no CuPy)"
    else:
        device = "cpu"
        backend = "cpu-fused (C)" if cpu_fused() is not None else "torch reference (no C compiler)"
    build = ",".join(name for name, ok in (("mpi", hvd.mpi_built()), ("gloo", hvd.gloo_built()),
                                            ("nccl", hvd.nccl_built())) if ok)
    net = os.environ.get("HOROVOD_TERNGRAD_NETWORK", "unset")
    iface = os.environ.get("NCCL_SOCKET_IFNAME") or os.environ.get("HOROVOD_GLOO_IFACE") or "-"
    return {"rank": hvd.rank(), "size": hvd.size(), "host": socket.gethostname(), "device": device,
            "horovod": f"{hvd.__version__ if hasattr(hvd, '__version__') else ''}[{build}]",
            "controller": "mpi" if hvd.mpi_enabled() else "gloo", "network": f"{net} iface={iface}",
            "terngrad": os.environ.get("HOROVOD_TERNGRAD", "1"), "backend": backend}


def main() -> int:
    import horovod.torch as hvd
    hvd.init()
    mine = report()
    everyone = hvd.allgather_object(mine)
    rc = 0
    if hvd.rank() == 0:
        print(f"preflight: {mine['size']} ranks", flush=True)
        for r in everyone:
            print(f"preflight: rank {r['rank']} host={r['host']} device={r['device']} horovod={r['horovod']} "
                  f"controller={r['controller']} network={r['network']} terngrad={'on' if r['terngrad'] != '0' else 'off'} "
                  f"backend={r['backend']}", flush=True)
        for key in ("horovod", "terngrad", "controller"):
            if len({r[key] for r in everyone}) != 1:
                print(f"preflight: ERROR ranks disagree on {key}: {sorted({r[key] for r in everyone})}", flush=True)
                rc = 1
    rc = int(hvd.broadcast_object(rc, root_rank=0))
    hvd.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
