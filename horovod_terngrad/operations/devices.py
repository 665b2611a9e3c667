"""Where an example's rank computes: ``--device auto|cpu|cuda`` turned into a torch device and the matching
``torch.distributed`` backend, the one decision every example makes the same way.

- ``cpu``: the CPU, gloo.
- ``cuda``: the rank's local GPU, ``cuda:LOCAL_RANK`` (torchrun's ``LOCAL_RANK``, or Horovod's ``hvd.local_rank()``
  handed in), made current with ``torch.cuda.set_device``; NCCL.  Without a usable GPU it raises
  :class:`DeviceError` naming what is missing.
- ``auto``: ``cuda`` when ``torch.cuda.is_available()``, else ``cpu``.  Under Horovod it also needs a Horovod
  built with CUDA (``hvd.cuda_built()``): a Horovod built for the CPU only cannot take CUDA tensors.

Every rank of a job runs the same build on the same kind of node, so every rank decides the same.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class DeviceError(RuntimeError):
    """``--device`` asks for something this machine or build cannot give (names the option and the problem)."""


@dataclass(frozen=True)
class Placement:
    """One rank's device and the collectives backend that goes with it."""

    device: torch.device        # cpu, or cuda:<local rank>
    backend: str                # torch.distributed's: "nccl" on CUDA, "gloo" on the CPU
    local_rank: int
    note: str = ""              # why --device auto chose the CPU on a machine with a GPU ("" otherwise)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def device_ids(self) -> list[int] | None:
        """``DistributedDataParallel(device_ids=...)``: the one GPU on CUDA, None on the CPU."""
        return [self.device.index] if self.is_cuda else None

    @property
    def accelerator(self) -> str:
        """Lightning's ``Trainer(accelerator=...)``."""
        return "gpu" if self.is_cuda else "cpu"

    def describe(self) -> str:
        return f"{self.device} ({self.backend})"


def add_device_argument(parser) -> None:
    """``--device auto|cpu|cuda`` on an example's argparse parser."""
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="where each rank computes: cuda = its local GPU (cuda:LOCAL_RANK) with NCCL, cpu = the "
                             "CPU with gloo, auto = cuda when torch.cuda.is_available() (default: auto)")


def local_rank_from_env() -> int:
    """The rank's index on its node: torchrun's LOCAL_RANK, else Open MPI's or Slurm's, else 0."""
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(var)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise DeviceError(f"{var}={value!r} is not a local rank (an integer)") from None
    return 0


def _no_cuda_reason() -> str:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (install the CUDA build: scripts/setup.sh --cuda)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no GPU (no NVIDIA driver "
            "loaded, or no GPU on this node" + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")
            + ")")


def resolve_device(choice: str = "auto", local_rank: int | None = None, horovod=None) -> Placement:
    """The placement ``--device choice`` means for this rank; no side effect (``setup_device`` applies it).

    ``local_rank``: the rank's index on its node (default: :func:`local_rank_from_env`).  ``horovod``: the
    ``horovod.torch`` module when the example runs under Horovod, whose build must then take CUDA tensors.
    """
    if choice not in DEVICE_CHOICES:
        raise DeviceError(f"--device {choice!r}: expected one of {', '.join(DEVICE_CHOICES)}")
    if local_rank is None:
        local_rank = local_rank_from_env()
    cpu = Placement(torch.device("cpu"), "gloo", local_rank)
    if choice == "cpu":
        return cpu
    hvd_cuda = horovod is None or bool(horovod.cuda_built())
    if choice == "auto" and not torch.cuda.is_available():
        return cpu
    if choice == "auto" and not hvd_cuda:
        return Placement(cpu.device, cpu.backend, local_rank,
                         note="--device auto: using the CPU although a GPU is visible, because this Horovod was built "
                              "without CUDA (hvd.cuda_built() is False); scripts/setup.sh --cuda builds one with NCCL")
    if not torch.cuda.is_available():
        raise DeviceError(f"--device cuda: no CUDA device: torch.cuda.is_available() is False; {_no_cuda_reason()}. "
                          "Use --device cpu (or auto)")
    if not hvd_cuda:
        raise DeviceError("--device cuda: this Horovod was built without CUDA (hvd.cuda_built() is False), so it "
                          "cannot reduce CUDA tensors; rebuild it with scripts/setup.sh --cuda, or use --device cpu")
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DeviceError(f"--device {choice}: local rank {local_rank} has no GPU of its own: {count} visible on this "
                          f"node" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
                          + f"; start at most {count} ranks per node")
    return Placement(torch.device("cuda", local_rank), "nccl", local_rank)


def setup_device(choice: str = "auto", local_rank: int | None = None, horovod=None) -> Placement:
    """:func:`resolve_device`, then on CUDA ``torch.cuda.set_device`` to the rank's GPU (before any CUDA work or
    process group, so NCCL and the default stream use that GPU)."""
    placement = resolve_device(choice, local_rank, horovod)
    if placement.is_cuda:
        torch.cuda.set_device(placement.device)
    return placement
