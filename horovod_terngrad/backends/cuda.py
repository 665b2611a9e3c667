"""CUDA backend: the kernels of ``kernels/terngrad.cu`` compiled by CuPy and driven by ``KernelBackend``.

* ``KernelBackend`` implements the backend interface on any kernel set, i.e. any object with a
  ``device`` and a ``launch(name, work, args)`` (``KernelLauncher``).  It never synchronizes with the
  device: thresholds and scalers stay device tensors, and the "all payloads share their scalers"
  decision of the decode is made on the device.
* ``CupyKernels`` is the CUDA kernel set: ``cupy.RawModule`` (NVRTC) compiled once per process (CuPy
  also caches the binary on disk), launched on torch's current CUDA stream, tensors passed zero-copy by
  DLPack.  CuPy is imported only when one is made.

The same source built for the host (``host_build.HostKernels``) runs this driver without a GPU.
"""
from __future__ import annotations

import os
from typing import Protocol

import torch

from .. import codec
from ..codec import packing
from ..codec.packing import FORMATS
from ..codec.ternary import STATS_BLOCK, STATS_LANES
from .compile_cache import KERNEL_DIR, kernel_source

SOURCE = os.path.join(KERNEL_DIR, "terngrad.cu")
NVCC_OPTIONS = ("--fmad=false", "-std=c++14")
THREADS = 256

# Argument kinds of every kernel: p = device pointer (a tensor), i64 / u32 / i32 / f32 = scalars.
SIGNATURES = {
    "tg_stats_lanes": ("p", "i64", "p", "p", "p"),
    "tg_sum8": ("p", "i64", "p"),
    "tg_bucket_max": ("p", "i64", "i64", "p"),
    "tg_ternarize_pack": ("p", "i64", "p", "p", "i64", "u32", "u32", "i32", "p"),
    "tg_decode": ("p", "p", "i32", "i64", "i32", "p", "i64", "i64", "p", "f32", "p"),
}


def traffic(op: str, *, in_bytes: int = 4, fmt: str = "2bit", payloads: int = 1) -> float:
    """Bytes of device memory each kernel path moves per element (the table in the header of terngrad.cu).

    ``compress``: the statistics pass reads the gradient (``in_bytes`` per element: 4 fp32, 2 bf16), the
    ternarize pass reads it again and writes 1/4 (2bit) or 1/5 (base3) byte of codes: 8.25 for fp32 2bit.
    ``decode``: reads ``payloads`` packed codes (1/4 or 1/5 byte each) and writes one fp32.  Per-lane partials,
    scalers and headers are left out: they are under 1% of the total at a million elements."""
    if fmt not in FORMATS:
        raise ValueError(f"traffic: fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    code = 1.0 / packing.CODES_PER_BYTE[fmt]
    if op == "compress":
        return 2.0 * in_bytes + code
    if op == "decode":
        return payloads * code + 4.0
    raise ValueError(f"traffic: op must be 'compress' or 'decode', got {op!r}")


class KernelLauncher(Protocol):
    """A build of ``kernels/terngrad.cu`` whose kernels (``SIGNATURES``) can be launched."""

    device: str   # "cuda" or "cpu": where the tensors passed to ``launch`` live

    def launch(self, name: str, work: int, args: list) -> None:
        """Run kernel ``name`` over ``work`` items (a grid-stride loop) with ``args`` (tensors or scalars)."""
        ...


class CupyKernels:
    """The kernel source compiled by CuPy (NVRTC) for the current CUDA device."""

    device = "cuda"

    def __init__(self):
        import cupy
        import numpy as np
        self.cupy, self.np = cupy, np
        with open(kernel_source("terngrad.cu")) as f:
            self.module = cupy.RawModule(code=f.read(), options=NVCC_OPTIONS)
        self.functions = {name: self.module.get_function(name) for name in SIGNATURES}
        sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.grid_limit = 32 * sm

    def launch(self, name: str, work: int, args: list) -> None:
        np, cupy = self.np, self.cupy
        scalar = {"i64": np.int64, "u32": np.uint32, "i32": np.int32, "f32": np.float32}
        conv = [cupy.from_dlpack(a) if kind == "p" else scalar[kind](a)
                for kind, a in zip(SIGNATURES[name], args)]
        grid = max(1, min(self.grid_limit, -(-work // THREADS)))
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        with stream:
            self.functions[name]((grid,), (THREADS,), tuple(conv))


class KernelBackend:
    """prepare / encode / decode (the backend interface) on a kernel set."""

    capabilities: frozenset[str] = frozenset()

    def __init__(self, kernels: KernelLauncher):
        self.k = kernels
        self.name = "cuda-kernels" if kernels.device == "cuda" else "host-kernels"

    def _tree_total(self, lanes: torch.Tensor) -> torch.Tensor:
        x = lanes
        while x.numel() > 1:
            out = torch.empty(-(-x.numel() // 8), dtype=torch.float64, device=x.device)
            self.k.launch("tg_sum8", out.numel(), [x, x.numel(), out])
            x = out
        return x.reshape(())

    def stats(self, g32: torch.Tensor, bucket_size: int) -> codec.TensorStats:
        n = g32.numel()
        dev = g32.device
        nb = codec.num_buckets(n, bucket_size)
        if n == 0:
            z = torch.zeros((), dtype=torch.float64, device=dev)
            return codec.TensorStats(0, z, z, torch.zeros(1, dtype=torch.float32, device=dev),
                                     torch.zeros((), dtype=torch.bool, device=dev))
        nlanes = -(-n // STATS_BLOCK) * STATS_LANES
        lanes = torch.empty(2, nlanes, dtype=torch.float64, device=dev)
        maxbits = torch.zeros(1, dtype=torch.int32, device=dev)
        self.k.launch("tg_stats_lanes", nlanes, [g32, n, lanes[0], lanes[1], maxbits])
        if nb == 1:
            maxabs = maxbits.view(torch.float32)
        else:
            maxabs = torch.empty(nb, dtype=torch.float32, device=dev)
            self.k.launch("tg_bucket_max", nb, [g32, n, bucket_size, maxabs])
        return codec.ternary.stats_from_blocks(n, None, None, maxabs,
                                               totals=(self._tree_total(lanes[0]), self._tree_total(lanes[1])))

    def prepare(self, g32: torch.Tensor, bucket_size: int, clip_factor: float) -> codec.Prepared:
        st = self.stats(g32, bucket_size)
        thr = codec.clip_threshold(st, clip_factor)
        s = codec.local_scalers(st, thr)
        return codec.Prepared(st.numel, thr, torch.where(st.nonfinite, torch.zeros_like(s), s), st.nonfinite)

    def encode(self, g32, threshold, scalers, bucket_size, key, fmt, flags=0, shape=None) -> torch.Tensor:
        n = g32.numel()
        payload, region = packing.new_payload(n, fmt, scalers, bucket_size, flags, shape)
        if n:
            thr = torch.as_tensor(threshold).to(device=g32.device, dtype=torch.float32).reshape(1)
            s = scalers.to(device=g32.device, dtype=torch.float32).contiguous()
            self.k.launch("tg_ternarize_pack", region.numel(),
                          [g32, n, thr, s, bucket_size, key[0], key[1], FORMATS[fmt], region])
        return payload

    def decode(self, gathered: torch.Tensor, headers: list, offsets: list, divisor: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        h0 = headers[0]
        n, nb, dev = h0.numel, h0.num_scalers, gathered.device
        out = torch.empty(n, dtype=torch.float32, device=dev) if out is None else out
        if n == 0:
            return out
        hb = packing.HEADER_BYTES
        off = packing.device_constant(offsets, torch.int64, dev)
        # scalers may sit at any byte offset: gather their bytes into an aligned [N, nb] fp32 tensor
        idx = off[:, None] + hb + torch.arange(4 * nb, device=dev)[None, :]
        scalers = gathered[idx].view(torch.float32).contiguous()
        shared = (scalers == scalers[0:1]).all().to(torch.int32).reshape(1)
        packed_off = off + hb + 4 * nb
        self.k.launch("tg_decode", packing.packed_size(n, h0.fmt),
                      [gathered, packed_off, len(offsets), n, FORMATS[h0.fmt], scalers, nb, h0.bucket_size,
                       shared, float(divisor), out])
        return out
