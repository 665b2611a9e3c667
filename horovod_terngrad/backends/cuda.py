"""CUDA backend: the kernels of ``kernels/terngrad.cu`` compiled by CuPy and driven by ``KernelBackend``.

* ``KernelBackend`` implements the backend interface on any kernel set, i.e. any object with a
  ``device`` and a ``launch(name, work, args)`` (``KernelLauncher``).  It never synchronizes with the
  device: thresholds and scalers stay device tensors (computed by the last statistics kernel), and the
  "all payloads share their scalers" decision of the decode is made on the device (ternary payloads only: the
  four-level code of ``encode_levels`` always takes the general formula).  It reads fp32 and
  bf16 gradients as they are (``BF16_INPUT``).
* ``CupyKernels`` is the CUDA kernel set: ``cupy.RawModule`` (NVRTC) compiled once per process (CuPy
  also caches the binary on disk), launched on torch's current CUDA stream, tensors passed as their
  device addresses.  CuPy is imported only when one is made.
* ``traffic`` gives the bytes each kernel path moves per element, to turn a measured time into a
  fraction of the device's bandwidth.

The same source built for the host (``host_build.HostKernels``) runs this driver without a GPU.
"""
from __future__ import annotations

import os
from typing import Protocol

import torch

from .. import codec
from ..codec import levels, packing, sizes
from ..codec.packing import FORMATS
from ..codec.ternary import STATS_BLOCK, STATS_LANES
from .base import (BF16_INPUT, REQUANT, SHARDED_SUMS, RequantDecodeTargets, levels_inputs, requant_encode_inputs,
                   ternary_packing)
from .compile_cache import KERNEL_DIR, kernel_source

SOURCE = os.path.join(KERNEL_DIR, "terngrad.cu")
NVCC_OPTIONS = ("--fmad=false", "-std=c++14")
THREADS = 256

# Argument kinds of every kernel: p = device pointer (a tensor, an address as an int, or None for null),
# i64 / u32 / i32 / f32 / f64 = scalars.
SIGNATURES = {
    "tg_stats_f32": ("p", "i64", "p", "p", "p"),
    "tg_stats_bf16": ("p", "i64", "p", "p", "p"),
    "tg_tree": ("p", "p", "p", "i64", "i32", "p", "p", "p", "i64", "f64", "i64", "p", "p"),
    "tg_bucket_max_f32": ("p", "i64", "i64", "p"),
    "tg_bucket_max_bf16": ("p", "i64", "i64", "p"),
    "tg_bucket_scalers": ("p", "i64", "p", "p"),
    "tg_pack_f32": ("p", "i64", "p", "p", "i64", "u32", "u32", "i32", "p"),
    "tg_pack_bf16": ("p", "i64", "p", "p", "i64", "u32", "u32", "i32", "p"),
    "tg_levels_pack_f32": ("p", "i64", "p", "p", "i64", "u32", "u32", "u32", "u32", "u32", "i32", "u32", "p"),
    "tg_levels_pack_bf16": ("p", "i64", "p", "p", "i64", "u32", "u32", "u32", "u32", "u32", "i32", "u32", "p"),
    "tg_decode_scalers": ("p", "p", "i64", "i32", "i64", "p", "p"),
    "tg_decode": ("p", "p", "i64", "i32", "i64", "i32", "p", "i64", "i64", "p", "f32", "p"),
    "tg_owner_sums": ("p", "i64", "i32", "i64", "i32", "i32", "p"),
    "tg_decode_sums": ("p", "i64", "i32", "i32", "p", "i64", "i64", "f32", "p"),
    "tg_requant_encode": ("p", "p", "i32", "i64", "i64", "u32", "u32", "u32", "u32", "i32", "p", "i64"),
    "tg_requant_decode": ("p", "i64", "p", "p"),
}
# Gradient dtypes the kernels read as they are (the suffix of their kernels); others are converted to fp32.
INPUT_KERNELS = {torch.float32: "f32", torch.bfloat16: "bf16"}
OCTETS = STATS_LANES // 8      # threads (of 8 lanes each) per statistics block


def traffic(op: str, *, in_bytes: int = 4, fmt: str = "2bit", payloads: int = 1) -> float:
    """Bytes of device memory each kernel path moves per element (the table in the header of terngrad.cu).

    ``compress``: the statistics pass reads the gradient (``in_bytes`` per element: 4 fp32, 2 bf16), the
    ternarize pass reads it again and writes 1/4 (2bit) or 1/5 (base3) byte of codes: 8.25 for fp32 2bit.
    ``decode``: reads ``payloads`` packed codes (1/4 or 1/5 byte each) and writes one fp32.  Per-lane partials
    (20 bytes per 512 elements), scalers and headers are left out: under 1% of the total at a million elements.
    Per-bucket scalers (bucket_size > 0) read the gradient once more: add ``in_bytes`` to ``compress``."""
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
        """Run kernel ``name`` over ``work`` items (a grid-stride loop) with ``args``: tensors, or device addresses
        as ints (None: null) for pointers, and scalars."""
        ...


class CupyStreams:
    """CuPy's view of each torch CUDA stream, made once and kept (making one per launch costs the host)."""

    LIMIT = 64      # streams made and dropped by the caller: keep the cache bounded

    def __init__(self, cupy):
        self.cupy, self.streams = cupy, {}

    def current(self, device=None):
        """CuPy's view of torch's current stream (of ``device``, else of the current device)."""
        handle = torch.cuda.current_stream(device).cuda_stream
        stream = self.streams.get(handle)
        if stream is None:
            if len(self.streams) >= self.LIMIT:
                self.streams.clear()
            stream = self.streams[handle] = self.cupy.cuda.ExternalStream(handle)
        return stream


class CupyKernels:
    """The kernel source compiled by CuPy (NVRTC) for the current CUDA device.

    A launch costs the host a few microseconds: pointers go to CuPy as numpy integers (no DLPack wrapper per
    tensor), the argument converters are made once per kernel, and the CuPy view of each torch stream is made
    once and kept."""

    device = "cuda"

    def __init__(self):
        import cupy
        import numpy as np
        self.cupy = cupy
        with open(kernel_source("terngrad.cu")) as f:
            self.module = cupy.RawModule(code=f.read(), options=NVCC_OPTIONS)
        self.functions = {name: self.module.get_function(name) for name in SIGNATURES}
        sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        self.grid_limit = 32 * sm

        def pointer(a, u64=np.uint64):
            return u64(a.data_ptr() if isinstance(a, torch.Tensor) else (a or 0))
        kinds = {"p": pointer, "i64": np.int64, "u32": np.uint32, "i32": np.int32, "f32": np.float32,
                 "f64": np.float64}
        self.converters = {name: tuple(kinds[k] for k in sig) for name, sig in SIGNATURES.items()}
        self.streams = CupyStreams(cupy)

    def launch(self, name: str, work: int, args: list) -> None:
        conv = tuple(c(a) for c, a in zip(self.converters[name], args))
        grid = max(1, min(self.grid_limit, -(-work // THREADS)))
        with self.streams.current():
            self.functions[name]((grid,), (THREADS,), conv)


def _levels(m: int) -> int:
    """Levels of the 8-way tree that reduce m values to one."""
    levels = 0
    while m > 1:
        m, levels = -(-m // 8), levels + 1
    return levels


def tree_plan(m: int) -> list[int]:
    """Levels per tg_tree launch for m first-level partials: one level while many values are left (a thread per
    output reads 8), two (a thread reads 64) once few are, the last launch taking the last one or two."""
    plan, left = [], _levels(m)
    while left > 2:
        step = 2 if m <= 4096 else 1
        plan.append(step)
        m, left = -(-m // 8 ** step), left - step
    return plan + [left] if left else plan


class KernelBackend:
    """prepare / encode / encode_levels / decode (the backend interface) on a kernel set.

    Gradients may be fp32 or bf16 (read as they are: the bytes are those of the fp32 copy); other dtypes are
    converted to fp32 first.  The sharded exchange's owner sums and their decode (``SHARDED_SUMS``) and the
    requantized exchange's owner payload (``REQUANT``) run here too."""

    capabilities: frozenset[str] = frozenset({BF16_INPUT, SHARDED_SUMS, REQUANT})

    def __init__(self, kernels: KernelLauncher):
        self.k = kernels
        self.name = "cuda-kernels" if kernels.device == "cuda" else "host-kernels"

    @staticmethod
    def _input(g: torch.Tensor) -> torch.Tensor:
        g = g.reshape(-1)
        if g.dtype not in INPUT_KERNELS:
            g = g.to(torch.float32)
        return g.contiguous()

    def prepare(self, g32: torch.Tensor, bucket_size: int, clip_factor: float) -> codec.Prepared:
        """Statistics (one pass over g), the tree of partials and the threshold and scalers, all on the device:
        2 + (number of tree launches) kernels, 3 with per-bucket scalers."""
        g = self._input(g32)
        n, dev = g.numel(), g.device
        nb = codec.num_buckets(n, bucket_size)
        if n == 0:
            st = codec.TensorStats(0, torch.zeros((), dtype=torch.float64, device=dev),
                                   torch.zeros((), dtype=torch.float64, device=dev),
                                   torch.zeros(1, dtype=torch.float32, device=dev),
                                   torch.zeros((), dtype=torch.bool, device=dev))
            thr = codec.clip_threshold(st, clip_factor)
            return codec.Prepared(0, thr, codec.local_scalers(st, thr), st.nonfinite)
        sfx = INPUT_KERNELS[g.dtype]
        m = -(-n // STATS_BLOCK) * OCTETS
        plan = tree_plan(m)
        sizes = [m]
        for step in plan:
            sizes.append(-(-sizes[-1] // 8 ** step))
        # every level's sums, squares and maxima in one allocation: [sum | sq | max as fp32] per level
        ws = torch.empty(sum(2 * x + -(-x // 2) for x in sizes), dtype=torch.float64, device=dev)
        addr, ptrs = ws.data_ptr(), []
        for x in sizes:
            ptrs.append((addr, addr + 8 * x, addr + 16 * x))
            addr += 8 * (2 * x + -(-x // 2))
        prep = torch.empty(1 + nb, dtype=torch.float32, device=dev)
        nonfinite = torch.empty((), dtype=torch.bool, device=dev)
        self.k.launch("tg_stats_" + sfx, m, [g, n, *ptrs[0]])
        clip = float(clip_factor) if clip_factor > 0 else 0.0
        for lvl, step in enumerate(plan):
            last = lvl == len(plan) - 1
            self.k.launch("tg_tree", sizes[lvl + 1], [*ptrs[lvl], sizes[lvl], step, *ptrs[lvl + 1], n, clip, nb,
                                                      prep if last else None, nonfinite if last else None])
        if nb > 1:
            maxbits = torch.zeros(nb, dtype=torch.int32, device=dev)
            self.k.launch("tg_bucket_max_" + sfx, -(-n // 16), [g, n, bucket_size, maxbits])
            self.k.launch("tg_bucket_scalers", nb, [maxbits, nb, nonfinite, prep])
        return codec.Prepared(n, prep[0], prep[1:], nonfinite)

    @staticmethod
    def _threshold_and_scalers(threshold, scalers: torch.Tensor, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 threshold [1] and contiguous fp32 scalers on ``dev`` the pack kernels read (no copy where they
        already are: prepare's own tensors)."""
        thr = threshold
        if not (isinstance(thr, torch.Tensor) and thr.dtype == torch.float32 and thr.device == dev):
            thr = torch.as_tensor(threshold).to(device=dev, dtype=torch.float32)
        s = scalers
        if not (s.dtype == torch.float32 and s.device == dev and s.is_contiguous()):
            s = s.to(device=dev, dtype=torch.float32).contiguous()
        return thr.reshape(1), s

    def encode(self, g32, threshold, scalers, bucket_size, key, fmt, flags=0, shape=None) -> torch.Tensor:
        g = self._input(g32)
        n, dev = g.numel(), g.device
        payload, region = packing.new_payload(n, ternary_packing(fmt), scalers, bucket_size, flags, shape)
        if n:
            thr, s = self._threshold_and_scalers(threshold, scalers, dev)
            self.k.launch("tg_pack_" + INPUT_KERNELS[g.dtype], -(-region.numel() // 4),
                          [g, n, thr, s, bucket_size, key[0], key[1], FORMATS[fmt], region])
        return payload

    def encode_levels(self, g32, threshold, scalers, bucket_size, own_key, shared_key, rank, group_size, flags=0,
                      shape=None) -> torch.Tensor:
        """``Backend.encode_levels``: codec/levels.py's ``encode`` (tg_levels_pack_*, one thread per word of 16
        codes), the same bytes; fp32 and bf16 gradients read as they are."""
        k, poly = levels_inputs(rank, group_size)
        g = self._input(g32)
        n, dev = g.numel(), g.device
        payload, region = packing.new_payload(n, levels.FORMAT, scalers, bucket_size, flags, shape)
        if n:
            thr, s = self._threshold_and_scalers(threshold, scalers, dev)
            self.k.launch("tg_levels_pack_" + INPUT_KERNELS[g.dtype], -(-region.numel() // 4),
                          [g, n, thr, s, bucket_size, own_key[0], own_key[1], shared_key[0], shared_key[1], rank, k,
                           poly, region])
        return payload

    def decode(self, gathered: torch.Tensor, headers: list, offsets: list, divisor: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        h0 = headers[0]
        n, nb, dev = h0.numel, h0.num_scalers, gathered.device
        out = torch.empty(n, dtype=torch.float32, device=dev) if out is None else out
        if n == 0:
            return out
        hb, npay = packing.HEADER_BYTES, len(offsets)
        off = packing.device_constant(offsets, torch.int64, dev)
        scalers = torch.empty(npay * nb, dtype=torch.float32, device=dev)
        shared = torch.ones(1, dtype=torch.int32, device=dev)
        self.k.launch("tg_decode_scalers", npay * nb, [gathered, off, hb, npay, nb, scalers, shared])
        self.k.launch("tg_decode", -(-packing.packed_size(n, h0.fmt) // 4),
                      [gathered, off, hb + 4 * nb, npay, n, FORMATS[h0.fmt], scalers, nb, h0.bucket_size, shared,
                       float(divisor), out])
        return out

    # -- SHARDED_SUMS capability ----------------------------------------------------------------------------------
    def owner_sums(self, received: torch.Tensor, n_ranks: int, m: int, fmt: str, bits: int) -> torch.Tensor:
        """``ShardedSumsBackend.owner_sums``: one thread per 8 sums (``bits`` whole bytes)."""
        ternary_packing(fmt)
        nbytes = received.numel() // n_ranks if n_ranks else 0
        out = torch.empty(-(-m * bits // 8), dtype=torch.uint8, device=received.device)
        if m:
            self.k.launch("tg_owner_sums", -(-m // 8),
                          [received.contiguous(), nbytes, n_ranks, m, FORMATS[fmt], bits, out])
        return out

    def decode_sums(self, data: torch.Tensor, m: int, n_ranks: int, bits: int, scalers: torch.Tensor,
                    bucket_size: int, start: int, divisor: float, out: torch.Tensor) -> None:
        """``ShardedSumsBackend.decode_sums`` into ``out`` (a contiguous fp32 view)."""
        if m:
            s = scalers
            if not (s.dtype == torch.float32 and s.device == data.device and s.is_contiguous()):
                s = s.to(device=data.device, dtype=torch.float32).contiguous()
            self.k.launch("tg_decode_sums", -(-m // 8),
                          [data.contiguous(), m, n_ranks, bits, s, bucket_size, start, float(divisor), out])

    # -- REQUANT capability ---------------------------------------------------------------------------------------
    def requant_encode(self, a: torch.Tensor, keys: tuple, start: int, noise: torch.Tensor | None = None,
                       flags: int = 0) -> torch.Tensor:
        """``RequantBackend.requant_encode``: codec/requant.py's ``encode`` (tg_requant_encode), the same bytes."""
        a, nu = requant_encode_inputs(a, noise, start)
        m = a.numel()
        out = torch.empty(sizes.requantized_owner_bytes(m, noise is not None), dtype=torch.uint8, device=a.device)
        (ka0, ka1), (kn0, kn1) = keys
        self.k.launch("tg_requant_encode", max(1, -(-m // sizes.REQUANT_GROUP)),
                      [a, nu, int(nu is not None), m, start, ka0, ka1, kn0, kn1, int(flags) & 0xFF, out, out.numel()])
        return out

    def requant_decode(self, buf: torch.Tensor, offset: int, m: int, with_noise: bool, out: torch.Tensor,
                       noise_out: torch.Tensor | None = None) -> None:
        """``RequantBackend.requant_decode``: codec/requant.py's ``decode`` (tg_requant_decode), the same bits;
        straight from ``buf`` at any offset, into ``out`` / ``noise_out`` (copied back if they are not contiguous
        fp32)."""
        if m == 0:
            return
        t = RequantDecodeTargets(buf, offset, m, with_noise, out, noise_out)
        self.k.launch("tg_requant_decode", -(-m // 8), [buf.data_ptr() + offset, m, t.out, t.noise])
        t.finish()
