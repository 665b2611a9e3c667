"""Counter-based random stream for stochastic ternarization.

Every uniform draw is a pure function of ``(seed, step, tensor_id, rank, element)``: no state, no
generator object, nothing that depends on thread scheduling or device.  Any rank's ternary vector can
therefore be recomputed exactly after the fact (tests do this), and the CPU and CUDA backends
(``kernels/terngrad.cu``) produce the same bits.

Construction
------------
1. The four key words are folded on the host into one 64-bit key with SplitMix64 (``stream_key``).
2. Element ``i`` (64-bit index, ``i = hi·2^32 + lo``) draws
       h = mix32(mix32(lo ^ k0) ^ hi ^ k1)              (k0, k1 = low/high 32 bits of the key)
   where ``mix32`` is the "lowbias32" integer finalizer (two xor-shift-multiply rounds; a bijection on
   uint32, so distinct elements of one tensor never collide).
3. The top 24 bits, ``r = h >> 8``, are the uniform integer in [0, 2^24).

Ternarization keeps element i when ``float(r) < (|g_i| / s) * 2^24`` (all fp32, exact scaling by a
power of two), so P(keep) = ceil(p·2^24)/2^24 with p = |g_i|/s: unbiased up to 2^-24 relative.
Cost: 2 multiplies and 6 shifts/xors per element, all in 32-bit integer arithmetic, which is what
both a CPU SIMD lane and a GPU thread do fastest.
"""
from __future__ import annotations

import zlib

import torch

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF
MIX_M1 = 0x7FEB352D
MIX_M2 = 0x846CA68B
UNIFORM_BITS = 24


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def tensor_id(name: str) -> int:
    """A 32-bit id for a tensor name that is the same in every process (unlike ``hash()``)."""
    return zlib.crc32(name.encode("utf-8")) & MASK32


def stream_key(seed: int, step: int, tensor: int, rank: int) -> tuple[int, int]:
    """Fold (seed, step, tensor, rank) into the two 32-bit key words (k0, k1)."""
    k = 0
    for word in (seed, step, tensor, rank):
        if word < 0:
            raise ValueError(f"random stream key words must be >= 0, got {word}")
        k = _splitmix64(k ^ (word & MASK64))
    return k & MASK32, k >> 32


def mix32(x: int) -> int:
    """Scalar reference of the per-element mixer (used by tests and documentation)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MIX_M1) & MASK32
    x ^= x >> 15
    x = (x * MIX_M2) & MASK32
    x ^= x >> 16
    return x


def uniform24_scalar(key: tuple[int, int], i: int) -> int:
    """The 24-bit uniform integer of element ``i`` (pure-Python reference)."""
    k0, k1 = key
    h = mix32(mix32((i & MASK32) ^ k0) ^ (i >> 32) ^ k1)
    return h >> 8


def _mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    # int64 holds uint32 values; products wrap mod 2^64, whose low 32 bits are the uint32 product.
    x = x ^ (x >> 16)
    x = (x * MIX_M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_M2) & MASK32
    return x ^ (x >> 16)


def uniform24(key: tuple[int, int], start: int, count: int, device="cpu") -> torch.Tensor:
    """24-bit uniform integers (int64 tensor) of elements ``start .. start+count-1``.

    Reference torch implementation: works on any device, several passes over int64 temporaries.
    The fused backends compute the same values inside their ternarize loop.
    """
    k0, k1 = key
    idx = torch.arange(start, start + count, dtype=torch.int64, device=device)
    lo = idx & MASK32
    hi = idx >> 32
    h = _mix32_tensor(lo ^ k0)
    h = _mix32_tensor(h ^ hi ^ k1)
    return h >> 8
