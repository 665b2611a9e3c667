"""Requantized exchange: ternary up, the owners' exact averages down in 4 bits, with Adam's noise estimate; about
2 + 4.25 bits per element received at any number of ranks N (+1.25 with the noise estimate).

1. As the re-ternarized exchange (reternarized.py, whose first stage and shards it shares): every rank ternarizes
   its gradient with one scaler per shard and its own stream and sends shard o's payload to rank o (alltoall).
2. Owner o decodes the N payloads of its shard, a_o = (Σ_r s_r·t_r)/N in fp32 in rank order, exactly as every
   other exchange decodes, and encodes a_o in 4-bit groups of 128 with stochastic, unbiased rounding
   (codec/requant.py): the second rounding's variance is Δ²·f·(1 - f) <= max|a|²/196 per element, where the
   re-ternarized exchange's s'·|a| - a² reaches max|a|²/4.  For a parameter whose optimizer asked for the noise
   estimate (horovod_terngrad.optim), the owner also sends, per element, one unbiased stochastic bit of
   ν = (1/N²)·Σ_r s_r²·|t_r| + Δ²·f·(1 - f): the first stage's estimate, which only the owner can form since
   only it holds every rank's payload of the shard (the same estimate the allgather exchange forms on every
   rank; with the minibatch's share taken out by the senders' squares, which ride with each shard:
   codec/squares.py), plus the second rounding's exact variance.  The owners' payloads go to every rank by one
   allgather.
3. Every rank decodes every owner's payload into its shard; every rank decodes the same bytes, so every result
   (and noise estimate) is identical on every rank.

Unbiased: E[out | a] = a and E[a] = mean_r clip(g_r).  The noise channel's bit is unbiased for ν too; the
optimizer keeps a running mean of it, which averages the bit's own variance away.

Traffic per rank and element (b = 2 bits, 1.6 with base-3): sends and receives (N-1)/N·b in the alltoall and
(N-1)/N·(4.25 [+ 1.25]) in the allgather, plus headers (and, with the noise channel, a 4-byte squares trailer
per shard): at most 2 + 4.25 + 1.25 = 7.5 bits at any N (the
allgather exchange receives (N-1)·b; the sharded one (N-1)/N·(b + ceil(log2(2N+1)))).
"""
from __future__ import annotations

import torch

from .. import backends
from ..codec import requant, sizes, squares
from ..codec.packing import FLAG_NONFINITE, Header, device_constant
from . import allgather, reternarized

encode_bucket = reternarized.encode_bucket


class RequantizedStage:
    """The owner's second stage: its exact average in 4-bit groups, and the noise channel when asked."""

    label = "requantized exchange"
    settings_hint = " (or on whether their optimizers asked for the noise estimate: every rank must use the same one)"
    takes_squares = True       # the senders' squares take the minibatch's share out of the owner's estimate

    @staticmethod
    def owner_chunks(ex, tk) -> list:
        return sizes.requantized_owner_chunk_bytes(tk.numel, ex.coll.size, tk.want_noise, tk.group.bucket_size)

    @staticmethod
    def owner_payload(backend, received, offsets, lo, hi, tk, ex) -> torch.Tensor:
        cfg, N, m = ex.config, ex.coll.size, hi - lo
        if m == 0:                 # an empty shard: nothing came, nothing goes (sizes.requantized_owner_chunk_bytes)
            return reternarized.empty_payload(received.device)
        head = Header(cfg.first_stage_format(tk.group.transport), 0, tk.group.bucket_size, m)
        reternarized.check_shard_headers(received, offsets, head, tk.name)
        flags = received[device_constant([o + 3 for o in offsets], torch.int64, received.device)]
        bad = (flags & FLAG_NONFINITE).ne(0).any()
        divisor = N if tk.average else 1
        avg = backend.decode(received, [head] * N, offsets, divisor)
        noise = None
        if tk.want_noise:
            noise = allgather.noise_estimate(received, [head] * N, offsets, divisor)
            if tk.squares:
                size = sizes.payload_size(m, head.fmt, tk.group.bucket_size, squares=True)
                squares.take_out_minibatch_share(noise, squares.read(received, [o + size for o in offsets]), divisor)
        _zero_if(bad, avg, noise)                  # a flagged shard is NaN anyway: keep it finite
        keys = requant.keys(cfg.seed, tk.step, tk.name, ex.coll.rank if ex.stream_rank is None else ex.stream_rank)
        if backends.has_capability(backend, backends.REQUANT):
            payload = backend.requant_encode(avg, keys, lo, noise)
        else:
            payload = requant.encode(avg, keys, lo, noise)
        payload[3:4] |= bad.to(torch.uint8).reshape(1)                # the flag, set on the device: no sync
        return payload

    @staticmethod
    def decode(gathered, off, lo, hi, tk, ex, out, noise) -> None:
        backend = backends.for_device(gathered.device)
        fn = backend.requant_decode if backends.has_capability(backend, backends.REQUANT) else requant.decode
        fn(gathered, off, hi - lo, tk.want_noise, out[lo:hi], None if noise is None else noise[lo:hi])


def _zero_if(bad: torch.Tensor, *tensors) -> None:
    """Zero ``tensors`` (None skipped) in place where the 0-d bool ``bad`` is set: decided on the host for a CPU
    tensor (free there, and no pass over a clean shard), on the device otherwise (no synchronization)."""
    if bad.device.type == "cpu":
        if bool(bad):
            for t in tensors:
                if t is not None:
                    t.zero_()
        return
    for t in tensors:
        if t is not None:
            t.masked_fill_(bad, 0.0)


def send(ex, grp, sends: list) -> None:
    reternarized.send(ex, grp, sends, RequantizedStage)


def after_alltoall(ex, grp) -> None:
    reternarized.after_alltoall(ex, grp, RequantizedStage)


def receive(ex, tk) -> torch.Tensor | None:
    return reternarized.receive(ex, tk, RequantizedStage)


__all__ = ["send", "after_alltoall", "receive", "encode_bucket", "RequantizedStage"]
