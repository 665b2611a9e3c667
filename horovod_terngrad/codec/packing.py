"""Wire format: self-describing payloads of packed ternary vectors, and their decoding.

Element codes: 0 for t = 0, 1 for t = +1, 2 for t = -1 (so zero padding decodes to zeros).

* ``2bit``:  4 codes per byte, code q of a group in bits 2q..2q+1 (2 bits per element).
* ``base3``: 5 codes per byte as the base-3 number Σ code_q·3^q <= 242 (1.6 bits per element;
  the information limit is log2(3) = 1.585).

Payload (little-endian, uint8):

    offset  size  field
    0       1     magic 0x54 ('T')
    1       1     version (1)
    2       1     format (1 = 2bit, 2 = base3; 3 = 4level: codec/levels.py's four-level codes, 2bit's layout)
    3       1     flags (bit 0: the sender's tensor held NaN/Inf; its codes are then all zero;
                        bit 1: a 4-byte squares trailer follows the codes, codec/squares.py)
    4       4     bucket size k (uint32; 0 = one scaler for the whole tensor)
    8       8     element count n (uint64)
    16      4     shape code (uint32, CRC-32 of the tensor's shape; lets receivers check agreement)
    20      4·B   scalers, fp32, B = 1 or ceil(n/k)
    20+4B   ...   packed codes, ceil(n/4) or ceil(n/5) bytes
    ...     4     with flag bit 1: the sender's Σ f(g_i)² over the payload's elements, fp32 (codec/squares.py)

Decoding N payloads gives the average in fp32, by one of two exactly specified formulas, so every rank
and every device gets the same bits:

* all payloads carry the same scalers (the shared scaler of Eq. 4):  out = (float(k)·s) / N  with
  k = Σ_i t_i the exact integer count (one rounding for the product, one for the division);
* otherwise:  out = (Σ_{i=0..N-1} s_i·t_i) / N, summed in fp32 in payload (rank) order.
"""
from __future__ import annotations

from dataclasses import dataclass

import zlib

import torch

from .ternary import expand_scalers
from .sizes import CODES_PER_BYTE, FORMATS, PACKINGS, HEADER_BYTES, codes_offset, num_buckets, packed_size, payload_size

MAGIC = 0x54
VERSION = 1
FORMAT_NAMES = {v: k for k, v in FORMATS.items()}
FLAG_NONFINITE = 1
FLAG_SQUARES = 2                       #: a squares trailer follows the codes
FOUR_LEVEL_VALUES = (-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0)   #: the ``4level`` format's code -> value / s (codec/levels.py)


class PayloadError(ValueError):
    """A payload that is not a TernGrad payload, or disagrees with the others."""


@dataclass(frozen=True)
class Header:
    fmt: str
    flags: int
    bucket_size: int
    numel: int
    shape_code: int = 0

    @property
    def num_scalers(self) -> int:
        return num_buckets(self.numel, self.bucket_size)

    @property
    def packed_bytes(self) -> int:
        return packed_size(self.numel, self.fmt)

    @property
    def total_bytes(self) -> int:
        return payload_size(self.numel, self.fmt, self.bucket_size, bool(self.flags & FLAG_SQUARES))


def _codes(t: torch.Tensor) -> torch.Tensor:
    # t in {-1,0,1} (int8) -> code in {2,0,1} (uint8): (t mod 3) maps -1 -> 2.
    return torch.remainder(t.to(torch.int16), 3).to(torch.uint8)


def pack(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """Pack a flat int8 ternary vector into uint8 codes of the given format."""
    if fmt not in PACKINGS:
        raise ValueError(f"unknown ternary packing {fmt!r}; choose one of {list(PACKINGS)}")
    return pack_codes(_codes(t), fmt)


def pack_codes(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Pack a flat uint8 vector of codes into the format's bytes: four 2-bit codes per byte, code q of a group in
    bits 2q..2q+1 ("2bit", and the four-level code's "4level"), or five base-3 digits per byte ("base3")."""
    per = CODES_PER_BYTE[fmt]
    n = codes.numel()
    nbytes = packed_size(n, fmt)
    full = torch.zeros(nbytes * per, dtype=torch.uint8, device=codes.device)
    full[:n] = codes
    full = full.view(nbytes, per)
    if fmt == "base3":
        c = full.to(torch.int16)
        return (c[:, 0] + 3 * c[:, 1] + 9 * c[:, 2] + 27 * c[:, 3] + 81 * c[:, 4]).to(torch.uint8)
    return full[:, 0] | (full[:, 1] << 2) | (full[:, 2] << 4) | (full[:, 3] << 6)


_LUT_CACHE: dict = {}


def _lut(fmt: str, device) -> torch.Tensor:
    """[256, per] float32 table: byte -> the values of its codes (ternary, or the four levels / s)."""
    key = (fmt, str(device))
    lut = _LUT_CACHE.get(key)
    if lut is None:
        per = CODES_PER_BYTE[fmt]
        b = torch.arange(256, dtype=torch.int64)
        if fmt == "base3":
            codes = torch.stack([(b // 3 ** q) % 3 for q in range(per)], dim=1)
        else:
            codes = torch.stack([(b >> (2 * q)) & 3 for q in range(per)], dim=1)
        # code 3 never appears in valid 2bit data; the four-level code's values are codec/levels.py's
        value = torch.tensor(FOUR_LEVEL_VALUES if fmt == "4level" else [0.0, 1.0, -1.0, 0.0])
        lut = value[codes].to(torch.float32).to(device)
        _LUT_CACHE[key] = lut
    return lut


def unpack(packed: torch.Tensor, numel: int, fmt: str) -> torch.Tensor:
    """Inverse of ``pack`` as fp32 values in {-1, 0, 1} (or the four levels / s of a ``4level`` payload)."""
    return _lut(fmt, packed.device)[packed.long()].reshape(-1)[:numel]


def shape_code(shape) -> int:
    """CRC-32 of a shape, the same in every process."""
    return zlib.crc32(repr(tuple(shape)).encode())


def encode(t: torch.Tensor, fmt: str, scalers: torch.Tensor, bucket_size: int,
           flags: int = 0, shape=None) -> torch.Tensor:
    """Build one payload from a ternary vector: header, fp32 scalers, packed codes."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown packing format {fmt!r}; choose one of {sorted(FORMATS)}")
    return assemble(pack(t, fmt), t.numel(), fmt, scalers, bucket_size, flags,
                    t.shape if shape is None else shape)


def header_bytes(n: int, fmt: str, bucket_size: int, flags: int = 0, shape=None) -> bytes:
    head = bytearray(HEADER_BYTES)
    head[0], head[1], head[2], head[3] = MAGIC, VERSION, FORMATS[fmt], flags
    head[4:8] = int(max(bucket_size, 0)).to_bytes(4, "little")
    head[8:16] = int(n).to_bytes(8, "little")
    head[16:20] = shape_code((n,) if shape is None else shape).to_bytes(4, "little")
    return bytes(head)


_CONSTANTS: dict = {}
_MAX_CONSTANTS = 16384


def device_constant(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A small tensor of host-known values (a header's bytes, payload offsets) on ``device``, made once per
    (values, dtype, device) and shared: callers must never write to it.  Why: on a GPU, a tensor built from host
    memory each time is a copy from pageable memory, which makes the host wait for the device; one per tensor per
    step stalls the whole backward pass (torch.cuda.set_sync_debug_mode flags it; tests/test_cuda_nosync.py).
    The values of a given exchange repeat every step, so after the first step no copy is left.  ``values``: bytes
    (read as uint8) or a sequence of numbers."""
    device = torch.device(device)
    key = (values if isinstance(values, bytes) else tuple(values), dtype, device)
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) >= _MAX_CONSTANTS:      # a bound, not an LRU: shapes that change every step are rare
            _CONSTANTS.clear()
        if isinstance(values, bytes):
            t = torch.frombuffer(bytearray(values), dtype=torch.uint8).to(dtype)
        else:
            t = torch.tensor(key[0], dtype=dtype)
        t = _CONSTANTS[key] = t.to(device)
    return t


def header_tensor(n: int, fmt: str, bucket_size: int, device, flags: int = 0, shape=None) -> torch.Tensor:
    """``header_bytes`` as a shared uint8 tensor on ``device`` (``device_constant``: never write to it)."""
    return device_constant(header_bytes(n, fmt, bucket_size, flags, shape), torch.uint8, device)


def new_payload(n: int, fmt: str, scalers: torch.Tensor, bucket_size: int, flags: int = 0,
                shape=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A payload with header and scalers written, and the view of its packed-code region to fill."""
    nb = scalers.numel()
    total = codes_offset(nb) + packed_size(n, fmt)
    payload = torch.empty(total, dtype=torch.uint8, device=scalers.device)
    payload[:HEADER_BYTES] = header_tensor(n, fmt, bucket_size, scalers.device, flags, shape)
    payload[HEADER_BYTES:codes_offset(nb)] = scalers.to(torch.float32).contiguous().view(torch.uint8)
    return payload, payload[codes_offset(nb):]


def assemble(packed: torch.Tensor, n: int, fmt: str, scalers: torch.Tensor, bucket_size: int,
             flags: int = 0, shape=None) -> torch.Tensor:
    """Build one payload from already packed codes."""
    payload, region = new_payload(n, fmt, scalers.to(packed.device), bucket_size, flags, shape)
    region.copy_(packed)
    return payload


def _parse_head(head: bytes, what: str) -> Header:
    if head[0] != MAGIC or head[1] != VERSION or head[2] not in FORMAT_NAMES:
        raise PayloadError(f"{what}: bad magic/version/format bytes {list(head[:3])}")
    return Header(fmt=FORMAT_NAMES[head[2]], flags=head[3],
                  bucket_size=int.from_bytes(head[4:8], "little"),
                  numel=int.from_bytes(head[8:16], "little"),
                  shape_code=int.from_bytes(head[16:20], "little"))


def walk(buf: torch.Tensor, count: int, what: str = "payloads", batched: bool | None = None,
         period: list | None = None) -> tuple[list, list]:
    """Headers and byte offsets of ``count`` payloads laid end to end in ``buf`` (an allgather result).

    On the CPU the headers are read in place.  On a device the headers are fetched together (one copy
    to the host) at the offsets a guessed layout gives: ``period``, the byte sizes of the payloads one
    rank sent (a fused group's members; default: ``count`` payloads of equal size, the same tensor on
    every rank), repeated for every rank.  Only if that guess fails is the buffer walked header by
    header.  ``batched`` forces the device strategy (tests use it on CPU tensors).
    """
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise PayloadError(f"{what}: need a 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    if batched is None:
        batched = buf.device.type != "cpu"
    if not batched:
        raw = memoryview(buf.numpy())
        return _walk(lambda off: bytes(raw[off:off + HEADER_BYTES]), buf.numel(), count, what)
    guess = _guess_offsets(buf.numel(), count, period)
    if guess is not None and count > 1:
        # the one read on the host is the headers' bytes; their offsets repeat each step (a cached constant)
        idx = device_constant(guess, torch.int64, buf.device)[:, None] + torch.arange(HEADER_BYTES, device=buf.device)
        heads = buf[idx].cpu().numpy().tobytes()
        at = {off: heads[i * HEADER_BYTES:(i + 1) * HEADER_BYTES] for i, off in enumerate(guess)}
        try:
            return _walk(lambda off: at.get(off, b""), buf.numel(), count, what)
        except PayloadError:
            pass
    return _walk(lambda off: bytes(buf[off:off + HEADER_BYTES].cpu().tolist()), buf.numel(), count, what)


def _guess_offsets(total: int, count: int, period: list | None) -> list | None:
    if period is None:
        if count < 1 or total % count or total < HEADER_BYTES:
            return None
        period = [total // count]
    if not period or count % len(period) or sum(period) * (count // len(period)) != total:
        return None
    offsets, off = [], 0
    for _ in range(count // len(period)):
        for size in period:
            offsets.append(off)
            off += size
    return offsets


def _walk(head_at, total: int, count: int, what: str) -> tuple[list, list]:
    headers, offsets, off = [], [], 0
    for r in range(count):
        if total - off < HEADER_BYTES:
            raise PayloadError(f"{what}: ends at byte {off}, inside the header of payload {r}")
        head = head_at(off)
        if len(head) != HEADER_BYTES:
            raise PayloadError(f"{what}: payload {r} does not start where the guessed layout expects")
        h = _parse_head(head, f"{what}, payload {r}")
        if off + h.total_bytes > total:
            raise PayloadError(f"{what}: ends inside payload {r}")
        headers.append(h)
        offsets.append(off)
        off += h.total_bytes
    if off != total:
        raise PayloadError(f"{what}: {total - off} bytes left over after {count} payloads")
    return headers, offsets


def read_header(buf: torch.Tensor, offset: int = 0, what: str = "payload") -> Header:
    """Parse the 20-byte header at ``offset`` of a 1-D uint8 tensor (the rest is not checked)."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() - offset < HEADER_BYTES:
        raise PayloadError(f"{what}: not a TernGrad payload (need a 1-D uint8 tensor with >= "
                           f"{HEADER_BYTES} bytes at offset {offset}, got {buf.dtype} {tuple(buf.shape)})")
    return _parse_head(bytes(buf[offset:offset + HEADER_BYTES].cpu().tolist()), what)


def parse_header(payload: torch.Tensor, what: str = "payload") -> Header:
    """Parse and check the header of one whole payload."""
    h = read_header(payload, 0, what)
    if payload.numel() != h.total_bytes:
        raise PayloadError(f"{what}: {payload.numel()} bytes but its header describes {h.total_bytes}")
    return h


def split(payload: torch.Tensor, h: Header) -> tuple[torch.Tensor, torch.Tensor]:
    """(scalers fp32 [B], packed codes uint8) views of a payload whose header is ``h``."""
    nb = h.num_scalers
    scalers = payload[HEADER_BYTES:codes_offset(nb)].clone().view(torch.float32)
    return scalers, payload[codes_offset(nb):codes_offset(nb) + h.packed_bytes]


def decode_sums(k: torch.Tensor, scalers: torch.Tensor, bucket_size: int, divisor: float) -> torch.Tensor:
    """(float(k)·s) / divisor: the average from per-element sums k of ternary values under one shared
    scaler (one rounding, then the division); every exchange decodes a shared scaler this way."""
    return (k.to(torch.float32) * expand_scalers(scalers, bucket_size, k.numel())) / float(divisor)


def average_packed(packed: list, scalers: list, numel: int, fmt: str, bucket_size: int,
                   divisor: float) -> torch.Tensor:
    """Reference decode of N packed code arrays with their fp32 scalers (see module docstring)."""
    dev = packed[0].device
    if fmt in PACKINGS and all(torch.equal(s, scalers[0]) for s in scalers[1:]):
        k = torch.zeros(numel, dtype=torch.int32, device=dev)
        for p in packed:
            k += unpack(p, numel, fmt).to(torch.int32)
        return decode_sums(k, scalers[0], bucket_size, divisor)
    acc = torch.zeros(numel, dtype=torch.float32, device=dev)
    for p, s in zip(packed, scalers):
        acc += unpack(p, numel, fmt) * expand_scalers(s, bucket_size, numel)
    return acc / float(divisor)


def decode_average(payloads: list[torch.Tensor], headers: list[Header] | None = None,
                   divisor: int | None = None) -> torch.Tensor:
    """The average of whole payloads (checked to agree), dividing by ``divisor`` (default N)."""
    if not payloads:
        raise PayloadError("decode_average needs at least one payload")
    if headers is None:
        headers = [parse_header(p, f"payload {i}") for i, p in enumerate(payloads)]
    h0 = headers[0]
    for i, h in enumerate(headers[1:], 1):
        if (h.numel, h.bucket_size, h.fmt) != (h0.numel, h0.bucket_size, h0.fmt):
            raise PayloadError(f"payload {i} has {h.numel} elements ({h.fmt}, buckets of {h.bucket_size}), "
                               f"payload 0 has {h0.numel} ({h0.fmt}, buckets of {h0.bucket_size})")
    parts = [split(p, h) for p, h in zip(payloads, headers)]
    return average_packed([c for _, c in parts], [s for s, _ in parts], h0.numel, h0.fmt, h0.bucket_size,
                          divisor if divisor is not None else len(payloads))
