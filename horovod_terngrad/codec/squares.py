"""The sender's squares: what the noise estimate needs to leave the minibatch's own variance in Adam's v.

horovod_terngrad.optim takes the ternary rounding's noise out of Adam's second moment with the estimate

    ν_i = (1/d²)·Σ_r s_r²·|t_r,i|          (d = N when averaging; exchange/allgather.noise_estimate)

which is unbiased for (1/d²)·Σ_r s_r·|f(g_r,i)| (f: the clip at c·σ).  The rounding's variance is
(1/d²)·Σ_r (s_r·|f(g_r,i)| - f(g_r,i)²), so ν over-estimates it by O_i = (1/d²)·Σ_r f(g_r,i)².  That term is
1/N of the ranks' mean squared gradient, and it holds the minibatch's own variance: with O left in the
estimate, v - n loses the share σ²/N of fp32 AdamW's v that is minibatch noise, and the steps grow longer than
fp32 AdamW's (1.8x at the end of a whole run, docs/scale.md).  One ternary draw per rank cannot tell O_i apart
per element (E[s·|t|] is linear in |g|); its total over a payload it can:

* every sender computes Q_r = Σ_i f(g_r,i)² over its payload's elements, exactly (fp64, in the codec's defined
  summation order, ternary.block_sums / combine_blocks, so every device and rank gets the same bits), and
  carries it as fp32 in a 4-byte trailer after the codes (header flag bit 1, packing.FLAG_SQUARES);
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
from .ternary import STATS_BLOCK, STATS_LANES, _sum8


def ordered_row_sums(x64: torch.Tensor) -> torch.Tensor:
    """Per row of a 2-D fp64 tensor, its sum in the codec's defined order (ternary.block_sums then
    combine_blocks: 32 lanes per 2048-element block, summed sequentially, then an 8-way tree): [rows]."""
    rows, m = x64.shape
    nblk = max(1, -(-m // STATS_BLOCK))
    x = torch.nn.functional.pad(x64, (0, nblk * STATS_BLOCK - m))
    lanes = x.view(rows, nblk, STATS_BLOCK // STATS_LANES, STATS_LANES).cumsum(dim=2)[:, :, -1, :]
    x = lanes.reshape(rows, -1)
    while x.shape[1] > 1:
        x = torch.nn.functional.pad(x, (0, (-x.shape[1]) % 8))
        x = _sum8(x.view(-1, 8)).view(rows, -1)
    return x.reshape(rows)


def clipped_square_sums(g: torch.Tensor, threshold: torch.Tensor, bounds: list) -> torch.Tensor:
    """fp32 [len(bounds)]: Σ f(g_i)² over each [lo, hi) of the flat gradient ``g`` (fp32 or bf16), f the clip at
    ``threshold`` (0-d fp32, +inf: none); an empty range sums to 0.  Equal-length ranges (a tensor's full shards)
    are summed as rows of one view."""
    x = torch.clamp(g.to(torch.float32), min=-threshold, max=threshold).to(torch.float64)
    x = x * x                                                    # exact: an fp32 square fits fp64
    out = torch.zeros(len(bounds), dtype=torch.float64, device=g.device)
    i = 0
    while i < len(bounds):
        lo, hi = bounds[i]
        j = i + 1
        while j < len(bounds) and bounds[j] == (bounds[j - 1][1], bounds[j - 1][1] + hi - lo):
            j += 1                                               # a run of contiguous ranges of one length
        if hi > lo:
            out[i:j] = ordered_row_sums(x[lo:lo + (j - i) * (hi - lo)].view(j - i, hi - lo))
        i = j
    return out.to(torch.float32)


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
    (module docstring), all in fp64 in the defined order; a zero or non-finite estimate is left as it is."""
    if noise.numel() == 0:
        return noise
    total = ordered_row_sums(noise.to(torch.float64).view(1, -1))[0]
    q = ordered_row_sums(square_sums.to(torch.float64).view(1, -1))[0] / (float(divisor) ** 2)
    factor = torch.clamp(1.0 - q / total, min=0.0, max=1.0)
    factor = torch.where(torch.isfinite(factor) & (total > 0), factor, torch.ones_like(factor))
    return noise.mul_(factor.to(torch.float32))


__all__ = ["ordered_row_sums", "clipped_square_sums", "attach", "read", "take_out_minibatch_share"]
