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

import time

import torch

from .. import backends
from ..codec import sizes
from ..codec.packing import decode_sums, unpack
from ..codec.sizes import SHARD_ALIGN, code_byte_range, shard_bounds, sum_bits, sums_size  # noqa: F401
from ..errors import RankMismatchError
from .collectives import CollectiveError
from . import allgather


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
    """The backend's sharded-exchange kernels when it declares them (the fused CPU codec), else None:
    the torch reference below runs (on any device, and when HOROVOD_TERNGRAD_BACKEND=torch)."""
    be = backends.for_device(device)
    return be if backends.has_capability(be, backends.SHARDED_SUMS) else None


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
        return out.copy_(decode_sums(gathered_sums(gathered, n, n_ranks), scalers, bucket_size, divisor))
    bits, off = sum_bits(n_ranks), 0
    per_owner = sizes.shard_sum_bytes(n, n_ranks)
    if sum(per_owner) != gathered.numel():      # checked first: the kernels read exactly this many bytes
        raise ValueError(f"gathered sums: {gathered.numel()} bytes, expected {sum(per_owner)}")
    for (lo, hi), nbytes in zip(shard_bounds(n, n_ranks), per_owner):
        fused.decode_sums(gathered[off:off + nbytes], hi - lo, n_ranks, bits, scalers, bucket_size, lo, divisor,
                          out[lo:hi])
        off += nbytes
    return out


def gathered_sums(gathered: torch.Tensor, n: int, n_ranks: int) -> torch.Tensor:
    """All shards' sums k (int64, n elements) from the allgather of the owners' packed sums."""
    bits = sum_bits(n_ranks)
    parts, off = [], 0
    for lo, hi in shard_bounds(n, n_ranks):
        nbytes = sums_size(hi - lo, n_ranks)
        parts.append(unpack_bits(gathered[off:off + nbytes], hi - lo, bits))
        off += nbytes
    if off != gathered.numel():
        raise ValueError(f"gathered sums: {gathered.numel()} bytes, expected {off}")
    return torch.cat(parts) - n_ranks


def received_bits_per_element(n: int, n_ranks: int, fmt: str) -> float:
    """Most bits any rank receives per element of an n-element tensor in one exchange: its shard's
    codes from N-1 ranks (alltoall) plus the N-1 other owners' packed sums (allgather)."""
    codes, sums = sizes.shard_code_bytes(n, n_ranks, fmt), sizes.shard_sum_bytes(n, n_ranks)
    worst = 0
    for r in range(n_ranks):
        worst = max(worst, (n_ranks - 1) * codes[r] + sum(sums) - sums[r])
    return 8.0 * worst / n if n else 0.0


# -- the transport: how a group's payloads travel in the sharded exchange ----------------------------
def send(ex, grp, sends: list) -> None:
    """Alltoall: to rank r, shard r of every member's packed codes (members in order)."""
    N, fmt = ex.coll.size, ex.config.packing
    to_rank = [[] for _ in range(N)]
    for tk, payload in sends:
        codes = payload[sizes.codes_offset(tk.nb):]
        for r, (lo, hi) in enumerate(shard_bounds(tk.numel, N)):
            b0, b1 = code_byte_range(lo, hi, fmt)
            to_rank[r].append(codes[b0:b1])
    splits = [sum(c.numel() for c in chunks) for chunks in to_rank]
    data = (sends[0][1][sizes.codes_offset(sends[0][0].nb):] if len(sends) == 1
            else torch.cat([c for chunks in to_rank for c in chunks]))
    launch_alltoall(ex, grp, [tk for tk, _ in sends], data, splits, f"terngrad.a2a.{grp.name}")


def launch_alltoall(ex, grp, members: list, data: torch.Tensor, splits: list, name: str) -> None:
    """Start the group's alltoall of ``data`` (``splits[r]`` bytes to rank r) and queue the group for its owner
    step.  Shard sizes depend on the receiver only, so every sender sends this rank as much (handed to
    collectives that take the received sizes).  The sharded and re-ternarized transports share it."""
    N = ex.coll.size
    grp.sent = members
    grp.a2a_own = splits[ex.coll.rank]
    ex.stats.payload_bytes_sent += data.numel()
    if getattr(ex.coll, "takes_sizes", False):
        grp.a2a = ex.coll.alltoall_async(data, splits, name, received=[grp.a2a_own] * N)
    else:
        grp.a2a = ex.coll.alltoall_async(data, splits, name)
    ex.stats.collectives += 1
    ex.queue_alltoall(grp)


def alltoall_result(ex, grp, what: str) -> torch.Tensor | None:
    """Wait for the group's alltoall; its bytes (this rank's own not counted as received), or None after
    setting every member's error to the collective's own error class (``what`` names the exchange)."""
    t0 = time.perf_counter()
    try:
        received = ex.coll.synchronize(grp.a2a)
    except CollectiveError as e:
        for tk in grp.sent:
            tk.error = e.detailed(f"TernGrad: {what} of '{tk.name}' failed")
        return None
    finally:
        ex.stats.gather_wait_s += time.perf_counter() - t0
    ex.stats.bytes_received += received.numel() - grp.a2a_own
    return received


def after_alltoall(ex, grp) -> None:
    """Owner step: per member, add the N chunks of this rank's shard; allgather all members' sums."""
    received = alltoall_result(ex, grp, "sharded exchange")
    if received is None:
        return
    t0 = time.perf_counter()
    N, me, fmt = ex.coll.size, ex.coll.rank, ex.config.packing
    members = grp.sent
    bounds = [shard_bounds(tk.numel, N)[me] for tk in members]
    nbytes = [sizes.shard_code_bytes(tk.numel, N, fmt)[me] for tk in members]
    block = sum(nbytes)
    if received.numel() != N * block:
        err = RankMismatchError(f"TernGrad: sharded exchange of group '{grp.name}': received "
                                f"{received.numel()} bytes, expected {N}x{block}")
        for tk in members:
            tk.error = err
        return
    sums, pre = [], 0
    for tk, (lo, hi), size in zip(members, bounds, nbytes):
        mine = received if len(members) == 1 else \
            torch.cat([received[s * block + pre:s * block + pre + size] for s in range(N)])
        sums.append(owner_sums(mine, N, lo, hi, fmt))
        tk.payload_bytes = sums[-1].numel()
        pre += size
    ex.stats.codec_s += time.perf_counter() - t0
    owners = ([sum(sizes.shard_sum_bytes(tk.numel, N)[r] for tk in members) for r in range(N)]
              if getattr(ex.coll, "takes_sizes", False) else None)     # the owners' sums: the last may be short
    allgather.launch(ex, grp, members, sums[0] if len(sums) == 1 else torch.cat(sums), f"terngrad.sg.{grp.name}",
                     sizes=owners)


def _member_sums(ex, grp, tk, gathered: torch.Tensor) -> torch.Tensor:
    """One member's packed sums, every owner's in rank order, out of a sharded group's allgather
    (rank r's block holds the sums of shard r of every member, in member order)."""
    N = ex.coll.size
    nbytes = [sizes.shard_sum_bytes(m.numel, N) for m in grp.sent]
    parts, off = [], 0
    for r in range(N):
        for j, m in enumerate(grp.sent):
            if m is tk:
                parts.append(gathered[off:off + nbytes[j][r]])
            off += nbytes[j][r]
    if off != gathered.numel():
        raise RankMismatchError(f"TernGrad: sharded exchange of group '{grp.name}': gathered "
                                f"{gathered.numel()} bytes of sums, expected {off}")
    return torch.cat(parts)


def receive(ex, tk) -> torch.Tensor:
    """The average of one member: (float(k)·s)/N, the allgather exchange's decode for a shared scaler,
    so the same bits."""
    grp = tk.group
    gathered = allgather.gathered(ex, tk)
    t0 = time.perf_counter()
    mine = gathered if len(grp.sent) == 1 else _member_sums(ex, grp, tk, gathered)
    out = decode_gathered(mine, tk.numel, ex.coll.size, tk.shared, ex.config.bucket_size,
                          ex.coll.size if tk.average else 1, out=tk.g32 if tk.in_place else None)
    ex.stats.codec_s += time.perf_counter() - t0
    return out
