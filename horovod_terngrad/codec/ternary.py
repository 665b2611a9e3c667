"""TernGrad math on one flat fp32 tensor: statistics, clipping, scaler, stochastic ternarization.

Paper (Wen et al. 2017) notation, for a gradient g of n elements:

* clipping (Eq. 21):   f(g_i) = g_i if |g_i| <= c·σ else sign(g_i)·c·σ,  σ = std(g), c = 2.5
* scaler  (Eq. 2):     s = max(|f(g)|)  = min(max|g|, c·σ)   (so no second pass is needed)
                       optionally one scaler per bucket of k elements instead of per tensor
* ternarize (Eq. 1-3): t_i = sign(f(g_i))·b_i,  P(b_i = 1) = |f(g_i)| / s,  so E[s·t] = f(g)

Rules that keep this well defined on every input:

* σ is the population standard deviation, from fp64 sums (Σg, Σg²) of one pass.  When c = 0 or
  σ = 0 (a constant tensor, a single element) clipping is off: clipping at 0 would erase the signal.
* The sums have one defined order, so every backend gets the same σ to the last bit: blocks of
  STATS_BLOCK = 2048 elements; in a block, 32 interleaved lanes (element j goes to lane j mod 32),
  each summed sequentially; the lane partials, block after block, then reduced by an 8-way tree:
  level by level, groups of 8 consecutive values (zero-padded) become ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7)),
  until one value is left.  32 lanes are one warp on a GPU (coalesced reads) and four independent
  AVX-512 chains on a CPU.  (g² of an fp32 g is exact in fp64, so only the additions round.)
* s = 0 (an all-zero tensor or bucket) gives t = 0 without dividing by zero.
* Callers pass fp32, contiguous, finite data; the frontends check and convert (see ``validate``).

Everything here is torch ops on the tensor's own device with no host synchronization, so it is the
reference the fused CPU and CUDA backends must match bit for bit.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from .rng import UNIFORM_BITS, uniform24
from .sizes import num_buckets

_TWO_POW_24 = float(1 << UNIFORM_BITS)
STATS_BLOCK = 2048
STATS_LANES = 32


def block_sums(x64: torch.Tensor) -> torch.Tensor:
    """Lane partials [num_blocks * 32] of a flat fp64 tensor, block-major (see module docstring)."""
    n = x64.numel()
    nblk = max(1, -(-n // STATS_BLOCK))
    x = torch.nn.functional.pad(x64, (0, nblk * STATS_BLOCK - n))
    lanes = x.view(nblk, STATS_BLOCK // STATS_LANES, STATS_LANES).cumsum(dim=1)[:, -1, :]  # sequential
    return lanes.reshape(-1)


def _sum8(x: torch.Tensor) -> torch.Tensor:
    """Rows of 8 -> ((x0+x1)+(x2+x3))+((x4+x5)+(x6+x7))."""
    return ((x[:, 0] + x[:, 1]) + (x[:, 2] + x[:, 3])) + ((x[:, 4] + x[:, 5]) + (x[:, 6] + x[:, 7]))


def combine_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Sum of the lane partials by the 8-way tree (see module docstring); a 0-d tensor."""
    x = blocks.reshape(-1)
    while x.numel() > 1:
        x = _sum8(torch.nn.functional.pad(x, (0, (-x.numel()) % 8)).view(-1, 8))
    return x.reshape(())


@dataclass
class TensorStats:
    """One pass of statistics over a flat fp32 tensor (all device tensors, no host sync)."""

    numel: int
    sum: torch.Tensor        # fp64 scalar
    sumsq: torch.Tensor      # fp64 scalar
    maxabs: torch.Tensor     # fp32 [num_buckets]: max |g| per bucket (one bucket = whole tensor)
    nonfinite: torch.Tensor  # bool scalar: any NaN/Inf


def tensor_stats(g: torch.Tensor, bucket_size: int = 0) -> TensorStats:
    n = g.numel()
    g64 = g.to(torch.float64)
    nb = num_buckets(n, bucket_size)
    a = g.abs()
    if n == 0:
        maxabs = torch.zeros(1, dtype=torch.float32, device=g.device)
    elif nb == 1:
        maxabs = a.max().reshape(1)
    else:
        pad = nb * bucket_size - n
        maxabs = torch.nn.functional.pad(a, (0, pad)).view(nb, bucket_size).amax(dim=1)
    return stats_from_blocks(n, block_sums(g64), block_sums(g64 * g64), maxabs)


def stats_from_blocks(n: int, blk_sum, blk_sq, maxabs: torch.Tensor, totals=None) -> TensorStats:
    """Combine per-block partials (or take already combined ``totals``).  NaN/Inf anywhere make the
    fp64 sums non-finite (finite fp32 squares cannot overflow fp64), so that is the whole NaN/Inf check."""
    total, sq = totals if totals is not None else (combine_blocks(blk_sum), combine_blocks(blk_sq))
    return TensorStats(numel=n, sum=total, sumsq=sq, maxabs=maxabs,
                       nonfinite=~(torch.isfinite(total) & torch.isfinite(sq)))


def clip_threshold(stats: TensorStats, clip_factor: float) -> torch.Tensor:
    """c·σ as an fp32 device scalar; +inf (no clipping) when c = 0, σ = 0 or the tensor is empty."""
    dev = stats.sum.device
    if clip_factor <= 0 or stats.numel == 0:
        return torch.full((), float("inf"), dtype=torch.float32, device=dev)     # a fill: no copy from the host
    mean = stats.sum / stats.numel
    var = torch.clamp(stats.sumsq / stats.numel - mean * mean, min=0.0)
    thr = (clip_factor * torch.sqrt(var)).to(torch.float32)
    return torch.where(thr > 0, thr, torch.full_like(thr, float("inf")))


def to_f32(x: float) -> float:
    """Round a Python float to the nearest fp32 value (ties to even), overflowing to ±inf."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def clip_threshold_host(n: int, total: float, sumsq: float, clip_factor: float) -> float:
    """``clip_threshold`` in Python floats (IEEE double, the same operations in the same order)."""
    if clip_factor <= 0 or n == 0:
        return math.inf
    mean = total / n
    var = sumsq / n - mean * mean
    var = var if (var >= 0 or var != var) else 0.0   # clamp(min=0), NaN passes through like torch
    if var != var:
        return math.nan
    thr = to_f32(clip_factor * math.sqrt(var))
    return thr if thr > 0 else math.inf


@dataclass
class Prepared:
    """What ternarizing one tensor needs, from one statistics pass: the clip threshold, the local
    scalers (zero where the tensor held NaN/Inf) and that flag.  Every backend gives tensors on the
    gradient's device, whatever the device (so nothing waits for it, and callers never branch on type):
    ``float(p.threshold)`` and ``bool(p.nonfinite)`` read them on the host when needed."""

    numel: int
    threshold: torch.Tensor  # fp32 0-d: c·σ, or +inf when clipping is off
    scalers: torch.Tensor    # fp32 [num_buckets]
    nonfinite: torch.Tensor  # bool 0-d: the tensor held NaN/Inf


def prepare(g: torch.Tensor, bucket_size: int, clip_factor: float) -> Prepared:
    """Reference: statistics, clip threshold and local scalers with torch ops on g's device."""
    st = tensor_stats(g, bucket_size)
    thr = clip_threshold(st, clip_factor)
    s = local_scalers(st, thr)
    return Prepared(st.numel, thr, torch.where(st.nonfinite, torch.zeros_like(s), s), st.nonfinite)


def local_scalers(stats: TensorStats, threshold: torch.Tensor) -> torch.Tensor:
    """Per-bucket scaler s = max|clip(g)| = min(max|g|, c·σ), fp32 [num_buckets]."""
    return torch.minimum(stats.maxabs, threshold)


def expand_scalers(scalers: torch.Tensor, bucket_size: int, n: int) -> torch.Tensor:
    """Each of n elements' scaler: the one layer-wise scaler, or bucket i // bucket_size's."""
    return scalers if scalers.numel() == 1 else scalers.repeat_interleave(bucket_size)[:n]


def ternarize(g: torch.Tensor, threshold: torch.Tensor, scalers: torch.Tensor, bucket_size: int,
              key: tuple[int, int]) -> torch.Tensor:
    """Stochastic ternary vector t in {-1, 0, 1} (int8), with E[scaler·t] = clip(g).

    ``scalers`` must be >= the local max|clip(g)| of each bucket (the shared scaler of Eq. 4 is the
    max over ranks, so it is).  Element i keeps its sign when uniform24(key, i) < |clip(g_i)|/s·2^24.
    """
    n = g.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int8, device=g.device)
    if not isinstance(threshold, torch.Tensor):
        threshold = torch.full((), float(threshold), dtype=torch.float32, device=g.device)
    c = torch.clamp(g, -threshold, threshold)
    p = c.abs() / expand_scalers(scalers, bucket_size, n)                           # NaN where s == 0 (then c == 0 too): compares False
    r = uniform24(key, 0, n, device=g.device).to(torch.float32)
    keep = r < p * _TWO_POW_24
    return (torch.sign(c) * keep).to(torch.int8)
