"""Fused CPU backend: ``kernels/terngrad_cpu.c`` compiled once with the system C compiler, called via ctypes.

One pass per stage and no tensor-sized temporaries besides the output; OpenMP threads follow
``torch.get_num_threads()``.  The shared object goes to the compile cache (``compile_cache.py``) keyed by
a hash of the source, the flags, the compiler and the CPU.  Without a working compiler ``load()`` returns
None and the caller falls back to the torch reference (with one warning).  Besides the interface (the ternary code's
``encode``, the four-level code's ``encode_levels``, ``decode`` of either), its capabilities: ``SHARDED_SUMS``,
``NOISE_DECODE``, ``ADAM_CORRECTED``, ``REQUANT``, ``NEAREST`` and ``SQUARE_SUMS``.
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile

import torch

from .. import codec
from ..codec import levels, packing, sizes, squares
from ..codec.packing import FORMATS
from ..codec.sizes import PACKINGS
from .base import (ADAM_CORRECTED, NEAREST, NOISE_DECODE, REQUANT, SHARDED_SUMS, SQUARE_SUMS, RequantDecodeTargets,
                   levels_inputs, requant_encode_inputs, ternary_packing)
from .compile_cache import KERNEL_DIR, compile_cached, kernel_source

log = logging.getLogger("horovod_terngrad")
SOURCE = os.path.join(KERNEL_DIR, "terngrad_cpu.c")
# -fno-math-errno: errno is never read, and without it sqrtf cannot be vectorized (tg_adam_corrected); no result changes
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno", "-fno-strict-aliasing",
          "-std=gnu11", "-fPIC", "-shared"]
ABI_VERSION = 12

_c_int64, _c_float, _c_int, _u32 = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_uint32
_P = ctypes.c_void_p


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return platform.processor()


def build(cc: str | None = None) -> str:
    """Compile (or find in the cache) the fused CPU codec; returns its path.  Raises on failure."""
    cc = cc or os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    ver = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    flags = CFLAGS + (["-fopenmp"] if _has_openmp(cc) else []) + ["-lm"]
    src = kernel_source("terngrad_cpu.c")
    return compile_cached(cc, flags, src, [src], "terngrad_cpu",
                          repr((ver, platform.machine(), _cpu_model())))


def _has_openmp(cc: str) -> bool:
    with tempfile.TemporaryDirectory() as d:
        c = os.path.join(d, "t.c")
        with open(c, "w") as f:
            f.write("#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n")
        return subprocess.run([cc, "-fopenmp", c, "-o", os.path.join(d, "t")],
                              capture_output=True).returncode == 0


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class FusedCPUBackend:
    """The backend interface on the fused C codec: statistics combined in Python floats on the host,
    payloads and averages written in place by one C pass each."""

    name = "cpu-fused"
    capabilities = frozenset({SHARDED_SUMS, NOISE_DECODE, ADAM_CORRECTED, REQUANT, NEAREST, SQUARE_SUMS})

    def __init__(self, lib: ctypes.CDLL):
        if lib.tg_abi_version() != ABI_VERSION:
            raise RuntimeError("terngrad_cpu ABI mismatch")
        lib.tg_stats.argtypes = [_P, _c_int64, _c_int64, _P, _P, _c_int64, _c_int]
        lib.tg_stats.restype = ctypes.c_int
        lib.tg_ternarize_pack.argtypes = [_P, _c_int64, _c_float, _P, _c_int64, _u32, _u32, _c_int, _P, _c_int]
        lib.tg_levels_pack.argtypes = [_P, _c_int64, _c_float, _P, _c_int64, _u32, _u32, _u32, _u32, _u32, _c_int, _u32,
                                       _P, _c_int]
        lib.tg_decode_average.argtypes = [_P, _P, _c_int, _c_int64, _c_int, _c_int64, _c_float, _c_int, _P, _c_int]
        lib.tg_decode_shared.argtypes = [_P, _P, _c_int, _c_int64, _c_int, _c_int64, _c_float, _c_int, _P, _c_int]
        lib.tg_owner_sums.argtypes = [_P, _c_int, _c_int64, _c_int, _c_int, _P, _c_int]
        lib.tg_unpack_sums.argtypes = [_P, _c_int64, _c_int, _c_int, _P, _c_int64, _c_int64, _c_float, _P, _c_int]
        lib.tg_adam_corrected.argtypes = [_P, _P, _P, _P, _P, _P, _P, _c_int64] + [_c_float] * 10 + [_c_int, _c_int]
        lib.tg_requant_encode.argtypes = [_P, _P, _c_int, _c_int64, _c_int64, _u32, _u32, _u32, _u32, _c_int, _P,
                                          _c_int64, _c_int]
        lib.tg_requant_decode.argtypes = [_P, _c_int64, _P, _P, _c_int]
        lib.tg_nearest_pack.argtypes = [_P, _c_int64, _P, _c_int64, _c_int, _P, _c_int]
        lib.tg_clipped_square_sums.argtypes = [_P, _c_int64, _c_int64, _c_float, _P, _c_int]
        lib.tg_clipped_square_sums.restype = ctypes.c_int
        for fn in (lib.tg_ternarize_pack, lib.tg_levels_pack, lib.tg_nearest_pack, lib.tg_decode_average,
                   lib.tg_decode_shared, lib.tg_owner_sums, lib.tg_unpack_sums, lib.tg_adam_corrected,
                   lib.tg_requant_encode, lib.tg_requant_decode):
            fn.restype = None
        self.lib = lib

    @staticmethod
    def _threads() -> int:
        return max(1, torch.get_num_threads())

    def stats(self, g32: torch.Tensor, bucket_size: int) -> tuple[float, float, torch.Tensor]:
        """(Σg, Σg², max|g| per bucket) in the codec's defined order."""
        n = g32.numel()
        nb = codec.num_buckets(n, bucket_size)
        totals = (ctypes.c_double * 2)(0.0, 0.0)
        maxabs = torch.zeros(nb, dtype=torch.float32)
        if n and self.lib.tg_stats(_ptr(g32), n, bucket_size, totals, _ptr(maxabs), nb, self._threads()):
            raise MemoryError("tg_stats: out of memory")
        return totals[0], totals[1], maxabs

    def adam_corrected(self, p, m, v, n, g, noise, vmax, *, beta1: float, beta2: float, step: float,
                       inv_bias2_sqrt: float, eps: float, decay: float, l2: float, noise_coef: float,
                       floor: float, maximize: bool) -> None:
        """``AdamCorrectedBackend.adam_corrected``: horovod_terngrad.optim's default-mode Adam(W) update of one
        contiguous fp32 tensor in one pass (kernels/terngrad_cpu.c, tg_adam_corrected: the formula there);
        ``noise`` / ``vmax`` may be None."""
        self.lib.tg_adam_corrected(_ptr(p), _ptr(m), _ptr(v), _ptr(n), _ptr(g), None if noise is None else _ptr(noise),
                                   None if vmax is None else _ptr(vmax), p.numel(), 1 - beta1, beta2, 1 - beta2, step,
                                   inv_bias2_sqrt, eps, decay, l2, noise_coef, floor, int(bool(maximize)),
                                   self._threads())

    def prepare(self, g32: torch.Tensor, bucket_size: int, clip_factor: float) -> codec.Prepared:
        n = g32.numel()
        total, sumsq, maxabs = self.stats(g32, bucket_size)
        nonfinite = not (math.isfinite(total) and math.isfinite(sumsq))
        thr = codec.ternary.clip_threshold_host(n, total, sumsq, clip_factor)   # already an fp32 value
        if nonfinite:
            scalers = torch.zeros_like(maxabs)
        elif maxabs.numel() == 1:
            scalers = torch.tensor([min(maxabs.item(), thr)], dtype=torch.float32)
        else:
            scalers = torch.clamp(maxabs, max=thr)
        return codec.Prepared(n, torch.tensor(thr, dtype=torch.float32), scalers, torch.tensor(nonfinite))

    def encode(self, g32, threshold, scalers, bucket_size, key, fmt, flags=0, shape=None) -> torch.Tensor:
        n = g32.numel()
        payload, region = packing.new_payload(n, ternary_packing(fmt), scalers, bucket_size, flags, shape)
        s = scalers.to(torch.float32).contiguous()
        if n:
            self.lib.tg_ternarize_pack(_ptr(g32), n, float(threshold), _ptr(s), bucket_size, key[0], key[1],
                                       FORMATS[fmt], _ptr(region), self._threads())
        return payload

    def encode_levels(self, g32, threshold, scalers, bucket_size, own_key, shared_key, rank, group_size, flags=0,
                      shape=None) -> torch.Tensor:
        """``Backend.encode_levels``: codec/levels.py's ``encode`` in one pass (kernels/terngrad_cpu.c, tg_levels_pack:
        clip, the stratified dithers, the four-level rounding and the packing per chunk), the same bytes."""
        k, poly = levels_inputs(rank, group_size)
        g = g32.reshape(-1).to(torch.float32).contiguous()
        n = g.numel()
        payload, region = packing.new_payload(n, levels.FORMAT, scalers, bucket_size, flags, shape)
        s = scalers.to(torch.float32).contiguous()
        if n:
            self.lib.tg_levels_pack(_ptr(g), n, float(threshold), _ptr(s), bucket_size, own_key[0], own_key[1],
                                    shared_key[0], shared_key[1], rank, k, poly, _ptr(region), self._threads())
        return payload

    def decode(self, gathered: torch.Tensor, headers: list, offsets: list, divisor: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return self._decode(gathered, headers, offsets, divisor, out, magnitude=False)

    # -- NOISE_DECODE capability --------------------------------------------------------------------------
    def decode_noise(self, gathered: torch.Tensor, headers: list, offsets: list, divisor: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """``NoiseDecodeBackend.decode_noise``: the decode's own pass with squared scalers and codes read as
        |t| (four-level codes: as their squared levels, codec/levels.py's ``decode_average(..., squares=True)``),
        straight from the gathered payloads (no copies of them)."""
        return self._decode(gathered, headers, offsets, float(divisor) ** 2, out, magnitude=True)

    def _decode(self, gathered, headers, offsets, divisor, out, magnitude: bool) -> torch.Tensor:
        h0 = headers[0]
        n, nb = h0.numel, h0.num_scalers
        out = torch.empty(n, dtype=torch.float32) if out is None else out
        if not n:
            return out
        raw = memoryview(gathered.numpy())
        hb = packing.HEADER_BYTES
        scaler_bytes = [bytes(raw[o + hb:o + hb + 4 * nb]) for o in offsets]
        scalers = torch.frombuffer(bytearray(b"".join(scaler_bytes)), dtype=torch.float32).view(len(offsets), nb)
        if magnitude:
            scalers = scalers * scalers      # fp32 squares, as the estimate's definition squares them
        base = gathered.data_ptr()
        k = len(offsets)
        pp = (ctypes.c_void_p * k)(*[base + o + hb + 4 * nb for o in offsets])
        # the exact integer sums under one shared scaler exist for the ternary packings only
        if h0.fmt in PACKINGS and all(torch.equal(scalers[i], scalers[0]) for i in range(1, k)):
            self.lib.tg_decode_shared(pp, _ptr(scalers[0]), k, n, FORMATS[h0.fmt], h0.bucket_size,
                                      float(divisor), int(magnitude), _ptr(out), self._threads())
        else:
            sp = (ctypes.c_void_p * k)(*[_ptr(scalers[i]) for i in range(k)])
            self.lib.tg_decode_average(pp, sp, k, n, FORMATS[h0.fmt], h0.bucket_size, float(divisor),
                                       int(magnitude), _ptr(out), self._threads())
        return out

    # -- SHARDED_SUMS capability --------------------------------------------------------------------------
    def owner_sums(self, received: torch.Tensor, n_ranks: int, m: int, fmt: str, bits: int) -> torch.Tensor:
        """``ShardedSumsBackend.owner_sums`` in one pass, chunked over the OpenMP threads."""
        ternary_packing(fmt)
        nbytes = received.numel() // n_ranks if n_ranks else 0
        out = torch.empty(-(-m * bits // 8), dtype=torch.uint8)
        if m:
            base = received.data_ptr()
            pp = (ctypes.c_void_p * n_ranks)(*[base + r * nbytes for r in range(n_ranks)])
            self.lib.tg_owner_sums(pp, n_ranks, m, FORMATS[fmt], bits, _ptr(out), self._threads())
        return out

    def decode_sums(self, data: torch.Tensor, m: int, n_ranks: int, bits: int, scalers: torch.Tensor,
                    bucket_size: int, start: int, divisor: float, out: torch.Tensor) -> None:
        """``ShardedSumsBackend.decode_sums`` in one pass."""
        if m:
            s = scalers.to(torch.float32).contiguous()
            self.lib.tg_unpack_sums(_ptr(data), m, n_ranks, bits, _ptr(s), bucket_size, start, float(divisor),
                                    _ptr(out), self._threads())

    # -- REQUANT capability -------------------------------------------------------------------------------
    def requant_encode(self, a: torch.Tensor, keys: tuple, start: int, noise: torch.Tensor | None = None,
                       flags: int = 0) -> torch.Tensor:
        """``RequantBackend.requant_encode``: codec/requant.py's ``encode`` in one pass (kernels/terngrad_cpu.c,
        tg_requant_encode), the same bytes."""
        a, nu = requant_encode_inputs(a, noise, start)
        m = a.numel()
        out = torch.empty(sizes.requantized_owner_bytes(m, noise is not None), dtype=torch.uint8)
        (ka0, ka1), (kn0, kn1) = keys
        self.lib.tg_requant_encode(_ptr(a), None if nu is None else _ptr(nu), int(nu is not None), m, start, ka0, ka1,
                                   kn0, kn1, int(flags) & 0xFF, _ptr(out), out.numel(), self._threads())
        return out

    def requant_decode(self, buf: torch.Tensor, offset: int, m: int, with_noise: bool, out: torch.Tensor,
                       noise_out: torch.Tensor | None = None) -> None:
        """``RequantBackend.requant_decode``: codec/requant.py's ``decode`` in one pass (tg_requant_decode), the
        same bits; straight from ``buf`` at any offset, into ``out`` / ``noise_out`` (copied back if they are not
        contiguous fp32)."""
        if m == 0:
            return
        t = RequantDecodeTargets(buf, offset, m, with_noise, out, noise_out)
        self.lib.tg_requant_decode(buf.data_ptr() + offset, m, _ptr(t.out), None if t.noise is None else _ptr(t.noise),
                                   self._threads())
        t.finish()

    # -- NEAREST capability -------------------------------------------------------------------------------
    def encode_nearest(self, d: torch.Tensor, fmt: str, bucket_size: int = 0) -> torch.Tensor:
        """``NearestBackend.encode_nearest``: codec/nearest.py's payload in one pass after the statistics
        (tg_stats' max|d| per bucket, the reference's amax), the same bytes."""
        n = d.numel()
        d = d.to(torch.float32).contiguous()
        ternary_packing(fmt)
        bucket = sizes.header_bucket(n, bucket_size)
        scalers = self.stats(d, bucket)[2] if n else torch.zeros(1, dtype=torch.float32)
        payload, region = packing.new_payload(n, fmt, scalers, bucket, 0, (n,))
        if n:
            self.lib.tg_nearest_pack(_ptr(d), n, _ptr(scalers), bucket, FORMATS[fmt], _ptr(region), self._threads())
        return payload

    # -- SQUARE_SUMS capability ---------------------------------------------------------------------------
    def clipped_square_sums(self, g: torch.Tensor, threshold: torch.Tensor, bounds: list) -> torch.Tensor:
        """``SquareSumsBackend.clipped_square_sums``: each run of equal shards (``squares.equal_runs``) in one pass
        (tg_clipped_square_sums: clip, square and the ordered sum's first level together), the same bits."""
        g = g.to(torch.float32).contiguous()
        out = torch.zeros(len(bounds), dtype=torch.float32)
        thr = float(threshold)
        for i, j, lo, length in squares.equal_runs(bounds):
            if self.lib.tg_clipped_square_sums(g.data_ptr() + 4 * lo, j - i, length, thr, _ptr(out) + 4 * i,
                                               self._threads()):
                raise MemoryError("tg_clipped_square_sums: out of memory")
        return out


def load() -> FusedCPUBackend | None:
    """The fused backend, or None (with one warning) when it cannot be built here."""
    try:
        return FusedCPUBackend(ctypes.CDLL(build()))
    except Exception as e:  # noqa: BLE001 - any failure means: use the reference path
        log.warning("TernGrad: fused CPU codec unavailable (%s); using the slower torch reference path", e)
        return None
