"""The requantized exchange's second stage: an owner's exact average sent as 4-bit groups, and the noise estimate
Adam needs as one stochastic bit per element.  Reference math, in torch ops on any device (fp32 division, floor
and comparisons are exact in IEEE arithmetic, so a CPU and a GPU produce the same bytes).  A backend with the
``REQUANT`` capability (the fused CPU one: kernels/terngrad_cpu.c, tg_requant_encode / tg_requant_decode) computes
``encode`` and ``decode`` in one pass each, the same bytes and bits (tests/test_requant_kernel.py); the exchange
(exchange/requantized.py) calls it where it has one.

Average (``quantize``).  Per group of ``GROUP`` = 128 consecutive elements of a shard, the step
Δ = max|a| / LEVELS (LEVELS = 7: codes -7..7, 15 levels in 4 bits) and, per element, q = a/Δ, f = q - floor(q):
the code is floor(q) + 1 with probability f, else floor(q).  Unbiased, E[code·Δ] = a, and the rounding's
variance is exactly Δ²·f·(1 - f) <= Δ²/4 = max|a|²/196 per element: what the owner knows, since it holds a.
Ternary re-rounding (the re-ternarized exchange) adds s'·|a| - a², up to max|a|²/4: 49x more at the worst.
Cost: 4 bits per element + one fp32 step per 128 elements = 4.25 bits.

Noise (``quantize_noise``).  What horovod_terngrad.optim subtracts from Adam's second moment is a running mean
over steps, so an *unbiased* per-step estimate is all it needs, not a precise one: per group, νmax = max ν and
each element's bit is 1 with probability ν/νmax; decoded bit·νmax, E = ν.  Cost 1 + 32/128 = 1.25 bits.  The
extra variance ν·(νmax - ν) averages out in the optimizer's running mean (its β2 window, 20-1000 steps).

Random streams: the key's tensor word is the tensor name's with ``AVERAGE_SUFFIX`` or ``NOISE_SUFFIX``, its rank
word the owner's, its element word the element's index in the whole tensor; none is a stream of the first stage.

Payload of one shard of m elements (``sizes.requantized_owner_bytes``): 8 header bytes (``MAGIC``, the flag byte
at 3 as in every TernGrad payload, m as uint32 little-endian at 4), G = ceil(m/128) fp32 steps, ceil(m/2) code
bytes (two codes per byte, code + 7 in [0, 14], low nibble first); with noise, G fp32 νmax and ceil(m/8) bytes
of bits (least significant first); zeros up to a multiple of 4 bytes.
"""
from __future__ import annotations

import struct

import torch

from . import sizes
from .packing import device_constant
from .rng import stream_key, tensor_id, uniform24

GROUP = sizes.REQUANT_GROUP
LEVELS = 7
MAGIC = b"RQ4"
HEADER = sizes.REQUANT_HEADER_BYTES
AVERAGE_SUFFIX = "#rq4"
NOISE_SUFFIX = "#rq4noise"
FLAG_NOISE = 0x02          # header byte 3: the payload carries the noise channel (bit 0 is the NaN/Inf flag)
_TWO24 = float(1 << 24)


def keys(seed: int, step: int, name: str, owner_rank: int) -> tuple:
    """The owner's two stream keys of one tensor: (average, noise)."""
    return (stream_key(seed, step, tensor_id(name + AVERAGE_SUFFIX), owner_rank),
            stream_key(seed, step, tensor_id(name + NOISE_SUFFIX), owner_rank))


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """[G, GROUP] view of x padded with zeros to whole groups."""
    m = x.numel()
    g = sizes.requant_groups(m)
    if g * GROUP == m:
        return x.view(g, GROUP)
    out = torch.zeros(g * GROUP, dtype=x.dtype, device=x.device)
    out[:m] = x
    return out.view(g, GROUP)


def _uniform(key, start: int, m: int, device) -> torch.Tensor:
    return uniform24(key, start, m, device).to(torch.float32)


def quantize(a: torch.Tensor, key, start: int) -> tuple:
    """(steps [G] fp32, codes [m] int8 in -7..7, variance [m] fp32) of the fp32 shard ``a`` (elements
    start .. start+m-1 of its tensor); variance is the rounding's own, Δ²·f·(1 - f)."""
    m = a.numel()
    # divided by a 0-d tensor on a's device, not by the Python number: CUDA turns division by a scalar into a
    # multiplication by its reciprocal (other bits than the CPU's true division)
    steps = _grouped(a.abs()).amax(dim=1) / torch.full((), LEVELS, dtype=torch.float32, device=a.device)
    delta = steps.repeat_interleave(GROUP)[:m] if m else steps
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    q = torch.where(delta > 0, a / safe, torch.zeros_like(a)).clamp_(-LEVELS, LEVELS)
    low = torch.floor(q)
    frac = q - low
    up = _uniform(key, start, m, a.device) < frac * _TWO24
    codes = (low + up.to(torch.float32)).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return steps, codes, delta * delta * frac * (1 - frac)


def quantize_noise(nu: torch.Tensor, key, start: int) -> tuple:
    """(νmax [G] fp32, bits [m] bool): one unbiased stochastic bit per element of the non-negative ``nu``."""
    m = nu.numel()
    top = _grouped(nu).amax(dim=1)
    full = top.repeat_interleave(GROUP)[:m] if m else top
    safe = torch.where(full > 0, full, torch.ones_like(full))
    p = torch.where(full > 0, nu / safe, torch.zeros_like(nu))
    return top, _uniform(key, start, m, nu.device) < p * _TWO24


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    u = (codes.to(torch.int16) + LEVELS).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, torch.full((1,), LEVELS, dtype=torch.uint8, device=u.device)])
    u = u.view(-1, 2)
    return u[:, 0] | (u[:, 1] << 4)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    m = bits.numel()
    b = torch.zeros(-(-m // 8) * 8, dtype=torch.uint8, device=bits.device)
    b[:m] = bits.to(torch.uint8)
    weights = device_constant((1, 2, 4, 8, 16, 32, 64, 128), torch.uint8, bits.device)
    return (b.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _f32_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous().view(torch.uint8)


def encode(a: torch.Tensor, keys_: tuple, start: int, noise: torch.Tensor | None = None,
           flags: int = 0) -> torch.Tensor:
    """The owner's payload of its fp32 shard ``a`` (elements start..start+m-1 of the tensor).  ``noise``: the
    first stage's noise estimate of the shard (fp32, >= 0), or None for no noise channel; the channel then carries
    it plus this rounding's own variance, so a rank's estimate covers both stages."""
    m = a.numel()
    steps, codes, variance = quantize(a, keys_[0], start)
    head = bytearray(MAGIC + bytes([flags | (FLAG_NOISE if noise is not None else 0)]) + struct.pack("<I", m))
    parts = [device_constant(bytes(head), torch.uint8, a.device), _f32_bytes(steps), _pack_nibbles(codes)]
    if noise is not None:
        top, bits = quantize_noise(noise + variance, keys_[1], start)
        parts += [_f32_bytes(top), _pack_bits(bits)]
    total = sizes.requantized_owner_bytes(m, noise is not None)
    out = torch.zeros(total, dtype=torch.uint8, device=a.device)
    at = 0
    for p in parts:
        out[at:at + p.numel()] = p
        at += p.numel()
    return out


def _f32_at(buf: torch.Tensor, at: int, count: int) -> torch.Tensor:
    return buf[at:at + 4 * count].clone().view(torch.float32)      # (a copy: gathered offsets need not be aligned)


def decode(buf: torch.Tensor, offset: int, m: int, with_noise: bool, out: torch.Tensor,
           noise_out: torch.Tensor | None = None) -> None:
    """Decode the owner's payload of m elements at ``offset`` of ``buf`` into ``out`` (and, if given and the
    payload carries it, its noise channel into ``noise_out``).  Every rank decodes the same bytes."""
    g = sizes.requant_groups(m)
    at = offset + HEADER
    steps = _f32_at(buf, at, g)
    at += 4 * g
    packed = buf[at:at + -(-m // 2)]
    at += packed.numel()
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:m].to(torch.float32) - LEVELS
    torch.mul(codes, steps.repeat_interleave(GROUP)[:m], out=out)
    if with_noise and noise_out is not None:
        top = _f32_at(buf, at, g)
        at += 4 * g
        bytes_ = buf[at:at + -(-m // 8)]
        shifts = torch.arange(8, dtype=torch.uint8, device=buf.device)
        bits = ((bytes_.unsqueeze(1) >> shifts) & 1).reshape(-1)[:m].to(torch.float32)
        torch.mul(bits, top.repeat_interleave(GROUP)[:m], out=noise_out)


def read_header(buf: torch.Tensor, offset: int, what: str) -> tuple:
    """(m, flags) of an owner's payload on the host; ValueError naming ``what`` if it is not one."""
    head = bytes(buf[offset:offset + HEADER].tolist())
    if head[:3] != MAGIC:
        raise ValueError(f"TernGrad: {what} is not a requantized owner payload (magic {head[:3]!r})")
    return struct.unpack("<I", head[4:8])[0], head[3]


__all__ = ["GROUP", "LEVELS", "MAGIC", "FLAG_NOISE", "keys", "quantize", "quantize_noise", "encode", "decode",
           "read_header"]
