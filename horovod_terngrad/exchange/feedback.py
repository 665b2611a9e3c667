"""Error feedback at the sender (``TernGradConfig(error_feedback=True)``): each rank rounds its gradient plus
what its previous rounding of the tensor left out to the nearest ternary level, and keeps the new remainder.

Per rank r and tensor, with s the tensor's (or bucket's) TernGrad scaler min(max|x|, c·sigma) of x:

    x_t = g_t + e_t,    sent: q_t = s·t,  t_i = sign(x_i) where 2·|clip(x_i)| >= s else 0,    e_{t+1} = clip(x_t) - q_t

so, clipping aside, the sum of what a rank sends over T steps is sum_t g_t + e_0 - e_T: the rounding errors
telescope, and the error in the accumulated update stays at one rounding's size (|e| <= s/2) instead of growing
as sqrt(T) with independent stochastic roundings.

Why nearest, not the codec's stochastic rounding: feedback needs a rounding whose error is smaller than what it
rounds (E|x - Q(x)|^2 <= (1 - delta)·|x|^2).  The stochastic ternary's error is sum_i (s·|x_i| - x_i^2), about
|x|^2 itself at s = 2.5·sigma: fed back, the residual's variance feeds x's, which feeds the next residual's, and
|x| grows as sqrt(t).  Rounding to the nearest level with the same s leaves about 0.4·|x|^2 on a Gaussian.
What clipping cuts is not carried either: a coordinate that stays above c·sigma would grow its residual every
step until it inflated sigma and with it every other element's scaler.

Each step's payload is not unbiased for that step's gradient (it carries e_t - e_{t+1}), as with 1-bit Adam's
``worker_error`` and EF-SGD; the payload is the codec's ordinary one (every backend decodes it) and the bits on
the wire do not change.  Cost per tensor and step: a clip, a compare and a pack in torch ops on the gradient's
device (the backends' fused stochastic encoders are not used), and an fp32 residual the size of the tensor on
each rank, which belongs to whoever passed the ``residuals`` dict to the engine (its state).  A NaN/Inf gradient
zeroes the tensor's residual: a flagged step carries nothing over.
"""
from __future__ import annotations

import torch

from ..codec import packing
from ..codec.ternary import expand_scalers


def with_residual(residuals: dict, name: str, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` plus the residual the last rounding of ``name`` left (fp32, a new tensor), or ``flat`` itself
    when there is none yet (or the tensor changed size, as after a model change: the residual is dropped)."""
    kept = residuals.get(name)
    if kept is None:
        return flat
    if kept.numel() != flat.numel() or kept.device != flat.device:
        del residuals[name]
        return flat
    return flat.to(torch.float32) + kept


def encode(residuals: dict, name: str, x: torch.Tensor, threshold: torch.Tensor, scalers: torch.Tensor,
           bucket_size: int, fmt: str, flags: int = 0, shape=None,
           nonfinite: torch.Tensor | bool = False) -> torch.Tensor:
    """The payload of ``x`` rounded to the nearest level (module docstring), with the header, scalers and
    packing the backends' ``encode`` writes; stores the remainder ``clip(x) - s·t`` in ``residuals[name]``."""
    n = x.numel()
    clipped = torch.clamp(x.to(torch.float32), -threshold, threshold)
    s = expand_scalers(scalers.to(torch.float32), bucket_size, n)
    t = torch.where((2 * clipped.abs() >= s) & (s > 0), torch.sign(clipped), torch.zeros_like(clipped))
    residual = clipped - t * s
    if isinstance(nonfinite, torch.Tensor):
        residual.masked_fill_(nonfinite.reshape(()), 0.0)     # on the device: no host synchronization
    elif nonfinite:
        residual.zero_()
    residuals[name] = residual
    payload, region = packing.new_payload(n, fmt, scalers, bucket_size, flags, shape)
    region.copy_(packing.pack(t.to(torch.int8), fmt))
    return payload


def drop_residual(residuals: dict, name: str) -> None:
    """Forget ``name``'s residual (its gradient was not ternarized this step: NaN/Inf)."""
    residuals.pop(name, None)
