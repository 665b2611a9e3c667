"""Deterministic ternary rounding to the nearest level: the owner-step exchange's weight differences.

For a flat fp32 ``d`` cut into buckets of k elements (the last one short), per bucket s = max|d| and
t_i = sign(d_i) where 2·|d_i| >= s, else 0 (a tie goes to ±1); q = s·t.  Then |d_i - q_i| <= s/2 for every
element, with no randomness: the owner-step exchange sends q = round(w - x) of the master w against the replica
x every rank computes on, and because each step's difference is taken against the master again, the replica's
error is one rounding of (one step + the previous error), never a sum of roundings: with e = d - q,
s' = max|step + e| <= max|step| + s/2, so s stays under 2·max|step| and |x - w| under max|step| (elementwise).
Stochastic rounding (codec/ternary.py) is unbiased but its error is not bounded that way, and the replica drifts.

The payload is the codec's ordinary one (packing.encode: header, one fp32 scaler per bucket, packed codes), so
every backend's decode reads it: s·t in fp32, exact.
"""
from __future__ import annotations

import torch

from .packing import encode
from .sizes import header_bucket, num_buckets


def nearest_ternary(d: torch.Tensor, bucket_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(t int8 [n] in {-1, 0, 1}, scalers fp32 [num_buckets]) of the flat fp32 ``d``, rounded to the nearest
    level per bucket (module docstring); ``bucket_size`` 0: one scaler for the whole of ``d``."""
    n = d.numel()
    nb = num_buckets(n, bucket_size)
    if n == 0:
        return torch.zeros(0, dtype=torch.int8, device=d.device), torch.zeros(1, dtype=torch.float32, device=d.device)
    k = n if nb == 1 else int(bucket_size)
    x = torch.nn.functional.pad(d.to(torch.float32), (0, nb * k - n)).view(nb, k)
    s = x.abs().amax(dim=1)
    t = torch.where(x.abs() * 2 >= s.unsqueeze(1), torch.sign(x), torch.zeros_like(x))
    t = torch.where(s.unsqueeze(1) > 0, t, torch.zeros_like(t))
    return t.reshape(-1)[:n].to(torch.int8), s


def encode_nearest(d: torch.Tensor, fmt: str, bucket_size: int = 0, flags: int = 0) -> torch.Tensor:
    """The payload of ``nearest_ternary(d, bucket_size)`` in packing ``fmt`` (a flat header of n elements)."""
    t, scalers = nearest_ternary(d, bucket_size)
    return encode(t, fmt, scalers, header_bucket(d.numel(), bucket_size), flags, (d.numel(),))


__all__ = ["nearest_ternary", "encode_nearest"]
