"""Re-ternarized exchange: about 2 + 2 bits per element on the wire at any number of ranks N.

Each rank owns one shard of every tensor (codec.sizes.reternarized_bounds: ceil(n/N) rounded up to whole
buckets on a byte boundary).  Per-rank scalers by default, so no handshake: payloads leave as soon as a group is
complete, and nothing is read on the host before they do.

1. Every rank ternarizes its whole gradient with one scaler per shard (or the user's buckets, which shards hold
   whole) and its own random stream, exactly as the allgather exchange would with those buckets, and sends shard
   o's payload (header, the shard's scalers, its packed codes) to rank o: one alltoall.
2. Owner o decodes the N payloads of its shard as the allgather exchange decodes a tensor,
   a_o = (Σ_r s_r·t_r)/N in fp32 in rank order, and ternarizes a_o again: scaler s'_o = max|a_o| per bucket, no
   clipping (so it stays unbiased), a random stream of its own (seed, step, tensor, owner's rank, element; the
   tensor word is the name's with '#owner', so it is no stream of step 1).  The owners' payloads go to every
   rank by one allgather.
3. Every rank decodes every owner's payload into its shard: out = s'_o·t'_o.  Every rank decodes the same bytes,
   so all results are identical.

Unbiased: E[out | a] = a (stochastic rounding with s' >= |a|) and E[a] = mean_r clip(g_r), so
E[out] = mean_r clip(g_r), as the other exchanges.  The owner's rounding adds its variance, s'·|a| - a^2 per
element, on top of the allgather exchange's.  The owner keeps no error feedback.  1-bit Adam's ``server_error``
(ternarize x = a + e, keep e = x - s'·t') was built and measured (commit 76c7be9, reverted): it makes each step
biased by the carried residual (E[out] = a + e) and, with this stochastic ternary rounding, which is unbiased but
not a contraction (its error s'·|x| - x^2 per element exceeds x^2 wherever |x| < s'/2), the residual and the
scaler s' = max|a + e| grow instead of shrinking: the LM with TernGrad's AdamW ended at held-out 2.351 against
1.3230 without it (DDP, 4 ranks, seed 0), LeNet with SGD unchanged (98.53% against 98.55%, N = 8, 3 seeds).
Error feedback needs a contracting compressor (1-bit Adam's scaled sign); docs/perfmodel.md.

Traffic per rank and element, b = 2 bits (1.6 with base-3): sends (N-1)/N·b in the alltoall and (N-1)/N·b in
the allgather, receives the same, plus a 20-byte header and 4-byte scaler per shard and member: flat in N
(the allgather exchange receives (N-1)·b, the sharded one (N-1)/N·(b + ceil(log2(2N+1)))).  Two collectives
per group (latency), and the owner pays one more decode and encode of its shard.

A NaN/Inf on a rank sets its payload's flag; the owner's payload carries the flag on, so every rank sees it in
the gathered bytes.  For horovod_terngrad.optim's default Adam, every rank forms from the owners' payloads the
noise estimate of the owner's rounding, s'^2·|t'| per element (an unbiased estimate of s'·|a|, which exceeds
that rounding's variance s'·|a| - a^2 by a^2), at no extra bytes; the first stage's noise, (1/N^2)·Σ_r
s_r·|g_r| - g_r^2, is seen by the owner alone and is left out (it shrinks as 1/N, the owner's does not).
"""
from __future__ import annotations

import time

import torch

from .. import backends, codec
from ..codec import sizes
from ..codec.packing import FLAG_NONFINITE, Header
from ..errors import RankMismatchError
from . import allgather, sharded

OWNER_SUFFIX = "#owner"      # the owner's random stream: tensor word of '<name>#owner'


def encode_bucket(ex, numel: int, bucket_size: int) -> int:
    """The bucket size a rank ternarizes a tensor of ``numel`` elements with (step 1), for the group's configured
    ``bucket_size`` (Group.bucket_size: 0 = one scaler per shard)."""
    return sizes.reternarized_encode_bucket(numel, ex.coll.size, bucket_size)


def empty_payload(device) -> torch.Tensor:
    """The payload of an empty shard (past the end of a short tensor): no bytes (codec.sizes.reternarized_chunk_bytes;
    every owner of a non-empty shard carries each sender's flag on)."""
    return torch.empty(0, dtype=torch.uint8, device=device)


def shard_payload(payload: torch.Tensor, numel: int, lo: int, hi: int, encode_bucket_size: int, fmt: str,
                  bucket_size: int) -> torch.Tensor:
    """Shard [lo, hi) of a whole tensor's payload (encoded with ``encode_bucket_size``) as a payload of its
    own: a header for hi - lo elements with the user's ``bucket_size`` and the sender's flags (copied on the
    device), the shard's scalers, its packed codes."""
    if hi <= lo:
        return empty_payload(payload.device)
    nb = sizes.num_buckets(numel, encode_bucket_size)
    scalers = payload[sizes.HEADER_BYTES:sizes.codes_offset(nb)]
    codes = payload[sizes.codes_offset(nb):]
    head = codec.packing.header_tensor(hi - lo, fmt, bucket_size, payload.device)     # shared: not written to
    b0, b1 = sizes.code_byte_range(lo, hi, fmt)
    k0, k1 = lo // encode_bucket_size, -(-hi // encode_bucket_size)
    out = torch.cat([head, scalers[k0 * sizes.SCALER_BYTES:k1 * sizes.SCALER_BYTES], codes[b0:b1]])
    out[3:4] = payload[3:4]                                                               # the sender's flags
    return out


def shard_payloads(payload: torch.Tensor, numel: int, n_ranks: int, encode_bucket_size: int, fmt: str,
                   bucket_size: int, square_sums: torch.Tensor | None = None) -> list:
    """Every shard's payload (``shard_payload`` of each owner, the same bytes; with ``square_sums``, fp32 [N],
    each non-empty shard carries its own in a squares trailer, codec/squares.py).  The full-size shards, all but
    the last one or few, are laid out by a few copies into one [shards, bytes] block (one header, the flag byte
    from the sender's, the scalers and codes, which tile the payload, the trailers), its rows handed out as views:
    a rank sends N shards per tensor, and one small tensor op per shard cost about 70 us each (0.7 s per step at
    64 ranks on a ResNet-50's 161 tensors)."""
    bounds = sizes.reternarized_bounds(numel, n_ranks, bucket_size)
    full = sizes.reternarized_shard(numel, n_ranks, bucket_size)
    count = sum(1 for lo, hi in bounds if hi - lo == full) if full else 0

    def one(r, lo, hi):
        out = shard_payload(payload, numel, lo, hi, encode_bucket_size, fmt, bucket_size)
        return out if square_sums is None or hi <= lo else codec.squares.attach(out, square_sums[r])
    if count < 2:
        return [one(r, lo, hi) for r, (lo, hi) in enumerate(bounds)]
    per_scalers = -(-full // encode_bucket_size) * sizes.SCALER_BYTES
    per_codes = sizes.code_byte_range(0, full, fmt)[1]
    nb = sizes.num_buckets(numel, encode_bucket_size)
    at = sizes.codes_offset(nb)
    trailer = 0 if square_sums is None else sizes.SQUARES_BYTES
    width = sizes.HEADER_BYTES + per_scalers + per_codes + trailer
    block = torch.empty((count, width), dtype=torch.uint8, device=payload.device)
    block[:, :sizes.HEADER_BYTES] = codec.packing.header_tensor(full, fmt, bucket_size, payload.device)
    block[:, 3] = payload[3] if square_sums is None else payload[3] | codec.packing.FLAG_SQUARES
    block[:, sizes.HEADER_BYTES:sizes.HEADER_BYTES + per_scalers] = \
        payload[sizes.HEADER_BYTES:sizes.HEADER_BYTES + count * per_scalers].view(count, per_scalers)
    block[:, sizes.HEADER_BYTES + per_scalers:width - trailer] = payload[at:at + count * per_codes].view(count, per_codes)
    if trailer:
        block[:, width - trailer:] = square_sums[:count].contiguous().view(torch.uint8).view(count, trailer)
    return list(block.unbind(0)) + [one(count + r, lo, hi) for r, (lo, hi) in enumerate(bounds[count:])]


def send(ex, grp, sends: list, stage=None) -> None:
    """Alltoall: to rank o, the payload of shard o of every member (members in order), with the sender's
    squares of the shard (codec/squares.py) where ``stage`` (this exchange's second stage by default) forms the
    noise estimate the optimizer asked for (``takes_squares``), which they correct; recorded in ``tk.squares``."""
    N, cfg = ex.coll.size, ex.config
    stage = stage or TernaryStage
    to_rank = [[] for _ in range(N)]
    for tk, payload in sends:
        n = tk.source.numel()
        tk.squares = stage.takes_squares and tk.want_noise
        sums = (backends.clipped_square_sums(tk.source, tk.threshold, sizes.reternarized_bounds(n, N, grp.bucket_size))
                if tk.squares else None)
        fmt = cfg.first_stage_format(grp.transport)
        for o, chunk in enumerate(shard_payloads(payload, n, N, tk.bucket, fmt, grp.bucket_size, sums)):
            to_rank[o].append(chunk)
    sharded.launch_alltoall(ex, grp, [tk for tk, _ in sends], torch.cat([c for chunks in to_rank for c in chunks]),
                            [sum(c.numel() for c in chunks) for chunks in to_rank], f"terngrad.rt.{grp.name}")


class TernaryStage:
    """The owner's second stage of this exchange: the average ternarized again (``owner_payload``).  The
    requantized exchange (requantized.py) shares the first stage and passes a stage of its own, with these three
    functions."""

    label = "re-ternarized exchange"
    settings_hint = ""
    takes_squares = False      # its estimate is the owner's rounding's alone (module docstring)

    @staticmethod
    def owner_chunks(ex, tk) -> list:
        """Bytes of each owner's payload of this member (what each owner adds to the allgather)."""
        return sizes.reternarized_chunk_bytes(tk.numel, ex.coll.size, ex.config.packing, tk.group.bucket_size)

    @staticmethod
    def owner_payload(backend, received, offsets, lo, hi, tk, ex) -> torch.Tensor:
        return owner_payload(backend, received, offsets, hi - lo, tk, ex)

    @staticmethod
    def decode(gathered, off, lo, hi, tk, ex, out, noise) -> None:
        backend = backends.for_device(gathered.device)
        head = Header(ex.config.packing, 0, tk.group.bucket_size, hi - lo)
        backend.decode(gathered, [head], [off], 1, out=out[lo:hi])
        if noise is not None:
            allgather.noise_estimate(gathered, [head], [off], 1, out=noise[lo:hi])


def after_alltoall(ex, grp, stage=TernaryStage) -> None:
    """Owner step: per member, decode this rank's shard from the N payloads, encode its second stage (``stage``:
    ternarized again, or requantized), and allgather every member's owner payload."""
    received = sharded.alltoall_result(ex, grp, stage.label)
    if received is None:
        return
    t0 = time.perf_counter()
    N, me, cfg = ex.coll.size, ex.coll.rank, ex.config
    members = grp.sent
    bounds = [sizes.reternarized_bounds(tk.numel, N, grp.bucket_size)[me] for tk in members]
    fmt = cfg.first_stage_format(grp.transport)
    chunks = [sizes.reternarized_chunk_bytes(tk.numel, N, fmt, grp.bucket_size, tk.squares) for tk in members]
    nbytes = [c[me] for c in chunks]
    block = sum(nbytes)
    if received.numel() != N * block:
        err = RankMismatchError(f"TernGrad: {stage.label} of group '{grp.name}': received "
                                f"{received.numel()} bytes, expected {N}x{block}: ranks disagree on its "
                                f"tensors or settings")
        for tk in members:
            tk.error = err
        return
    backend = backends.for_device(received.device)
    owned, pre = [], 0
    try:
        for tk, (lo, hi), size in zip(members, bounds, nbytes):
            offsets = [s * block + pre for s in range(N)]
            pre += size
            owned.append(stage.owner_payload(backend, received, offsets, lo, hi, tk, ex))
            tk.payload_bytes = owned[-1].numel()
    except RankMismatchError as err:      # every rank finds it (every owner reads a disagreeing sender's header):
        for tk in members:                # each member fails at its finish, as with the size check above
            tk.error = err
        return
    finally:
        ex.stats.codec_s += time.perf_counter() - t0
    if getattr(ex.coll, "takes_sizes", False):       # the last owners' shards may be short
        out_chunks = chunks if stage is TernaryStage else [stage.owner_chunks(ex, tk) for tk in members]
        owners = [sum(c[o] for c in out_chunks) for o in range(N)]
    else:
        owners = None
    allgather.launch(ex, grp, members, owned[0] if len(owned) == 1 else torch.cat(owned),
                     f"terngrad.rg.{grp.name}", sizes=owners)


def check_shard_headers(received: torch.Tensor, offsets: list, head: Header, name: str) -> None:
    """The senders' headers name the shard, its packing and buckets: on the host (a CPU tensor), all N compared at
    once with the header this owner expects (every byte but the flags); RankMismatchError naming the tensor and
    what a sender said where one differs.  On an accelerator the sizes check alone (no host read)."""
    if received.device.type != "cpu" or not offsets:
        return
    want = codec.packing.header_tensor(head.numel, head.fmt, head.bucket_size, received.device)
    cols = torch.tensor([i for i in range(sizes.HEADER_BYTES) if i != 3], dtype=torch.int64)
    at = torch.tensor(offsets, dtype=torch.int64).unsqueeze(1) + cols
    if torch.equal(received[at], want[cols].expand(len(offsets), -1)):
        return
    for o in offsets:
        got = codec.packing.read_header(received, o, f"shard of '{name}'")
        if (got.numel, got.fmt, got.bucket_size) != (head.numel, head.fmt, head.bucket_size):
            raise RankMismatchError(f"TernGrad: ranks disagree on gradient '{name}': a shard of {got.numel} "
                                    f"elements ({got.fmt}, buckets {got.bucket_size}) where this rank owns "
                                    f"{head.numel} ({head.fmt}, buckets {head.bucket_size})")


def owner_payload(backend, received: torch.Tensor, offsets: list, m: int, tk, ex) -> torch.Tensor:
    """The owner's payload of one member's shard (m elements): the N senders' payloads at ``offsets`` averaged,
    then ternarized again with its own scalers and stream; a NaN/Inf flag of any sender carried on."""
    cfg, N, buckets = ex.config, ex.coll.size, tk.group.bucket_size
    if m == 0:                 # an empty shard: nothing came, nothing goes
        return empty_payload(received.device)
    head = Header(cfg.first_stage_format(tk.group.transport), 0, buckets, m)
    check_shard_headers(received, offsets, head, tk.name)
    flags = received[codec.packing.device_constant([o + 3 for o in offsets], torch.int64, received.device)]
    bad = (flags & FLAG_NONFINITE).ne(0).any().to(torch.uint8)
    avg = backend.decode(received, [head] * N, offsets, N if tk.average else 1)
    avg = torch.where(bad.bool(), torch.zeros_like(avg), avg)      # a flagged shard is NaN anyway: keep it finite
    prep = backend.prepare(avg, buckets, 0.0)
    key = codec.stream_key(cfg.seed, tk.step, codec.tensor_id(tk.name + OWNER_SUFFIX),
                           ex.coll.rank if ex.stream_rank is None else ex.stream_rank)
    payload = backend.encode(avg, prep.threshold, prep.scalers, buckets, key, cfg.packing, shape=(m,))
    payload[3:4] = bad
    return payload


def receive(ex, tk, stage=TernaryStage) -> torch.Tensor | None:
    """The average of one member: every owner's payload decoded into its shard (by ``stage``)."""
    gathered = allgather.gathered(ex, tk)
    t0 = time.perf_counter()
    grp, N, cfg = tk.group, ex.coll.size, ex.config
    n = tk.numel
    if grp.walked is None:       # every member's offsets in the gathered owners' blocks, once per group
        chunk = [stage.owner_chunks(ex, m) for m in grp.sent]
        block = [sum(c[o] for c in chunk) for o in range(N)]
        if sum(block) != gathered.numel():
            raise RankMismatchError(f"TernGrad: {stage.label} of group '{grp.name}': gathered "
                                    f"{gathered.numel()} bytes, expected {sum(block)}: ranks disagree on its "
                                    f"tensors or settings{stage.settings_hint}")
        walked, at = [[] for _ in grp.sent], 0
        for o in range(N):
            inner = at
            for j, c in enumerate(chunk):
                walked[j].append(inner)
                inner += c[o]
            at += block[o]
        grp.walked = walked
    offsets = grp.walked[tk.slot]
    bounds = sizes.reternarized_bounds(n, N, grp.bucket_size)
    flags = gathered[codec.packing.device_constant([o + 3 for (lo, hi), o in zip(bounds, offsets) if hi > lo],
                                                   torch.int64, gathered.device)]               # empty: no bytes
    bad = (flags & FLAG_NONFINITE).ne(0).any()
    on_host = not allgather.on_device(gathered) or (cfg.on_nonfinite == "raise" and not ex.nonfinite_on_device)
    if on_host:                                                           # free on a CPU
        if bool(bad):
            ex.nonfinite(tk, f"TernGrad: gradient '{tk.name}' (shape {tuple(tk.shape)}) contains NaN or Inf on at "
                             f"least one rank ({stage.label}: a shard's owner carried the flag on)")
            if tk.error is not None:
                raise tk.error
            return None
        bad = None
    out = tk.g32 if tk.in_place else torch.empty(n, dtype=torch.float32, device=gathered.device)
    noise = None
    if tk.want_noise:      # on the CPU the ledger's buffer of the parameter (precision.Route.arm: no fresh pages)
        noise = tk.noise_out
        if noise is None:
            noise = torch.empty(n, dtype=torch.float32, device=gathered.device)
    for (lo, hi), off in zip(bounds, offsets):
        if hi > lo:
            stage.decode(gathered, off, lo, hi, tk, ex, out, noise)
    if bad is not None:          # an accelerator: the flags decided on the device, no synchronization
        out.masked_fill_(bad, 0.0 if cfg.on_nonfinite == "zero" else float("nan"))   # "raise": the caller reads it
        if noise is not None:
            noise.masked_fill_(bad, 0.0)
    tk.noise = noise
    ex.stats.codec_s += time.perf_counter() - t0
    return out


__all__ = ["send", "after_alltoall", "receive", "encode_bucket", "shard_payload", "owner_payload", "TernaryStage"]
