"""Four-level rounding with stratified dithers: the first stage of the shard-owner exchanges at 2 bits per element,
with about half the rounding variance of the ternary code and much less in the ranks' average.

The code.  Every rank clips its gradient at c·σ and takes its scalers s = min(max|g|, c·σ) as TernGrad does
(codec/ternary.py: ``prepare``), then rounds each clipped element c stochastically and unbiasedly to the nearest of
the four levels s·{-1, -1/3, 1/3, 1}: the fourth 2-bit code, which the ternary code leaves unused.  Per element,
with y = (c/s + 1)·1.5 in [0, 3] (fp32: one division, one addition, one multiplication, in that order),
L = min(floor(y), 2) and f = y - L, the code is L + 1 with probability f, else L; code k decodes to
s·(2k/3 - 1) = s·V[k], V = {-1, -1/3, 1/3, 1} (fp32).  E[s·V[code]] = c, and the rounding's variance is
(2s/3)²·f·(1 - f) <= s²/9, against the ternary code's s·|c| - c² <= s²/4: on a Gaussian clipped at 2.5σ about
0.43σ² per element against 1.0σ².  Where s = 0 (a zero bucket, or a sender whose tensor held NaN/Inf: its scalers
are 0) every code is 0, which decodes to 0.

The dithers (why this needs the averaging group's size and each rank's place in it).  Each rank's rounding only
needs its own dither to be uniform; the ranks' dithers need not be independent.  For each element, every rank of
the group draws a stratum from one stream they all share, distinct strata for distinct ranks, and its own stream
places it inside the stratum: rank r's dither is u_r = (π(r) + γ_r)/M for M strata, with π a random one-to-one map
of the ranks to the strata and γ_r uniform.  An element rounds up where u >= 1 - f: on the dither's upper tail, on
every rank.  Then any two ranks' rounding errors have covariance <= 0 (Chebyshev's sum inequality over the strata),
so the variance of the ranks' average is never above independent draws', and where the ranks' values agree it falls
as 1/N² instead of 1/N.  No bits are added: the codes, scalers and decoding do not depend on the dithers.

The map π, drawn per element from the shared stream with no sort: M = 2^k strata for the smallest k with
2^k >= N, and the affine maps x -> a·x + b of the field GF(2^k) (a != 0), which take any two distinct ranks to any
two distinct strata with equal probability, as a random permutation does.  From the shared 32-bit draw h of the
element (codec/rng.py's mixer under the strata key: seed, step and tensor, and ``STRATA_WORD`` in place of a rank):
b = h mod 2^k, a = 1 + (h >> k) mod (2^k - 1) (a = 1 for k <= 1); rank r's stratum is a·r + b in GF(2^k)
(multiplication modulo ``POLYNOMIALS[k]``, addition xor).  b alone is exactly uniform, so every rank's stratum is
exactly uniform whatever a's small bias (at most 2^k/2^(32-k) relative): each rank's dither, and so its rounding,
is exactly as unbiased as the ternary code's.  Rank r's 24-bit dither is (stratum·2^24 + v_r) >> k, v_r its own
24-bit draw (codec/rng.py, under its own key): exactly uniform on [0, 2^24).  Up: float(2^24 - 1 - dither) <
f·2^24 (fp32, exact), so P(up) = ceil(f·2^24)/2^24, as the ternary code's P(keep).

Decoding N payloads: out = (Σ_r V[code_r]·s_r)/divisor in fp32 in rank order (one product, one sum per rank,
one division), the ternary decode's general formula with V for the values; there is no shared-scaler shortcut.  The
noise estimate (1/d²)·Σ_r (s_r·V[code_r])² is the same formula with the squared scalers s_r·s_r (fp32) and the
values W = {1, 1/9, 1/9, 1} (fp32), divided by d²: ``decode_average(..., squares=True)``.

Cost: two draws per element (the own one and the shared one: one more mixer pair than the ternary code) and k
shift-xor steps of the field's multiplication; the bytes are the 2-bit ternary payload's (format byte 3).
"""
from __future__ import annotations

import torch

from .packing import FOUR_LEVEL_VALUES, new_payload, pack_codes, parse_header, split
from .sizes import FOUR_LEVEL
from .rng import MASK32, UNIFORM_BITS, _mix32_tensor, stream_key
from .ternary import expand_scalers

FORMAT = FOUR_LEVEL
VALUES = FOUR_LEVEL_VALUES                         #: code -> value / s (fp32 on every backend)
SQUARES = (1.0, 1.0 / 9.0, 1.0 / 9.0, 1.0)         #: code -> (value / s)² (fp32), the noise estimate's table
STRATA_WORD = MASK32                               #: the strata stream's rank word: no rank's index
MAX_GROUP = 1 << 16                                #: ranks in one averaging group: strata of at most 16 bits
#: k -> the reduction polynomial of GF(2^k) (its bit k set; irreducible over GF(2): tests check it)
POLYNOMIALS = {2: 0x7, 3: 0xB, 4: 0x13, 5: 0x25, 6: 0x43, 7: 0x83, 8: 0x11D, 9: 0x211, 10: 0x409, 11: 0x805,
               12: 0x1053, 13: 0x201B, 14: 0x4443, 15: 0x8003, 16: 0x1100B}
_TWO_POW_24 = float(1 << UNIFORM_BITS)
_U24_MAX = (1 << UNIFORM_BITS) - 1


def strata_bits(group_size: int) -> int:
    """k: the smallest k with 2^k >= ``group_size`` ranks (0 for one rank)."""
    if not 1 <= group_size <= MAX_GROUP:
        raise ValueError(f"TernGrad: four-level rounding stratifies groups of 1 to {MAX_GROUP} ranks, got "
                         f"{group_size}")
    return (group_size - 1).bit_length()


def group_strata_bits(rank: int, group_size: int) -> int:
    """``strata_bits(group_size)``, with ``rank`` checked to be in the group: what every encoder checks first (also
    for an empty tensor)."""
    k = strata_bits(group_size)
    if not 0 <= rank < group_size:
        raise ValueError(f"TernGrad: rank {rank} is not in a group of {group_size}")
    return k


def strata_key(seed: int, step: int, tensor: int) -> tuple[int, int]:
    """The key of the stream every rank of the group shares (no rank in it)."""
    return stream_key(seed, step, tensor, STRATA_WORD)


def gf_mul(a, r: int, k: int):
    """a·r in GF(2^k) (``a`` an int or an int64 tensor of field elements, ``r`` a field element)."""
    if k <= 1:
        return a * (r & 1) if k == 1 else a * 0
    poly, top = POLYNOMIALS[k], 1 << k
    out = a * 0
    x = a
    for i in range(k):
        if (r >> i) & 1:
            out = out ^ x
        x = x << 1
        x = x ^ ((x & top) != 0).to(torch.int64) * poly if isinstance(x, torch.Tensor) else (x ^ poly if x & top else x)
    return out


def _draws(key: tuple[int, int], start: int, count: int, device) -> torch.Tensor:
    """The full 32-bit mixer outputs of elements start..start+count-1 (codec/rng.py's construction)."""
    k0, k1 = key
    idx = torch.arange(start, start + count, dtype=torch.int64, device=device)
    return _mix32_tensor(_mix32_tensor((idx & MASK32) ^ k0) ^ (idx >> 32) ^ k1)


def stratified_uniform24(own_key: tuple[int, int], shared_key: tuple[int, int], rank: int, group_size: int,
                         start: int, count: int, device="cpu") -> torch.Tensor:
    """Rank ``rank``'s 24-bit dithers (int64) of elements start..start+count-1 (module docstring)."""
    k = group_strata_bits(rank, group_size)
    own = _draws(own_key, start, count, device) >> 8
    if k == 0:
        return own
    h = _draws(shared_key, start, count, device)
    b = h & ((1 << k) - 1)
    a = 1 + (h >> k) % ((1 << k) - 1) if k >= 2 else torch.ones_like(h)
    stratum = gf_mul(a, rank, k) ^ b
    return (stratum << (UNIFORM_BITS - k)) | (own >> k)


def round_codes(g: torch.Tensor, threshold: torch.Tensor, scalers: torch.Tensor, bucket_size: int,
                dither: torch.Tensor) -> torch.Tensor:
    """The four-level codes (uint8, 0..3) of the flat fp32 ``g`` with its 24-bit ``dither`` (module docstring)."""
    n = g.numel()
    if not isinstance(threshold, torch.Tensor):
        threshold = torch.full((), float(threshold), dtype=torch.float32, device=g.device)
    c = torch.clamp(g, -threshold, threshold)
    s = expand_scalers(scalers.to(device=g.device, dtype=torch.float32), bucket_size, n)
    y = (c / s + 1.0) * 1.5
    low = torch.clamp(torch.floor(y), max=2.0)
    frac = y - low
    up = (_U24_MAX - dither).to(torch.float32) < frac * _TWO_POW_24
    code = low + up.to(torch.float32)
    return torch.where(s > 0, code, torch.zeros_like(code)).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of ``packing.pack_codes(codes, "4level")``: int64 codes 0..3."""
    b = packed.to(torch.int64)
    return torch.stack([(b >> (2 * q)) & 3 for q in range(4)], dim=1).reshape(-1)[:numel]


def encode(g: torch.Tensor, threshold: torch.Tensor, scalers: torch.Tensor, bucket_size: int,
           own_key: tuple[int, int], shared_key: tuple[int, int], rank: int, group_size: int, flags: int = 0,
           shape=None) -> torch.Tensor:
    """One payload (format ``4level``): header, ``scalers``, the packed four-level codes of the flat fp32 ``g``
    as rank ``rank`` of ``group_size`` draws them (reference torch ops, on ``g``'s device)."""
    n = g.numel()
    group_strata_bits(rank, group_size)
    payload, region = new_payload(n, FORMAT, scalers.to(g.device), bucket_size, flags, (n,) if shape is None else shape)
    if n:
        dither = stratified_uniform24(own_key, shared_key, rank, group_size, 0, n, g.device)
        region.copy_(pack_codes(round_codes(g, threshold, scalers, bucket_size, dither), FORMAT))
    return payload


def _table(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def decode_average(buf: torch.Tensor, headers: list, offsets: list, divisor: float, squares: bool = False,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """(Σ_r V[code_r]·s_r)/divisor over the ``4level`` payloads at ``offsets`` of ``buf``, in fp32 in payload order
    (``squares``: the noise estimate, (Σ_r W[code_r]·(s_r·s_r))/divisor with W the squares; callers pass d² as the
    divisor).  Reference torch ops on ``buf``'s device."""
    h0 = headers[0]
    for h in headers:
        if h.fmt != FORMAT:
            raise ValueError(f"TernGrad: a {h.fmt} payload among four-level ones")
    table = _table(SQUARES if squares else VALUES, buf.device)
    acc = torch.zeros(h0.numel, dtype=torch.float32, device=buf.device)
    for h, o in zip(headers, offsets):
        scalers, packed = split(buf[o:o + h.total_bytes], h)
        if squares:
            scalers = scalers * scalers
        acc += table[unpack_codes(packed, h.numel)] * expand_scalers(scalers, h.bucket_size, h.numel)
    acc /= float(divisor)
    if out is None:
        return acc
    out.copy_(acc.view(out.shape))
    return out


def decode_payload(payload: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
    """One whole ``4level`` payload's values s·V[code] / divisor (fp32)."""
    h = parse_header(payload, "four-level payload")
    return decode_average(payload, [h], [0], divisor)


__all__ = ["FORMAT", "VALUES", "SQUARES", "STRATA_WORD", "POLYNOMIALS", "strata_bits", "group_strata_bits",
           "strata_key", "gf_mul", "stratified_uniform24", "round_codes", "unpack_codes", "encode",
           "decode_average", "decode_payload"]
