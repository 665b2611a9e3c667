"""Every size on the wire, computed in one place (no torch: the performance model imports it too).

Payload of one tensor (codec/packing.py): a 20-byte header, one fp32 scaler per bucket, packed codes.
Handshake of one group (exchange/handshake.py): fp64 slots, allreduced with max.  Sharded exchange
(exchange/sharded.py): each rank owns a 20-aligned slice of every tensor; owners pack sums of N ternary
values in L bits.  The packing, the exchange, the simulator, the metrics, the performance model and the
timeline all read their sizes from here, so they cannot drift apart.
"""
from __future__ import annotations

import math

PACKINGS = ("2bit", "base3")              #: the ternary code's packings (TernGradConfig.packing)
#: format name -> format byte of the header: the ternary packings, and the four-level code (codec/levels.py)
FOUR_LEVEL = "4level"                      #: the four-level code's format name
FORMATS = {"2bit": 1, "base3": 2, FOUR_LEVEL: 3}
CODES_PER_BYTE = {"2bit": 4, "base3": 5, "4level": 4}
BITS_PER_CODE = {"2bit": 2.0, "base3": 1.6, "4level": 2.0}
HEADER_BYTES = 20                          #: payload header (magic, version, format, flags, k, n, shape)
SCALER_BYTES = 4                           #: one fp32 scaler
SQUARES_BYTES = 4                          #: a payload's trailer: the sender's Σ f(g)², fp32 (codec/squares.py)
SHARD_ALIGN = 20                           #: lcm of 4 and 5: shards start on a byte in both packings
SLOT_BYTES = 8                             #: one fp64 handshake slot
SINGLE_HANDSHAKE_FIXED = 8                 #: a lone tensor: bad rank, -bad, n, -n, shape, -shape, dtype, -dtype
FUSED_HANDSHAKE_FIXED = 4                  #: a fused group: layout code, -code, members, -members
FUSED_HANDSHAKE_PER_MEMBER = 2             #: ... then bad rank and -bad per member


def check_format(fmt: str) -> str:
    if fmt not in CODES_PER_BYTE:
        raise ValueError(f"packing must be one of {sorted(CODES_PER_BYTE)}, got {fmt!r}")
    return fmt


def num_buckets(numel: int, bucket_size: int) -> int:
    """Scalers per tensor: 1 for layer-wise ternarizing (bucket_size 0), else ceil(n / k)."""
    if bucket_size <= 0 or numel == 0:
        return 1
    return -(-numel // bucket_size)


def header_bucket(numel: int, bucket_size: int) -> int:
    """The bucket size a payload's header records for ``numel`` elements in buckets of ``bucket_size``: 0 where
    they make one bucket (one scaler, as layer-wise), so both give the same bytes."""
    return int(bucket_size) if num_buckets(numel, bucket_size) > 1 else 0


def packed_size(numel: int, fmt: str) -> int:
    """ceil(n / codes per byte): bytes of n packed ternary codes."""
    return -(-int(numel) // CODES_PER_BYTE[check_format(fmt)])


def payload_size(numel: int, fmt: str, bucket_size: int = 0, squares: bool = False) -> int:
    """One tensor's payload: header + fp32 scalers + packed codes (+ the squares trailer, where flagged)."""
    return codes_offset(num_buckets(numel, bucket_size)) + packed_size(numel, fmt) + (SQUARES_BYTES if squares else 0)


def codes_offset(num_scalers: int) -> int:
    """Byte offset of the packed codes in a payload with ``num_scalers`` scalers."""
    return HEADER_BYTES + SCALER_BYTES * num_scalers


def handshake_slots(scalers_per_member) -> int:
    """fp64 slots of a group's handshake, from each member's number of scalers: 8 + B for a lone
    tensor; 4 + 2 per member + every member's scalers for a fused group."""
    counts = list(scalers_per_member)
    if len(counts) == 1:
        return SINGLE_HANDSHAKE_FIXED + counts[0]
    return FUSED_HANDSHAKE_FIXED + FUSED_HANDSHAKE_PER_MEMBER * len(counts) + sum(counts)


def handshake_size(scalers_per_member) -> int:
    """Bytes of a group's handshake vector (0 for an empty group)."""
    counts = list(scalers_per_member)
    return SLOT_BYTES * handshake_slots(counts) if counts else 0


def sum_bits(n_ranks: int) -> int:
    """L = ceil(log2(2N + 1)): bits of one owner's sum k + N in [0, 2N]."""
    if n_ranks < 1:
        raise ValueError("n_ranks must be >= 1")
    return max(1, math.ceil(math.log2(2 * n_ranks + 1)))


def shard_bounds(numel: int, n_ranks: int) -> list[tuple[int, int]]:
    """[lo, hi) of the elements each rank owns: ceil(n/N) rounded up to a multiple of SHARD_ALIGN;
    trailing shards may be short or empty."""
    size = -(-numel // n_ranks) if numel else 0
    size = -(-size // SHARD_ALIGN) * SHARD_ALIGN
    return [(min(r * size, numel), min((r + 1) * size, numel)) for r in range(n_ranks)]


def code_byte_range(lo: int, hi: int, fmt: str) -> tuple[int, int]:
    """Bytes of the packed codes that hold elements [lo, hi) (lo is a shard start: byte aligned)."""
    per = CODES_PER_BYTE[check_format(fmt)]
    if hi <= lo:
        return -(-lo // per), -(-lo // per)   # an empty shard (past the end): no bytes
    return lo // per, -(-hi // per)


def shard_code_bytes(numel: int, n_ranks: int, fmt: str) -> list[int]:
    """Bytes of each rank's shard of one tensor's packed codes (what the alltoall sends it)."""
    return [b1 - b0 for b0, b1 in (code_byte_range(lo, hi, fmt) for lo, hi in shard_bounds(numel, n_ranks))]


def sums_size(count: int, n_ranks: int) -> int:
    """Bytes of ``count`` owners' sums packed in L bits."""
    return -(-count * sum_bits(n_ranks) // 8)


def shard_sum_bytes(numel: int, n_ranks: int) -> list[int]:
    """Bytes of each owner's packed sums of one tensor (what it adds to the allgather)."""
    return [sums_size(hi - lo, n_ranks) for lo, hi in shard_bounds(numel, n_ranks)]


__all__ = ["FORMATS", "CODES_PER_BYTE", "BITS_PER_CODE", "HEADER_BYTES", "SCALER_BYTES", "SQUARES_BYTES", "SHARD_ALIGN",
           "SLOT_BYTES", "check_format", "num_buckets", "header_bucket", "packed_size", "payload_size", "codes_offset", "handshake_slots",
           "handshake_size", "sum_bits", "shard_bounds", "code_byte_range", "shard_code_bytes", "sums_size",
           "shard_sum_bytes", "reternarized_shard", "reternarized_bounds", "reternarized_encode_bucket",
           "reternarized_chunk_bytes", "REQUANT_GROUP", "REQUANT_HEADER_BYTES", "requant_groups",
           "requantized_owner_bytes", "requantized_owner_chunk_bytes", "owner_step_weight_chunk_bytes"]


# -- the re-ternarized exchange (exchange/reternarized.py) ------------------------------------------------------
def reternarized_shard(numel: int, n_ranks: int, bucket_size: int = 0) -> int:
    """Elements per owner in the re-ternarized exchange: ceil(n/N) rounded up to a multiple of SHARD_ALIGN and,
    with buckets, of the bucket size (so every shard holds whole buckets and starts on a byte)."""
    align = SHARD_ALIGN if bucket_size <= 0 else math.lcm(SHARD_ALIGN, int(bucket_size))
    size = -(-numel // n_ranks) if numel else 0
    return -(-size // align) * align


def reternarized_bounds(numel: int, n_ranks: int, bucket_size: int = 0) -> list[tuple[int, int]]:
    """[lo, hi) of the elements each rank owns in the re-ternarized exchange; trailing shards may be short or
    empty."""
    size = reternarized_shard(numel, n_ranks, bucket_size)
    return [(min(r * size, numel), min((r + 1) * size, numel)) for r in range(n_ranks)]


def reternarized_encode_bucket(numel: int, n_ranks: int, bucket_size: int = 0) -> int:
    """The bucket size a rank ternarizes its whole gradient with in the re-ternarized exchange: the user's
    buckets, else one bucket per shard (each shard's payload then carries one scaler of its own)."""
    if bucket_size > 0:
        return int(bucket_size)
    return max(reternarized_shard(numel, n_ranks, 0), 1)


def reternarized_chunk_bytes(numel: int, n_ranks: int, fmt: str, bucket_size: int = 0,
                             squares: bool = False) -> list[int]:
    """Bytes of the payload of each shard of one tensor: what a rank sends each owner in the alltoall, and what
    each owner adds to the allgather (header, the shard's scalers, its packed codes: the same size both ways;
    ``squares``: the alltoall's shards carry the sender's squares trailer, codec/squares.py).  An empty shard (past the end of a tensor smaller than N shards) travels as nothing: every rank knows from
    the sizes which are empty.  Why: a header and a scaler (24 bytes) per empty shard and member were most of
    the bytes of small tensors at large N (a 4096-element tensor among 512 ranks: 7 shards of 640 elements,
    505 empty)."""
    return [payload_size(hi - lo, fmt, bucket_size, squares) if hi > lo else 0
            for lo, hi in reternarized_bounds(numel, n_ranks, bucket_size)]


# -- the requantized exchange (exchange/requantized.py, codec/requant.py) ---------------------------------------
REQUANT_GROUP = 128                        #: elements per 4-bit group (one fp32 step each)
REQUANT_HEADER_BYTES = 8                   #: magic, flags, element count


def requant_groups(m: int) -> int:
    """Groups of REQUANT_GROUP elements (the last one short) of an m-element shard."""
    return -(-m // REQUANT_GROUP)


def requantized_owner_bytes(m: int, noise: bool) -> int:
    """Bytes of an owner's requantized payload of m elements: header, a step per group, 4-bit codes and, with the
    noise channel, a maximum per group and a bit per element; padded to 4 bytes."""
    g = requant_groups(m)
    n = REQUANT_HEADER_BYTES + 4 * g + -(-m // 2)
    if noise:
        n += 4 * g + -(-m // 8)
    return -(-n // 4) * 4


def requantized_owner_chunk_bytes(numel: int, n_ranks: int, noise: bool, bucket_size: int = 0) -> list[int]:
    """Bytes each owner adds to the requantized exchange's allgather for one tensor (its shard; the shards are the
    re-ternarized exchange's, whose first stage it shares)."""
    return [requantized_owner_bytes(hi - lo, noise) if hi > lo else 0      # an empty shard: nothing
            for lo, hi in reternarized_bounds(numel, n_ranks, bucket_size)]


# -- the owner-step exchange (exchange/owner_step.py) -----------------------------------------------------------
def owner_step_weight_chunk_bytes(numel: int, n_ranks: int, fmt: str, bucket_size: int = 0,
                                  weight_bucket: int = 0) -> list[int]:
    """Bytes each owner adds to the owner-step exchange's allgather for one tensor: its shard's weight difference
    as a ternary payload (header, one fp32 scaler per ``weight_bucket`` elements, or per shard, packed codes;
    codec/nearest.py); an empty shard sends nothing.  The shards are the re-ternarized exchange's, whose first
    stage owner-step shares (``bucket_size``: its gradient buckets)."""
    return [payload_size(hi - lo, fmt, header_bucket(hi - lo, weight_bucket)) if hi > lo else 0
            for lo, hi in reternarized_bounds(numel, n_ranks, bucket_size)]


JOINED_WORD_BITS = 31                      #: usable bits of one int32 word of the join exchange (sign bit left clear)


def joined_fields_per_word(n_ranks: int) -> int:
    """Elements per int32 word when ranks have joined (exchange/joined.py): fields of L = sum_bits(N)
    bits hold t + 1 in [0, 2] per rank, so their sum over at most N ranks never carries into the next."""
    return max(1, JOINED_WORD_BITS // sum_bits(n_ranks))


def joined_words(numel: int, n_ranks: int) -> int:
    """int32 words of one tensor's ternary values in the join exchange."""
    per = joined_fields_per_word(n_ranks)
    return -(-numel // per)
