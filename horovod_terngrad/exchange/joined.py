"""The join transport: how a group travels while some ranks have called ``hvd.join()``.

Horovod lets a rank that ran out of data call ``hvd.join()``; until every rank has joined, the joined ones
take part in every allreduce with zeros, and allgather and alltoall fail ("not supported with Join").  The
average Horovod computes then counts joined ranks as zero gradients: sum over the active ranks / N.

TernGrad notices joined ranks in the group's handshake (a joined rank's zeros show where every active rank
puts a negative number, see handshake.py), on every active rank alike, and sends the ternary values of
that group by one allreduce-sum of int32 words instead of the usual transport:

* each element's t + 1 in [0, 2] is a field of L = ceil(log2(2N+1)) bits, floor(31/L) fields per word (so
  the sum over at most N ranks never carries into the next field nor into the sign bit);
* one more word holds 1, so its sum is A, the number of active ranks;
* every rank reads k = field - A = Σ_active t_r and decodes (float(k)·s)/N with the shared scaler: the
  allgather exchange's formula, with the joined ranks' t_r = 0.

Cost: 32/floor(31/L) bits per element (3.2 at N = 2) instead of 2, only in the steps where a rank has joined.
It rides on the shared-scaler handshake: with per-rank scalers, the step's presence check (engine.py)
tells every active rank that a rank has joined, and the step's groups then take the handshake.
"""
from __future__ import annotations

import torch

from ..codec import packing, sizes
from . import allgather


def _fields(t: torch.Tensor, n_ranks: int) -> torch.Tensor:
    """Ternary values (fp32 in {-1, 0, 1}) -> int32 words of t + 1 in L-bit fields."""
    bits, per = sizes.sum_bits(n_ranks), sizes.joined_fields_per_word(n_ranks)
    words = sizes.joined_words(t.numel(), n_ranks)
    v = torch.zeros(words * per, dtype=torch.int64, device=t.device)
    v[:t.numel()] = t.to(torch.int64) + 1
    shifts = torch.arange(per, device=t.device, dtype=torch.int64) * bits
    return (v.view(words, per) << shifts).sum(dim=1).to(torch.int32)


def _unfields(words: torch.Tensor, numel: int, n_ranks: int) -> torch.Tensor:
    """Inverse of ``_fields`` for summed words: every element's field (int64)."""
    bits, per = sizes.sum_bits(n_ranks), sizes.joined_fields_per_word(n_ranks)
    shifts = torch.arange(per, device=words.device, dtype=torch.int64) * bits
    return ((words.to(torch.int64)[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:numel]


def send(ex, grp, sends: list) -> None:
    """Allreduce-sum the ternary values of the payloads ``[(ticket, payload), ...]`` of a group."""
    N = ex.coll.size
    parts = []
    for j, (tk, payload) in enumerate(sends):
        header = packing.parse_header(payload, f"payload of '{tk.name}'")
        _, codes = packing.split(payload, header)
        parts.append(_fields(packing.unpack(codes, header.numel, header.fmt), N))
        tk.slot, tk.payload_bytes = j, payload.numel()
    parts.append(torch.ones(1, dtype=torch.int32, device=parts[0].device))
    data = torch.cat(parts)
    grp.sent = [tk for tk, _ in sends]
    grp.bytes_sent = data.numel() * data.element_size()
    ex.stats.payload_bytes_sent += grp.bytes_sent
    grp.ag = ex.coll.allreduce_sum_async(data, f"terngrad.join.{grp.name}")
    ex.stats.collectives += 1


def receive(ex, tk) -> torch.Tensor:
    """The average (or sum) of one member: joined ranks count as zero gradients, as in Horovod."""
    grp, N = tk.group, ex.coll.size
    sums = allgather.collected(ex, tk, 0, " while ranks have joined")
    active = int(sums[-1])
    offset = sum(sizes.joined_words(m.numel, N) for m in grp.sent[:tk.slot])
    n = tk.numel
    k = _unfields(sums[offset:offset + sizes.joined_words(n, N)], n, N) - active
    return packing.decode_sums(k, tk.shared, tk.bucket, N if tk.average else 1)
