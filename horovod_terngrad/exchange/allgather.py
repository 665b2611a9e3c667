"""The allgather transport: every rank receives every rank's payloads and decodes the average.

A group's payload is its members' payloads (header, scalers, codes) back to back; one allgather carries
every rank's, so rank r's block is the members' payloads in member order.  Decode: the walk of the
headers (checked to agree: element count, shape, packing, buckets; NaN/Inf flags with per-rank scalers),
then the backend's decode of the member's N payloads: (float(k)·s)/N with a shared scaler, else
(Σ_r s_r·t_r)/N in fp32 in rank order.  Every rank decodes the same bytes in the same order, so all get
identical bits.  Cost per rank and tensor: sends payload_size(n) bytes, receives N-1 times that (4 more per
payload where the optimizer asked for the noise estimate: the sender's squares, codec/squares.py).
"""
from __future__ import annotations

import time

import torch

from .. import backends, codec
from ..errors import NonFiniteGradientError, RankMismatchError, TernGradError
from .collectives import CollectiveError


def send(ex, grp, sends: list) -> None:
    """Allgather the payloads ``[(ticket, payload), ...]`` of a group."""
    for tk, payload in sends:
        tk.payload_bytes = payload.numel()
    data = sends[0][1] if len(sends) == 1 else torch.cat([p for _, p in sends])
    launch(ex, grp, [tk for tk, _ in sends], data, f"terngrad.ag.{grp.name}")


def launch(ex, grp, members: list, data: torch.Tensor, name: str, sizes=None) -> None:
    """Start the group's allgather of ``data`` (the payloads, or a sharded group's owners' sums).  ``sizes``:
    every rank's length when they differ and the caller knows them (handed to collectives that take them)."""
    for j, tk in enumerate(members):
        tk.slot = j
    grp.sent = members
    grp.bytes_sent = data.numel()
    ex.stats.payload_bytes_sent += data.numel()
    if sizes is not None and getattr(ex.coll, "takes_sizes", False):
        grp.ag = ex.coll.allgather_async(data, name, sizes=sizes)
    else:
        grp.ag = ex.coll.allgather_async(data, name)
    ex.stats.collectives += 1


def collected(ex, tk, own_bytes: int, context: str = "") -> torch.Tensor:
    """The result of the group's payload collective (``grp.ag``: this allgather, or the join transport's
    allreduce), waited for once by whichever member finishes first.  ``own_bytes`` of it are not counted as
    received.  A failure raises the collective's own error class, naming the gradient (``context`` after it)."""
    grp = tk.group
    if grp.gathered is None and grp.gather_error is None:
        t0 = time.perf_counter()
        try:
            grp.gathered = ex.coll.synchronize(grp.ag)
            ex.stats.bytes_received += grp.gathered.numel() * grp.gathered.element_size() - own_bytes
        except CollectiveError as e:
            grp.gather_error = e
        finally:
            ex.stats.gather_wait_s += time.perf_counter() - t0
    if grp.gather_error is not None:
        raise grp.gather_error.detailed(f"TernGrad: exchange of gradient '{tk.name}'{context}"
                                        + (f" (fused in group '{grp.name}')" if grp.fused else "") + " failed")
    return grp.gathered


# tests set this to run the accelerator's path (flags decided on the device, nothing read on the host) on CPU
# tensors: the same tensor ops, so a CPU-only CI covers it
DEVICE_PATH_ON_CPU = False


def on_device(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the accelerator's path (``DEVICE_PATH_ON_CPU``: also a CPU tensor)."""
    return DEVICE_PATH_ON_CPU or t.device.type != "cpu"


def gathered(ex, tk) -> torch.Tensor:
    """The group's allgather result."""
    return collected(ex, tk, tk.group.bytes_sent)


def receive(ex, tk) -> torch.Tensor | None:
    """The average of one member, or None when it is zeroed (NaN/Inf with on_nonfinite='zero')."""
    buf = gathered(ex, tk)
    if ex.layout_known:
        return receive_known_layout(ex, tk, buf)
    t0 = time.perf_counter()
    grp, N = tk.group, ex.coll.size
    m = len(grp.sent)
    if grp.walked is None:
        try:
            grp.walked = codec.packing.walk(buf, N * m, f"gathered payloads of '{grp.name}'",
                                            period=[t.payload_bytes for t in grp.sent])
        except codec.PayloadError as e:
            raise TernGradError(f"TernGrad: {e}") from e
    headers, offsets = grp.walked[0][tk.slot::m], grp.walked[1][tk.slot::m]
    if any(h.numel != tk.source.numel() for h in headers):
        raise RankMismatchError(
            f"TernGrad: ranks disagree on gradient '{tk.name}': element counts "
            f"{[h.numel for h in headers]} by rank")
    if len({h.shape_code for h in headers}) != 1:
        raise RankMismatchError(
            f"TernGrad: ranks disagree on gradient '{tk.name}': shapes differ (this rank "
            f"{ex.coll.rank}: {tuple(tk.shape)})")
    if len({(h.fmt, h.bucket_size) for h in headers}) != 1:
        raise RankMismatchError(f"TernGrad: ranks use different packing or bucket settings for '{tk.name}': "
                                f"{[(h.fmt, h.bucket_size) for h in headers]}")
    bad = [r for r, h in enumerate(headers) if h.flags & codec.packing.FLAG_NONFINITE]
    if bad:
        ex.nonfinite(tk, NonFiniteGradientError.describe(tk.name, tk.shape, bad[0], bad[-1]))
        if tk.error is not None:
            raise tk.error
        return None
    out = backends.for_device(buf.device).decode(buf, headers, offsets, len(headers) if tk.average else 1,
                                                 out=tk.g32 if tk.in_place else None)
    if tk.want_noise:
        divisor = len(headers) if tk.average else 1
        tk.noise = noise_estimate(buf, headers, offsets, divisor, out=tk.noise_out)
        if all(h.flags & codec.packing.FLAG_SQUARES for h in headers):
            ends = [o + h.total_bytes for h, o in zip(headers, offsets)]
            codec.squares.take_out_minibatch_share(tk.noise, codec.squares.read(buf, ends), divisor)
    ex.stats.codec_s += time.perf_counter() - t0
    return out


def receive_known_layout(ex, tk, buf: torch.Tensor) -> torch.Tensor | None:
    """``receive`` without reading the gathered headers on the host, for a caller that guarantees every rank
    sends the same members with the same sizes and settings (``Engine.layout_known``; the FSDP frontend checks
    it once, at ``register``, the DDP frontend at its first bucket).  Offsets follow from this rank's own payload
    sizes; the decode reads the scalers on the device; the senders' NaN/Inf flags (header byte 3) are combined on
    the device, and a flagged member's average is filled with NaN ("propagate", or "raise" where the caller reads
    the result: ``Engine.nonfinite_on_device``) or zero ("zero") there: no host synchronization on a GPU.  On the
    CPU the flags are read first, for free, and the policy applied as the header walk applies it."""
    t0 = time.perf_counter()
    grp, N = tk.group, ex.coll.size
    period = [t.payload_bytes for t in grp.sent]
    block = sum(period)
    if buf.numel() != N * block:
        raise RankMismatchError(f"TernGrad: gathered payloads of '{grp.name}' hold {buf.numel()} bytes, not "
                                f"{N} x {block}: ranks disagree on gradient '{tk.name}' or its settings")
    first = sum(period[:tk.slot])
    offsets = [r * block + first for r in range(N)]
    cfg = ex.config
    n = tk.source.numel()
    header = codec.packing.Header(cfg.packing, 0, tk.bucket, n)
    flags = buf[codec.packing.device_constant([o + 3 for o in offsets], torch.int64, buf.device)]
    flagged = (flags & codec.packing.FLAG_NONFINITE).ne(0)
    if not on_device(buf):
        if bool(flagged.any()):      # free on the host: the walk's outcome, its policy, stats and warning
            ranks = flagged.nonzero().flatten().tolist()
            ex.nonfinite(tk, NonFiniteGradientError.describe(tk.name, tk.shape, ranks[0], ranks[-1]))
            if tk.error is not None:
                raise tk.error
            return None
        bad = None
    else:
        if cfg.on_nonfinite == "raise" and not ex.nonfinite_on_device:
            raise TernGradError("TernGrad: on_nonfinite='raise' needs the headers on the host; "
                                "Engine.layout_known does not read them")
        bad = flagged.any()
    out = backends.for_device(buf.device).decode(buf, [header] * N, offsets, N if tk.average else 1,
                                                 out=tk.g32 if tk.in_place else None)
    if bad is not None:
        out.masked_fill_(bad, 0.0 if cfg.on_nonfinite == "zero" else float("nan"))
    if tk.want_noise:
        tk.noise = noise_estimate(buf, [header] * N, offsets, N if tk.average else 1, out=tk.noise_out)
        own = period[tk.slot]                        # this member's payload, the squares trailer included
        if own > header.total_bytes:                 # every rank's carries one (the layout is every rank's)
            codec.squares.take_out_minibatch_share(
                tk.noise, codec.squares.read(buf, [o + own for o in offsets]), N if tk.average else 1)
        if bad is not None:
            tk.noise.masked_fill_(bad, 0.0)
    ex.stats.codec_s += time.perf_counter() - t0
    return out


def noise_estimate(buf: torch.Tensor, headers: list, offsets: list, divisor: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Per element, (1/divisor^2)·Σ_r (s_r·t_r)^2 = (1/divisor^2)·Σ_r s_r^2·|t_r| from every rank's payload: an
    unbiased estimate of (1/N^2)·Σ_r s_r·|g_r|, which bounds the variance the ternary rounding adds to the average
    (it exceeds it by (1/N^2)·Σ_r g_r^2; the callers take that share out with the senders' squares,
    codec/squares.py).  horovod_terngrad.optim subtracts its running mean from Adam's second moment.

    How: each payload is copied with its scalers squared and its codes mapped to |t| (2-bit: two bit operations on
    the packed bytes in place; base-3: a 256-entry table), and the backend's own decode (fused C, CUDA or the reference) averages those with divisor^2:
    one more decode of the member, no host synchronization, the same bits on every backend.  A backend with
    the ``NOISE_DECODE`` capability (the fused CPU one) does the same in its decode's own pass over the
    gathered payloads, without the copies.  Four-level payloads (codec/levels.py) give (1/divisor^2)·Σ_r
    (s_r·V_r)^2 the same way (``levels.decode_average(squares=True)`` where the backend has no such pass): E[q²] =
    c² + Var(q) there too, though with stratified dithers the average's variance is below the sum of the ranks'."""
    backend = backends.for_device(buf.device)
    if backends.has_capability(backend, backends.NOISE_DECODE):
        return backend.decode_noise(buf, headers, offsets, divisor, out=out)
    if headers[0].fmt == codec.sizes.FOUR_LEVEL:      # its squares are not codes of the format: the reference's sum
        return codec.levels.decode_average(buf, headers, offsets, float(divisor) ** 2, squares=True, out=out)
    parts, moved, at = [], [], 0
    lut = None if headers[0].fmt == "2bit" else _abs_codes(headers[0].fmt, buf.device)
    for h, o in zip(headers, offsets):
        payload = buf[o:o + h.total_bytes].clone()
        begin = codec.sizes.HEADER_BYTES
        end = codec.sizes.codes_offset(h.num_scalers)
        scalers = payload[begin:end].view(torch.float32)
        scalers.mul_(scalers)
        codes = payload[end:]
        if lut is None:       # 2-bit: a code's magnitude bit is (low | high) in place; no table, no int64 indices
            codes.bitwise_or_(codes >> 1).bitwise_and_(0x55)
        else:
            codes.copy_(lut[codes.long()])
        parts.append(payload)
        moved.append(at)
        at += h.total_bytes
    both = parts[0] if len(parts) == 1 else torch.cat(parts)
    return backend.decode(both, headers, moved, float(divisor) ** 2, out=out)


_ABS_CODES: dict = {}


def _abs_codes(fmt: str, device) -> torch.Tensor:
    """[256] uint8: a packed byte of ternary codes -> the byte of their magnitudes (codes 1 and 2, +1 and -1,
    become 1)."""
    key = (fmt, str(device))
    lut = _ABS_CODES.get(key)
    if lut is None:
        b = torch.arange(256, dtype=torch.int64)
        if fmt == "2bit":
            lut = (b | (b >> 1)) & 0x55
        else:
            lut = sum(((b // 3 ** q) % 3 != 0).to(torch.int64) * 3 ** q for q in range(codec.sizes.CODES_PER_BYTE[fmt]))
        lut = _ABS_CODES[key] = lut.to(torch.uint8).to(device)
    return lut
