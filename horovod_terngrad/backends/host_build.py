"""Host build of the CUDA kernels: ``kernels/terngrad.cu`` compiled by g++ with ``kernels/host_shim.h``.

``HostKernels`` is a kernel set for ``cuda.KernelBackend`` whose launches run as loops over blocks and
threads on the CPU.  It lets the CUDA source, and the driver of ``cuda.py``, be tested on a machine without
a GPU, byte for byte against the reference codec.  Tests and CPU-only verification only: it is slow.
"""
from __future__ import annotations

import ctypes
import os
import shutil

import torch

from .compile_cache import compile_cached, kernel_source
from .cuda import SIGNATURES

HOST_CXXFLAGS = ["-O2", "-std=c++17", "-ffp-contract=off", "-fno-strict-aliasing", "-fPIC", "-shared"]


def build_host(cxx: str | None = None, launcher: str = "host_launch.cpp", source: str = "terngrad.cu",
               name: str = "terngrad_hostkernels") -> str:
    """Compile ``kernels/<launcher>`` (which includes ``host_shim.h`` and ``kernels/<source>``) into a cached shared
    object named after ``name``; returns its path."""
    cxx = cxx or os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    srcs = [kernel_source(f) for f in (launcher, "host_shim.h", source)]
    return compile_cached(cxx, HOST_CXXFLAGS, srcs[0], srcs, name)


class HostKernels:
    """The kernel source built for the host (tests and CPU-only verification)."""

    device = "cpu"

    def __init__(self, grid_limit: int = 3, block: int = 32):
        # A tiny grid makes every grid-stride loop go round many times, which is what we want to test.
        self.grid_limit, self.block = grid_limit, block
        self.lib = ctypes.CDLL(build_host())
        kinds = {"p": ctypes.c_void_p, "i64": ctypes.c_int64, "u32": ctypes.c_uint32, "i32": ctypes.c_int,
                 "f32": ctypes.c_float, "f64": ctypes.c_double}
        for name, sig in SIGNATURES.items():
            fn = getattr(self.lib, "host_" + name)
            fn.argtypes = [ctypes.c_uint, ctypes.c_uint] + [kinds[k] for k in sig]
            fn.restype = None

    def launch(self, name: str, work: int, args: list) -> None:
        grid = max(1, min(self.grid_limit, -(-work // self.block)))
        conv = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        getattr(self.lib, "host_" + name)(grid, self.block, *conv)
