"""Owner-step exchange: ternary gradients to the shard owners, ternary weight differences back; about 1.6 + 1.6
bits per element received at any number of ranks N (base-3), with the owners stepping their shards in between.

Each rank owns one shard of every ternarized tensor (codec.sizes.reternarized_bounds) and keeps the master
weights of its shards and their optimizer state (optim/owner_step.py).  Every rank computes on a replica x of the
weights.  One step:

1. Gradients (``send_gradients`` / ``owned_averages``): the re-ternarized exchange's first stage, byte for byte.
   Every rank ternarizes its gradient with one scaler per shard (clip at c·σ, its own stream: seed, step, tensor,
   rank, element) and sends shard o's payload, with its squares trailer where the optimizer wants the noise
   estimate (codec/squares.py), to rank o: one alltoall.  Owner o decodes a_o = (Σ_r s_r·t_r)/N in fp32 in rank
   order, exactly as every exchange decodes, and the first stage's noise estimate ν_o = (1/N²)·Σ_r s_r²·|t_r|
   with the minibatch's share taken out: unbiased, E[a_o] = mean_r clip(g_r).  No second rounding of the
   gradient: the owner's optimizer steps on the exact average, and its second moment sees ν_o.
   With ``config.levels = 4`` the gradients travel in the four-level code instead (codec/levels.py: 2 bits per
   element, the ranks' dithers stratified, so the average's rounding variance is well under the ternary code's);
   the owners decode and estimate the same way.
2. The owner steps its shard of the master weights w_o (the caller, between the stages).
3. Weights (``send_weights`` / ``apply_weights``): the owner rounds d_o = w_o - x_o to the nearest ternary level
   (codec/nearest.py: one scaler s = max|d| per shard, or per ``weight_bucket`` elements of it, |d - q| <= s/2,
   deterministic) and sends q_o to every rank:
   one allgather.  Every rank, the owner too, sets x_o += q_o, so every replica holds the same bits.  The
   difference is taken against the master each step, so the replica stays within one step of it (nearest.py).

Tensors the policy keeps at full precision (``min_numel``, ``exclude``) travel as fp32 in one allgather and are
summed in rank order (``exact_average``): every rank steps them alike.  A NaN/Inf in any rank's gradient is
flagged to every rank by one allreduce-max of a flag per tensor (``nonfinite``), so all ranks decide alike.

Traffic per rank and element (b = 1.6 bits base-3, 2 with 2-bit packing): receives (N-1)/N·b in the alltoall (2
bits with the four-level code) and (N-1)/N·b in the allgather, plus per shard and sender a 20-byte header, a 4-byte scaler and (with the noise
estimate) a 4-byte squares trailer, both ways: 3.2 bits plus 8·(N-1)·52/n bits for a tensor of n elements, and
(N-1)/N·32/K bits more with one weight scaler per K elements (codec.sizes: reternarized_chunk_bytes,
owner_step_weight_chunk_bytes).  Per step, each fused over every tensor:
the alltoall, the flags' allreduce-max (one fp64 per tensor) and the allgather; one more allgather for
the full-precision tensors, and one of a scalar where the optimizer clips the global norm.
"""
from __future__ import annotations

import time

import torch

from .. import backends, codec
from ..codec import sizes, squares
from ..codec.packing import Header
from ..errors import RankMismatchError
from . import allgather, reternarized


class TensorLayout:
    """One ternarized tensor's place in the exchange, the same on every rank: its name, size, the shards' bounds,
    the bucket it is ternarized with, and the bytes of each shard both ways (``fmt``: the weight differences'
    ternary packing; ``grad_fmt``: the gradients' first-stage format, ``fmt`` by default)."""

    __slots__ = ("name", "numel", "bounds", "encode_bucket", "grad_chunks", "weight_chunks", "noise")

    def __init__(self, name: str, numel: int, n_ranks: int, fmt: str, bucket_size: int, noise: bool,
                 weight_bucket: int = 0, grad_fmt: str | None = None):
        self.name, self.numel, self.noise = name, int(numel), bool(noise)
        self.bounds = sizes.reternarized_bounds(self.numel, n_ranks, bucket_size)
        self.encode_bucket = sizes.reternarized_encode_bucket(self.numel, n_ranks, bucket_size)
        self.grad_chunks = sizes.reternarized_chunk_bytes(self.numel, n_ranks, grad_fmt or fmt, bucket_size,
                                                          self.noise)
        self.weight_chunks = sizes.owner_step_weight_chunk_bytes(self.numel, n_ranks, fmt, bucket_size, weight_bucket)


class OwnerStepExchange:
    """The owner-step exchange (module docstring) of a fixed list of ternarized tensors on ``coll``: built once,
    from what every rank agrees on (the names and sizes, in order, and the config), then called every step."""

    def __init__(self, coll, config, tensors: list, noise: list | None = None, name: str = "terngrad.os",
                 weight_bucket: int = 0):
        self.coll, self.config, self.name = coll, config, name
        self.weight_bucket = int(weight_bucket)
        if self.weight_bucket < 0:
            raise ValueError(f"owner-step exchange '{name}': weight_bucket must be >= 0 (0: one scaler per shard), "
                             f"got {weight_bucket}")
        N = coll.size
        noise = noise or [False] * len(tensors)
        self.grad_format = config.first_stage_format("requantized")     # the requantized exchange's first stage
        self.layout = [TensorLayout(n, numel, N, config.packing, config.bucket_size, w, self.weight_bucket,
                                    self.grad_format)
                       for (n, numel), w in zip(tensors, noise)]
        me = coll.rank
        self.owned = [lay.bounds[me] for lay in self.layout]
        self.grad_block = sum(lay.grad_chunks[me] for lay in self.layout)     # bytes from each sender
        self.weight_blocks = [sum(lay.weight_chunks[o] for lay in self.layout) for o in range(N)]
        self.bytes_received = 0        # this rank's payload bytes received so far (both stages)
        self.codec_s = 0.0

    # -- stage 1 -------------------------------------------------------------------------------------------------
    def send_gradients(self, grads: list, step: int):
        """Encode every rank's flat gradients (fp32 or bf16, one per tensor of the layout) and start the alltoall
        and the nonfinite flags' allreduce.  ``step``: the stream's step (the optimizer's count)."""
        t0 = time.perf_counter()
        cfg, N, me = self.config, self.coll.size, self.coll.rank
        to_rank = [[] for _ in range(N)]
        flags = []
        for lay, g in zip(self.layout, grads):
            flat = _flat32(g, lay)
            backend = backends.for_device(flat.device)
            prep = backend.prepare(flat, lay.encode_bucket, cfg.clip_factor)
            payload = self._encode(backend, flat, prep, lay, step)
            payload[3:4] = prep.nonfinite.to(torch.uint8).reshape(1)
            sums = backends.clipped_square_sums(flat, prep.threshold, lay.bounds) if lay.noise else None
            chunks = reternarized.shard_payloads(payload, lay.numel, N, lay.encode_bucket, self.grad_format,
                                                 cfg.bucket_size, sums)
            for o, chunk in enumerate(chunks):
                to_rank[o].append(chunk)
            flags.append(prep.nonfinite.to(torch.float64).reshape(1))
        self.codec_s += time.perf_counter() - t0
        device = grads[0].device if grads else torch.device("cpu")
        send = torch.cat([c for chunks in to_rank for c in chunks]) if grads else torch.empty(0, dtype=torch.uint8)
        splits = [sum(c.numel() for c in chunks) for chunks in to_rank]
        kw = {"received": [self.grad_block] * N} if getattr(self.coll, "takes_sizes", False) else {}
        flag_t = torch.cat(flags).to(device) if flags else torch.zeros(1, dtype=torch.float64, device=device)
        return (self.coll.alltoall_async(send, splits, f"{self.name}.grad", **kw),
                self.coll.allreduce_max_async(flag_t, f"{self.name}.flags"))

    def _encode(self, backend, flat: torch.Tensor, prep, lay: TensorLayout, step: int) -> torch.Tensor:
        """This rank's first-stage payload of one tensor: ternary, or four-level with dithers stratified over the
        ranks (config.levels; codec/levels.py)."""
        cfg, me, N = self.config, self.coll.rank, self.coll.size
        tensor = codec.tensor_id(lay.name)
        key = codec.stream_key(cfg.seed, step, tensor, me)
        if self.grad_format == sizes.FOUR_LEVEL:
            return backend.encode_levels(flat, prep.threshold, prep.scalers, lay.encode_bucket, key,
                                         codec.levels.strata_key(cfg.seed, step, tensor), me, N, shape=(lay.numel,))
        return backend.encode(flat, prep.threshold, prep.scalers, lay.encode_bucket, key, cfg.packing,
                              shape=(lay.numel,))

    def nonfinite(self, handles) -> list:
        """The names of the tensors whose gradient held NaN/Inf on some rank (the same list on every rank)."""
        flags = self.coll.synchronize(handles[1])
        return [lay.name for lay, f in zip(self.layout, flags.tolist()) if f != 0]

    def owned_averages(self, handles) -> list:
        """Per tensor, (a_o, ν_o or None) of this rank's shard (fp32 [m]), or None where it owns no elements."""
        received = self.coll.synchronize(handles[0])
        t0 = time.perf_counter()
        N, cfg = self.coll.size, self.config
        if received.numel() != N * self.grad_block:
            raise RankMismatchError(f"TernGrad: owner-step exchange '{self.name}': received {received.numel()} "
                                    f"bytes, expected {N}x{self.grad_block}: ranks disagree on the tensors or "
                                    f"settings")
        self.bytes_received += received.numel() - self.grad_block
        backend = backends.for_device(received.device)
        out, pre = [], 0
        for lay, (lo, hi) in zip(self.layout, self.owned):
            m = hi - lo
            if m == 0:
                out.append(None)
                continue
            offsets = [s * self.grad_block + pre for s in range(N)]
            pre += lay.grad_chunks[self.coll.rank]
            head = Header(self.grad_format, 0, cfg.bucket_size, m)
            reternarized.check_shard_headers(received, offsets, head, lay.name)
            avg = backend.decode(received, [head] * N, offsets, N)
            noise = None
            if lay.noise:
                noise = allgather.noise_estimate(received, [head] * N, offsets, N)
                size = sizes.payload_size(m, self.grad_format, cfg.bucket_size, squares=True)
                squares.take_out_minibatch_share(noise, squares.read(received, [o + size for o in offsets]), N)
            out.append((avg, noise))
        self.codec_s += time.perf_counter() - t0
        return out

    # -- stage 3 -------------------------------------------------------------------------------------------------
    def send_weights(self, deltas: list, device=None):
        """Start the allgather of this rank's weight differences (fp32 [m] per tensor it owns a shard of, None
        elsewhere), each rounded to the nearest ternary level."""
        t0 = time.perf_counter()
        fmt = self.config.packing
        parts = [backends.encode_nearest(d, fmt, self.weight_bucket) for d in deltas if d is not None]
        device = device or (parts[0].device if parts else torch.device("cpu"))
        mine = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        self.codec_s += time.perf_counter() - t0
        kw = {"sizes": self.weight_blocks} if getattr(self.coll, "takes_sizes", False) else {}
        return self.coll.allgather_async(mine, f"{self.name}.weights", **kw)

    def apply_weights(self, handle, replicas: list) -> None:
        """x_o += q_o on every shard of every tensor: ``replicas`` the flat views of the weights every rank
        computes on (any float dtype), one per tensor of the layout."""
        gathered = self.coll.synchronize(handle)
        t0 = time.perf_counter()
        N, fmt, me = self.coll.size, self.config.packing, self.coll.rank
        if gathered.numel() != sum(self.weight_blocks):
            raise RankMismatchError(f"TernGrad: owner-step exchange '{self.name}': gathered {gathered.numel()} "
                                    f"weight bytes, expected {sum(self.weight_blocks)}: ranks disagree on the "
                                    f"tensors or settings")
        self.bytes_received += gathered.numel() - self.weight_blocks[me]
        backend = backends.for_device(gathered.device)
        at = 0
        for o in range(N):
            for lay, x in zip(self.layout, replicas):
                lo, hi = lay.bounds[o]
                if hi > lo:
                    head = Header(fmt, 0, sizes.header_bucket(hi - lo, self.weight_bucket), hi - lo)
                    q = backend.decode(gathered, [head], [at], 1)
                    x[lo:hi] += q.to(x.dtype)
                    at += lay.weight_chunks[o]
        self.codec_s += time.perf_counter() - t0

    # -- the full-precision tensors ------------------------------------------------------------------------------
    def exact_average(self, tensors: list) -> list:
        """The rank-order fp32 average of each of ``tensors`` (the same on every rank), by one allgather."""
        if not tensors:
            return []
        N = self.coll.size
        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])
        kw = {"sizes": [flat.numel()] * N} if getattr(self.coll, "takes_sizes", False) else {}
        gathered = self.coll.synchronize(self.coll.allgather_async(flat, f"{self.name}.exact", **kw))
        if gathered.numel() != N * flat.numel():
            raise RankMismatchError(f"TernGrad: owner-step exchange '{self.name}': ranks disagree on the "
                                    f"full-precision tensors ({gathered.numel()} elements gathered, "
                                    f"{N}x{flat.numel()} expected)")
        rows = gathered.view(N, -1)
        total = rows[0].clone()
        for r in range(1, N):
            total += rows[r]
        total /= N
        out, at = [], 0
        for t in tensors:
            out.append(total[at:at + t.numel()].view(t.shape))
            at += t.numel()
        return out

    def scalars(self, value: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's 0-d fp64 ``value``, in rank order: fp64 [N], the same on every rank."""
        kw = {"sizes": [1] * self.coll.size} if getattr(self.coll, "takes_sizes", False) else {}
        return self.coll.synchronize(self.coll.allgather_async(value.reshape(1).to(torch.float64).cpu(),
                                                               f"{self.name}.{what}", **kw))

    def scalar_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Σ over ranks of a 0-d fp64 ``value``, in rank order (the same bits on every rank)."""
        gathered = self.scalars(value, "norm")
        total = gathered[0].clone()
        for r in range(1, gathered.numel()):
            total += gathered[r]
        return total


def _flat32(g: torch.Tensor, lay: TensorLayout) -> torch.Tensor:
    flat = g.detach().reshape(-1)
    if flat.numel() != lay.numel:
        raise RankMismatchError(f"TernGrad: gradient '{lay.name}' holds {flat.numel()} elements where the "
                                f"owner-step exchange was built for {lay.numel}")
    if not flat.is_floating_point():
        raise TypeError(f"TernGrad: gradient '{lay.name}' has dtype {flat.dtype}; a floating-point one is needed")
    return flat.to(torch.float32).contiguous()


__all__ = ["OwnerStepExchange", "TensorLayout"]
