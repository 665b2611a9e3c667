"""The shared-scaler handshake: one allreduce-max of a small fp64 vector per group, built and read here.

Max of x and of -x gives both the max and the min over ranks, so one reduction tells every rank whether
all ranks agree on the group, which ranks saw NaN/Inf, and the shared scaler s = max_r s_r (Eq. 4).

A lone tensor (``codec.sizes.SINGLE_HANDSHAKE_FIXED`` = 8 fixed slots, then its B scalers):

    [bad, -bad', n, -n, shape, -shape, dtype, -dtype, s_1 .. s_B]

A fused group of M members (4 fixed slots, 2 per member, then every member's scalers in member order):

    [c, -c, M, -M, bad_1, -bad_1', .., bad_M, -bad_M', scalers of member 1, .., scalers of member M]

with bad = rank + 1 on a rank whose tensor holds NaN/Inf, else 0; bad' = bad there, else N + 1 (so the
max of -bad' is minus the lowest bad rank + 1); c = CRC-32 of the members' (numel, shape code, dtype
code) list.  Sizes: ``codec.sizes.handshake_slots``.

Joined ranks (``hvd.join()``) take part in the allreduce with zeros.  Every active rank puts a negative
number in the -dtype slot of a lone tensor and in the -M slot of a fused group, so a 0 there after the max
means some rank has joined: the verdict says so (``joined``), and the minimum side of every pair, which the
zeros hide, is not checked.  The engine then moves the group by the join transport (joined.py).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from ..codec import packing, sizes

DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


@dataclass(frozen=True)
class MemberVerdict:
    """One member's part of the reduced handshake (meaningful when the group agrees)."""

    first_bad: int        # lowest rank whose tensor held NaN/Inf, -1 if none
    last_bad: int         # highest such rank, -1 if none
    scalers: list         # the shared scalers (max over ranks)


@dataclass(frozen=True)
class Verdict:
    """The reduced handshake of a group: ``mismatch`` says how the ranks disagree (None: they agree)."""

    mismatch: str | None
    members: tuple
    joined: bool = False  # some rank has called hvd.join(): it contributes zeros


def build(preps: list, tensors: list, rank: int, size: int) -> torch.Tensor:
    """This rank's handshake vector for a group (``preps``: each member's ``codec.Prepared``; ``tensors``:
    the members, anything with their ``shape`` and ``dtype`` as handed in).  Host tensors are built in one go; device
    tensors without a host synchronization."""
    fused = len(preps) > 1
    if fused:
        layout = [(p.numel, packing.shape_code(t.shape), DTYPE_CODES[t.dtype]) for p, t in zip(preps, tensors)]
        c, m = float(zlib.crc32(repr(layout).encode())), float(len(preps))
        fixed = [c, -c, m, -m]
    else:
        p, t = preps[0], tensors[0]
        n, sc, dc = float(p.numel), float(packing.shape_code(t.shape)), float(DTYPE_CODES[t.dtype])
    on_host = preps[0].scalers.device.type == "cpu"
    if on_host:
        flags = []
        for p in preps:
            bad = float(rank + 1) if bool(p.nonfinite) else 0.0
            flags += [bad, -bad if bad else -float(size + 1)]
        head = fixed + flags if fused else flags + [n, -n, sc, -sc, dc, -dc]
        if sum(p.scalers.numel() for p in preps) <= 256:       # few scalers: one tensor from one list
            return torch.tensor(head + [v for p in preps for v in p.scalers.tolist()], dtype=torch.float64)
        return torch.cat([torch.tensor(head, dtype=torch.float64)] + [p.scalers.to(torch.float64) for p in preps])
    dev = preps[0].scalers.device
    bad = torch.stack([p.nonfinite.reshape(()) for p in preps]).to(torch.float64) * (rank + 1)
    flags = torch.stack([bad, torch.where(bad > 0, -bad, torch.full_like(bad, -float(size + 1)))], 1).reshape(-1)
    if fused:
        head = [torch.tensor(fixed, dtype=torch.float64, device=dev), flags]
    else:
        head = [flags, torch.tensor([n, -n, sc, -sc, dc, -dc], dtype=torch.float64, device=dev)]
    return torch.cat(head + [p.scalers.to(torch.float64) for p in preps])


def read(values: list, scalers_per_member: list) -> Verdict:
    """The verdict of a reduced handshake (``values``: the allreduce-max result as a list)."""
    expected = sizes.handshake_slots(scalers_per_member)
    if len(values) != expected:
        return Verdict(f"the handshake has {len(values)} slots, this rank expects {expected}", ())
    single = len(scalers_per_member) == 1
    joined = values[7] == 0 if single else values[3] == 0
    if joined:          # the minimum side of each pair is hidden by the zeros: nothing to compare
        pass
    elif single:
        if values[2] != -values[3]:
            return Verdict("element counts range over [%d, %d]" % (-values[3], values[2]), ())
        if values[4] != -values[5]:
            return Verdict("shapes differ", ())
        if values[6] != -values[7]:
            return Verdict("dtypes differ", ())
    elif values[0] != -values[1]:
        return Verdict("sizes, shapes or dtypes differ", ())
    if single:
        flag_slots, pos = [0], sizes.SINGLE_HANDSHAKE_FIXED
    else:
        k = sizes.FUSED_HANDSHAKE_FIXED
        flag_slots = [k + 2 * j for j in range(len(scalers_per_member))]
        pos = k + sizes.FUSED_HANDSHAKE_PER_MEMBER * len(scalers_per_member)
    # (hi, lo): max bad rank + 1, minus the lowest; with joined ranks the lowest is hidden: report the highest
    flags = [(values[i], -values[i] if joined else values[i + 1]) for i in flag_slots]
    members = []
    for (hi, lo), nb in zip(flags, scalers_per_member):
        bad_hi, bad_lo = int(hi), int(-lo)
        first, last = (bad_lo - 1, bad_hi - 1) if bad_hi > 0 else (-1, -1)
        members.append(MemberVerdict(first, last, values[pos:pos + nb]))
        pos += nb
    return Verdict(None, tuple(members), joined)
