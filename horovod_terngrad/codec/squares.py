"""The sender's squares: what the noise estimate needs to leave the minibatch's own variance in Adam's v.

horovod_terngrad.optim takes the ternary rounding's noise out of Adam's second moment with the estimate

    ν_i = (1/d²)·Σ_r s_r²·|t_r,i|          (d = N when averaging; exchange/allgather.noise_estimate)

which is unbiased for (1/d²)·Σ_r s_r·|f(g_r,i)| (f: the clip at c·σ).  The rounding's variance is
(1/d²)·Σ_r (s_r·|f(g_r,i)| - f(g_r,i)²), so ν over-estimates it by O_i = (1/d²)·Σ_r f(g_r,i)².  That term is
1/N of the ranks' mean squared gradient, and it holds the minibatch's own variance: with O left in the
estimate, v - n loses the share σ²/N of fp32 AdamW's v that is minibatch noise, and the steps grow longer than
fp32 AdamW's (1.8x at the end of a whole run, docs/scale.md).  One ternary draw per rank cannot tell O_i apart
per element (E[s·|t|] is linear in |g|); its total over a payload it can:

* every sender computes Q_r = Σ_i f(g_r,i)² over its payload's elements (fp32, in a defined summation order,
  ``ordered_row_sums``, so every device and rank gets the same bits), and carries it in a 4-byte trailer after
  the codes (header flag bit 1, packing.FLAG_SQUARES);
* whoever forms ν (every rank in the allgather exchange, the shard's owner in the requantized one) scales it:

      ν'_i = ν_i · max(0, 1 - Q / Σ_i ν_i),    Q = (1/d²)·Σ_r Q_r

  so Σ_i ν'_i estimates the rounding's whole variance, (1/d²)·Σ_r Σ_i (s_r·|f(g_r,i)| - f(g_r,i)²), with
  the over-estimate taken out in proportion to each element's ν.

Cost: 4 bytes per payload (per shard in the two-stage exchanges), one pass over f(g)² at the sender, one sum of
ν at the receiver; only where the optimizer asked for the estimate.
"""
from __future__ import annotations

import torch

from .packing import FLAG_SQUARES, device_constant
from .sizes import SQUARES_BYTES


def ordered_row_sums(x: torch.Tensor) -> torch.Tensor:
    """Per row of a 2-D float tensor, its sum in a defined order, in the tensor's own dtype: level by level, the row
    (zero-padded to a multiple of 8) is cut into 8 equal contiguous parts p0..p7, which become the elementwise
    ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)), until one value is left.  The same bits on every device and thread count
    (each addition is one IEEE operation in a fixed place); contiguous reads, 8 tensor operations per factor of 8
    in the row's length.  [rows]."""
    rows = x.shape[0]
    y = x
    while y.shape[1] > 1:
        if y.shape[1] % 8:
            y = torch.nn.functional.pad(y, (0, (-y.shape[1]) % 8))
        p = y.view(rows, 8, -1)
        left, right = p[:, 0] + p[:, 1], p[:, 4] + p[:, 5]
        left += p[:, 2] + p[:, 3]                  # (p0+p1)+(p2+p3), in place: one allocation fewer
        right += p[:, 6] + p[:, 7]
        y = left.add_(right)
    return y.reshape(rows)


def clipped_square_sums(g: torch.Tensor, threshold: torch.Tensor, bounds: list) -> torch.Tensor:
    """fp32 [len(bounds)]: Σ f(g_i)² over each [lo, hi) of the flat gradient ``g`` (fp32 or bf16), f the clip at
    ``threshold`` (0-d fp32, +inf: none), squares and sums in fp32 in ``ordered_row_sums``' order; an empty range
    sums to 0.  Equal-length contiguous ranges (a tensor's full shards) are summed as rows of one view
    (``equal_runs``)."""
    if threshold.device.type == "cpu":        # a host value there: the scalar clamp is several times faster
        t = float(threshold)
        x = torch.clamp(g.to(torch.float32), -t, t)
    else:                                     # on an accelerator the threshold stays there (no synchronization)
        x = torch.clamp(g.to(torch.float32), min=-threshold, max=threshold)
    x.mul_(x)
    out = torch.zeros(len(bounds), dtype=torch.float32, device=g.device)
    for i, j, lo, length in equal_runs(bounds):
        out[i:j] = ordered_row_sums(x[lo:lo + (j - i) * length].view(j - i, length))
    return out


def equal_runs(bounds: list) -> list:
    """The non-empty runs of contiguous ranges of one length in ``bounds`` ([lo, hi) pairs), as (first index, end
    index, lo of the first, length): the rows that ``clipped_square_sums`` sums together."""
    runs, i = [], 0
    while i < len(bounds):
        lo, hi = bounds[i]
        j = i + 1
        while j < len(bounds) and bounds[j] == (bounds[j - 1][1], bounds[j - 1][1] + hi - lo):
            j += 1
        if hi > lo:
            runs.append((i, j, lo, hi - lo))
        i = j
    return runs


def attach(payload: torch.Tensor, square_sum: torch.Tensor) -> torch.Tensor:
    """``payload`` with the squares trailer (``square_sum``, a one-element fp32 tensor) and its header flag set;
    on the payload's device, no host synchronization."""
    out = torch.cat([payload, square_sum.to(torch.float32).reshape(1).view(torch.uint8)])
    out[3:4] |= FLAG_SQUARES
    return out


def read(buf: torch.Tensor, ends: list) -> torch.Tensor:
    """fp32 [len(ends)]: the squares trailers of the payloads in ``buf`` that end at byte offsets ``ends``."""
    at = device_constant([e - SQUARES_BYTES + k for e in ends for k in range(SQUARES_BYTES)], torch.int64, buf.device)
    return buf[at].view(torch.float32)


def take_out_minibatch_share(noise: torch.Tensor, square_sums: torch.Tensor, divisor: float) -> torch.Tensor:
    """Scale the estimate ``noise`` (fp32, in place) by max(0, 1 - Q / Σ noise), Q = Σ square_sums / divisor²
    (module docstring): the sums in fp32 in the defined order, the factor in fp64; a zero or non-finite estimate is
    left as it is."""
    if noise.numel() == 0:
        return noise
    total = ordered_row_sums(noise.view(1, -1))[0].to(torch.float64)
    q = ordered_row_sums(square_sums.view(1, -1))[0].to(torch.float64) / (float(divisor) ** 2)
    factor = torch.clamp(1.0 - q / total, min=0.0, max=1.0)
    factor = torch.where(torch.isfinite(factor) & (total > 0), factor, torch.ones_like(factor))
    return noise.mul_(factor.to(torch.float32))


__all__ = ["ordered_row_sums", "clipped_square_sums", "equal_runs", "attach", "read", "take_out_minibatch_share"]
