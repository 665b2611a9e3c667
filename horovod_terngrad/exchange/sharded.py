"""Sharded exchange: traffic per rank that stays nearly constant as the number of ranks N grows.

Each rank owns 1/N of every tensor (shard r = elements [r·S, (r+1)·S), S = ceil(n/N) rounded up to a
multiple of 20 so shards start on a byte boundary in both packings).  After the scaler handshake:

1. every rank ternarizes its whole gradient with the shared scaler (the same bytes as the allgather
   exchange) and sends shard r of its packed codes to rank r (one alltoall);
2. owner r adds the N ternary chunks it received: integers k in [-N, N], packed as k + N in
   L = ceil(log2(2N+1)) bits (the paper's "at most 2N+1 levels");
3. the packed sums come back to every rank by one allgather, and every rank decodes
   out = (float(k)·s) / N: exactly the allgather exchange's formula for a shared scaler, so the two
   exchanges give identical bits.

Per rank and element: sends (N-1)/N·b bits and receives (N-1)/N·(b + L) bits (b = 2 or 1.6), e.g.
9.8 bits received at N = 64 instead of 63·2 = 126 with the allgather exchange; it costs one more
collective (latency), so small N and small tensors are better served by the allgather exchange.
"""
from __future__ import annotations

import math

import torch

from ..codec.packing import CODES_PER_BYTE, unpack

SHARD_ALIGN = 20  # lcm of 4 (2bit) and 5 (base3): shard boundaries fall on byte boundaries


def sum_bits(n_ranks: int) -> int:
    """L = ceil(log2(2N + 1)): bits of one owner's sum k + N in [0, 2N]."""
    return max(1, math.ceil(math.log2(2 * n_ranks + 1)))


def shard_bounds(n: int, n_ranks: int) -> list[tuple[int, int]]:
    size = -(-n // n_ranks) if n else 0
    size = -(-size // SHARD_ALIGN) * SHARD_ALIGN
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(n_ranks)]


def code_byte_range(lo: int, hi: int, fmt: str) -> tuple[int, int]:
    """Bytes of the packed codes that hold elements [lo, hi) (lo is a shard start: byte aligned)."""
    per = CODES_PER_BYTE[fmt]
    if hi <= lo:
        return -(-lo // per), -(-lo // per)   # an empty shard (past the end): no bytes
    return lo // per, -(-hi // per)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers < 2^bits -> little-endian bitstream, ceil(len·bits/8) bytes."""
    n = values.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    v = values.to(torch.int64)
    shifts = torch.arange(bits, device=v.device)
    stream = ((v[:, None] >> shifts) & 1).reshape(-1)
    stream = torch.nn.functional.pad(stream, (0, (-stream.numel()) % 8)).view(-1, 8)
    return (stream << torch.arange(8, device=v.device)).sum(dim=1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``count`` integers (int64)."""
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    stream = ((data.to(torch.int64)[:, None] >> torch.arange(8, device=data.device)) & 1).reshape(-1)
    stream = stream[:count * bits].view(count, bits)
    return (stream << torch.arange(bits, device=data.device)).sum(dim=1)


def _fused(device):
    """The backend's sharded-exchange kernels when it has them (the fused CPU codec), else None: the
    torch reference below runs (on any device, and when HOROVOD_TERNGRAD_BACKEND=torch)."""
    from ..backends import for_device
    be = for_device(device)
    return be if hasattr(be, "owner_sums") else None


def owner_sums(received: torch.Tensor, n_ranks: int, lo: int, hi: int, fmt: str) -> torch.Tensor:
    """Add the N ternary chunks of shard [lo, hi) that an alltoall delivered (rank order, equal sizes):
    the integer sums k + N, packed in L bits."""
    m = hi - lo
    b0, b1 = code_byte_range(lo, hi, fmt)
    nbytes = b1 - b0
    if received.numel() != n_ranks * nbytes:
        raise ValueError(f"shard [{lo}, {hi}): received {received.numel()} bytes, expected {n_ranks}x{nbytes}")
    fused = _fused(received.device)
    if fused is not None:
        return fused.owner_sums(received.contiguous(), n_ranks, m, fmt, sum_bits(n_ranks))
    return owner_sums_reference(received, n_ranks, m, nbytes, fmt)


def owner_sums_reference(received: torch.Tensor, n_ranks: int, m: int, nbytes: int, fmt: str) -> torch.Tensor:
    k = torch.zeros(m, dtype=torch.int64, device=received.device)
    for r in range(n_ranks):
        k += unpack(received[r * nbytes:(r + 1) * nbytes], m, fmt).to(torch.int64)
    return pack_bits(k + n_ranks, sum_bits(n_ranks))


def decode_gathered(gathered: torch.Tensor, n: int, n_ranks: int, scalers: torch.Tensor, bucket_size: int,
                    divisor: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The average from the allgather of the owners' packed sums: (float(k)·s) / divisor."""
    out = torch.empty(n, dtype=torch.float32, device=gathered.device) if out is None else out
    fused = _fused(gathered.device)
    if fused is None:
        k = gathered_sums(gathered, n, n_ranks)
        s = scalers if scalers.numel() == 1 else scalers.repeat_interleave(bucket_size)[:n]
        return out.copy_((k.to(torch.float32) * s) / float(divisor))
    bits, off = sum_bits(n_ranks), 0
    bounds = shard_bounds(n, n_ranks)
    expected = sum(-(-(hi - lo) * bits // 8) for lo, hi in bounds)
    if expected != gathered.numel():      # checked first: the kernels read exactly this many bytes
        raise ValueError(f"gathered sums: {gathered.numel()} bytes, expected {expected}")
    for lo, hi in bounds:
        nbytes = -(-(hi - lo) * bits // 8)
        fused.decode_sums(gathered[off:off + nbytes], hi - lo, n_ranks, bits, scalers, bucket_size, lo, divisor,
                          out[lo:hi])
        off += nbytes
    return out


def gathered_sums(gathered: torch.Tensor, n: int, n_ranks: int) -> torch.Tensor:
    """All shards' sums k (int64, n elements) from the allgather of the owners' packed sums."""
    bits = sum_bits(n_ranks)
    parts, off = [], 0
    for lo, hi in shard_bounds(n, n_ranks):
        nbytes = -(-(hi - lo) * bits // 8)
        parts.append(unpack_bits(gathered[off:off + nbytes], hi - lo, bits))
        off += nbytes
    if off != gathered.numel():
        raise ValueError(f"gathered sums: {gathered.numel()} bytes, expected {off}")
    return torch.cat(parts) - n_ranks


def received_bits_per_element(n: int, n_ranks: int, fmt: str) -> float:
    """Most bits any rank receives per element of an n-element tensor in one exchange: its shard's
    codes from N-1 ranks (alltoall) plus the N-1 other owners' packed sums (allgather)."""
    bounds = shard_bounds(n, n_ranks)
    sum_bytes = [-(-(hi - lo) * sum_bits(n_ranks) // 8) for lo, hi in bounds]
    worst = 0
    for r, (lo, hi) in enumerate(bounds):
        b0, b1 = code_byte_range(lo, hi, fmt)
        worst = max(worst, (n_ranks - 1) * (b1 - b0) + sum(sum_bytes) - sum_bytes[r])
    return 8.0 * worst / n if n else 0.0
