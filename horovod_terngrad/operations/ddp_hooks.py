"""The DDP communication hooks the examples and benchmarks compare, installed by name.

    state = install(ddp_model, "terngrad" | "fp16" | "powersgd" | "none", powersgd_rank=1, ...)

* ``terngrad``: ``horovod_terngrad.ddp.register`` (keyword settings go to TernGradConfig);
* ``fp16``: PyTorch's ``default_hooks.fp16_compress_hook``;
* ``powersgd``: PyTorch's ``powerSGD_hook`` with error feedback and warm start (as PyTorch recommends), plain
  allreduce before ``start_powerSGD_iter``;
* ``none``: no hook (DDP's fp32 allreduce).

PowerSGD on gloo.  ``powerSGD_hook`` issues a bucket's second and third allreduce (P, then Q) from callbacks
of the first one's future.  With NCCL those callbacks run as soon as the collective is enqueued, so every rank
issues the collectives of bucket i before those of bucket i+1; with gloo they run on gloo's threads when the
data has arrived, racing with the next bucket's first allreduce issued by backward, and ranks can issue them
in different orders: gloo then fails ("Received data size doesn't match expected size", abort) or hangs.
(Seen with LeNet, 2 buckets, 2 ranks.)  On gloo this module therefore waits, at the start of each bucket's
hook, until the previous bucket's PowerSGD future is complete (so its collectives are all issued), which
keeps the order identical on every rank; backward computation still overlaps the last bucket's exchange.
"""
from __future__ import annotations

import torch.distributed as dist

HOOKS = ("terngrad", "fp16", "powersgd", "none")


class _SerializedPowerSGD:
    """PowerSGDState plus the previous bucket's future (see the module docstring)."""

    def __init__(self, state):
        self.state = state
        self.previous = None


def _serialized_powersgd_hook(wrapper: _SerializedPowerSGD, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    if wrapper.previous is not None:
        wrapper.previous.wait()
    fut = psgd.powerSGD_hook(wrapper.state, bucket)
    wrapper.previous = None if bucket.is_last() else fut
    return fut


def install(model, hook: str, powersgd_rank: int = 1, powersgd_start: int = 2, seed: int = 0,
            serialize_powersgd: bool | None = None, **terngrad_settings):
    """Install ``hook`` on the DDP ``model``; returns its state (TernGradState, PowerSGDState or None)."""
    if hook == "terngrad":
        from ..frontends import ddp as tg_ddp
        return tg_ddp.register(model, seed=seed, **terngrad_settings)
    if hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                   start_powerSGD_iter=powersgd_start, use_error_feedback=True, warm_start=True,
                                   random_seed=seed)
        if serialize_powersgd is None:
            serialize_powersgd = dist.get_backend(model.process_group) == "gloo"
        if serialize_powersgd:
            model.register_comm_hook(_SerializedPowerSGD(state), _serialized_powersgd_hook)
        else:
            model.register_comm_hook(state, psgd.powerSGD_hook)
        return state
    if hook == "none":
        return None
    raise ValueError(f"hook must be one of {HOOKS}, got {hook!r}")


def powersgd_bits(model, rank: int, min_compression_rate: float = 2.0) -> float:
    """Bits per parameter PowerSGD hands to allreduce per step: r·(n+m) values per compressed n x m matrix (its
    rule: compressed when n·m >= min_compression_rate·r·(n+m)), 1-D tensors and the rest whole, in fp32."""
    sent = total = 0
    for p in model.parameters():
        total += p.numel()
        if p.dim() > 1:
            n, m = p.shape[0], p.numel() // p.shape[0]
            r = min(n, m, rank)
            if n * m >= min_compression_rate * r * (n + m):
                sent += r * (n + m)
                continue
        sent += p.numel()
    return 32.0 * sent / total
