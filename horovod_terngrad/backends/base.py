"""The backend interface: what every layer-2 backend offers, and the optional capabilities it declares.

A backend turns one flat fp32 gradient into the codec's bytes and back, bit for bit like the reference
codec: ``prepare`` (statistics -> ``codec.Prepared``), ``encode`` (one ternary payload), ``encode_levels`` (one
payload of codec/levels.py's four-level code with stratified dithers, format ``4level``) and ``decode`` (the
average of gathered payloads, ternary or four-level).  Every backend has these, so callers write
``backends.for_device(g.device).encode_levels(...)``.  Anything beyond that is an optional capability, named in the
backend's ``capabilities`` set and checked with ``has_capability``; callers never probe for methods.

Capabilities:

* ``SHARDED_SUMS``: the sharded exchange's two kernels, ``owner_sums`` and ``decode_sums``
  (``ShardedSumsBackend``): the fused CPU backend and the CUDA kernels (``cuda.KernelBackend``) have them.
* ``NOISE_DECODE``: ``decode_noise``, the exchange's noise estimate (1/d^2)·Σ s^2·|t| (four-level payloads:
  (1/d^2)·Σ s^2·W[code], W = {1, 1/9, 1/9, 1}) in the decode's own pass over the gathered payloads
  (``NoiseDecodeBackend``).  Only the fused CPU backend has it; elsewhere
  exchange/allgather.py maps copies of the payloads and calls ``decode``: the same bits.
* ``ADAM_CORRECTED``: ``adam_corrected``, horovod_terngrad.optim's default-mode Adam(W) update of one contiguous
  fp32 tensor in one pass (``AdamCorrectedBackend``).  Only the fused CPU backend has it; elsewhere the
  optimizer runs foreach ops.
* ``REQUANT``: ``requant_encode`` and ``requant_decode``, the requantized exchange's owner payload
  (codec/requant.py: 4-bit groups and the noise channel's bits) in one pass each (``RequantBackend``), the
  reference's bytes and values exactly.  The fused CPU backend and the CUDA kernels have it; elsewhere (the
  reference) exchange/requantized.py calls codec/requant.py's torch ops.
* ``NEAREST``: ``encode_nearest``, codec/nearest.py's payload (deterministic rounding to the nearest ternary
  level: the owner-step exchange's weight differences) in one pass (``NearestBackend``), the same bytes.  Only
  the fused CPU backend has it; elsewhere exchange/owner_step.py calls codec/nearest.py's torch ops.
* ``SQUARE_SUMS``: ``clipped_square_sums``, codec/squares.py's senders' squares (Σ clip(g)² per shard, in
  ``ordered_row_sums``' order) in one pass per run of equal shards (``SquareSumsBackend``), the same bits.  Only the
  fused CPU backend has it; elsewhere codec/squares.py's torch ops run.
* ``BF16_INPUT``: ``prepare`` and ``encode`` read a bf16 gradient as it is, with the bytes its fp32 copy gives (bf16
  -> fp32 is exact), so the engine hands bf16 gradients over without making an fp32 copy.  The CUDA kernels
  (``cuda.KernelBackend``) have it; the other backends are given fp32.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .. import codec
from ..codec import levels, sizes

SHARDED_SUMS = "sharded_sums"
NOISE_DECODE = "noise_decode"
ADAM_CORRECTED = "adam_corrected"
REQUANT = "requant"
NEAREST = "nearest"
SQUARE_SUMS = "square_sums"
BF16_INPUT = "bf16_input"


@runtime_checkable
class Backend(Protocol):
    """prepare / encode / decode of the codec on one kind of device."""

    name: str                     # shown in logs, benchmarks and preflight output
    capabilities: frozenset[str]  # optional capabilities it implements, e.g. {SHARDED_SUMS}

    def prepare(self, g32: torch.Tensor, bucket_size: int, clip_factor: float) -> codec.Prepared:
        """Statistics of a flat fp32 tensor: clip threshold, local scalers and the NaN/Inf flag, as
        0-d / [num_buckets] tensors on ``g32``'s device."""
        ...

    def encode(self, g32: torch.Tensor, threshold: torch.Tensor, scalers: torch.Tensor, bucket_size: int,
               key: tuple[int, int], fmt: str, flags: int = 0, shape=None) -> torch.Tensor:
        """One payload (uint8, on ``g32``'s device): header, ``scalers`` and the packed ternary codes
        drawn with the random stream ``key``.  ``threshold`` is the fp32 0-d tensor of ``prepare``."""
        ...

    def encode_levels(self, g32: torch.Tensor, threshold: torch.Tensor, scalers: torch.Tensor, bucket_size: int,
                      own_key: tuple[int, int], shared_key: tuple[int, int], rank: int, group_size: int,
                      flags: int = 0, shape=None) -> torch.Tensor:
        """``codec.levels.encode``'s payload (format ``4level``), byte for byte: header, ``scalers`` and the packed
        four-level codes of clip(g) as rank ``rank`` of an averaging group of ``group_size`` rounds them, with its
        own stream ``own_key`` and the group's strata stream ``shared_key`` (``codec.levels.strata_key``).  Raises
        ValueError for a group size outside 1..``codec.levels.MAX_GROUP`` or a rank outside the group."""
        ...

    def decode(self, gathered: torch.Tensor, headers: list, offsets: list, divisor: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Σ over the payloads at ``offsets`` in ``gathered`` of scaler·value, divided by ``divisor``:
        fp32 [numel], written into ``out`` when given.  value: the ternary value, or for ``4level`` payloads the
        level / s in {-1, -1/3, 1/3, 1}, which only the general formula decodes (no shared-scaler integer sums)."""
        ...


@runtime_checkable
class ShardedSumsBackend(Backend, Protocol):
    """A backend with the ``SHARDED_SUMS`` capability."""

    def owner_sums(self, received: torch.Tensor, n_ranks: int, m: int, fmt: str, bits: int) -> torch.Tensor:
        """Add the ``n_ranks`` equal-size chunks of packed codes received for one shard (``m`` codes each,
        rank order) and pack every sum k in [-n_ranks, n_ranks] as k + n_ranks in ``bits`` bits: uint8
        [ceil(m·bits / 8)]."""
        ...

    def decode_sums(self, data: torch.Tensor, m: int, n_ranks: int, bits: int, scalers: torch.Tensor,
                    bucket_size: int, start: int, divisor: float, out: torch.Tensor) -> None:
        """Unpack the ``m`` sums of ``bits`` bits of a shard that starts at element ``start`` and write
        out[i] = (float(k_i)·s) / divisor, s the scaler of element start + i's bucket (fp32 [m])."""
        ...


@runtime_checkable
class NoiseDecodeBackend(Backend, Protocol):
    """A backend with the ``NOISE_DECODE`` capability."""

    def decode_noise(self, gathered: torch.Tensor, headers: list, offsets: list, divisor: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Σ over the payloads at ``offsets`` of scaler^2·|code|, divided by ``divisor``^2, bit for bit what
        ``decode`` gives for copies of the payloads with squared scalers and codes mapped to |t|: fp32 [numel],
        written into ``out`` when given."""
        ...


@runtime_checkable
class AdamCorrectedBackend(Backend, Protocol):
    """A backend with the ``ADAM_CORRECTED`` capability."""

    def adam_corrected(self, p, m, v, n, g, noise, vmax, *, beta1: float, beta2: float, step: float,
                       inv_bias2_sqrt: float, eps: float, decay: float, l2: float, noise_coef: float,
                       floor: float, maximize: bool) -> None:
        """The default-mode update of one contiguous fp32 tensor in place (the formula: kernels/terngrad_cpu.c,
        tg_adam_corrected); ``noise`` / ``vmax`` may be None."""
        ...


@runtime_checkable
class RequantBackend(Backend, Protocol):
    """A backend with the ``REQUANT`` capability."""

    def requant_encode(self, a: torch.Tensor, keys: tuple, start: int, noise: torch.Tensor | None = None,
                       flags: int = 0) -> torch.Tensor:
        """``codec.requant.encode``'s payload of the fp32 shard ``a`` (elements start..start+m-1 of its tensor),
        byte for byte."""
        ...

    def requant_decode(self, buf: torch.Tensor, offset: int, m: int, with_noise: bool, out: torch.Tensor,
                       noise_out: torch.Tensor | None = None) -> None:
        """``codec.requant.decode``: the payload of m elements at ``offset`` of ``buf`` into ``out`` (and its noise
        channel into ``noise_out`` when given and ``with_noise``), bit for bit."""
        ...


@runtime_checkable
class NearestBackend(Backend, Protocol):
    """A backend with the ``NEAREST`` capability."""

    def encode_nearest(self, d: torch.Tensor, fmt: str, bucket_size: int = 0) -> torch.Tensor:
        """``codec.nearest.encode_nearest(d, fmt, bucket_size)``'s payload of the flat fp32 ``d`` (one scaler per
        bucket; 0: one for all of ``d``), byte for byte."""
        ...


@runtime_checkable
class SquareSumsBackend(Backend, Protocol):
    """A backend with the ``SQUARE_SUMS`` capability."""

    def clipped_square_sums(self, g: torch.Tensor, threshold: torch.Tensor, bounds: list) -> torch.Tensor:
        """``codec.squares.clipped_square_sums(g, threshold, bounds)``, bit for bit."""
        ...


def has_capability(backend: Backend, capability: str) -> bool:
    """Whether ``backend`` declares ``capability`` (one of the constants of this module)."""
    return capability in backend.capabilities


def ternary_packing(fmt: str) -> str:
    """``fmt`` where a kernel reads or writes ternary codes (encode, owner sums, nearest rounding): one of the
    ternary packings; the four-level format has its own kernels (``encode_levels``), and its codes are no ternary
    values to add or pack as base3."""
    if fmt not in sizes.PACKINGS:
        raise ValueError(f"unknown ternary packing {fmt!r}; choose one of {list(sizes.PACKINGS)}")
    return fmt


def levels_inputs(rank: int, group_size: int) -> tuple[int, int]:
    """What every ``encode_levels`` checks, and the strata its kernel needs: (k, the reduction polynomial of GF(2^k),
    0 for k <= 1), k = ``codec.levels.strata_bits(group_size)``.  Raises ValueError for a group size outside
    1..MAX_GROUP or a rank outside the group, whatever the tensor's size."""
    k = levels.group_strata_bits(rank, group_size)
    return k, levels.POLYNOMIALS.get(k, 0)


def requant_encode_inputs(a: torch.Tensor, noise: torch.Tensor | None, start: int):
    """What every ``RequantBackend.requant_encode`` checks and reads: the shard ``a`` and the ``noise`` estimate as
    flat contiguous fp32 on ``a``'s device (noise None without the noise channel)."""
    m = a.numel()
    if m >= 1 << 32:          # the header holds m in 32 bits (the reference's struct.pack raises too)
        raise ValueError(f"TernGrad: a requantized shard of {m} elements does not fit its 32-bit header")
    if start < 0:
        raise ValueError(f"random stream element words must be >= 0, got {start}")
    a = a.reshape(-1).to(torch.float32).contiguous()
    nu = None if noise is None else noise.reshape(-1).to(device=a.device, dtype=torch.float32).contiguous()
    if nu is not None and nu.numel() != m:
        raise ValueError(f"TernGrad: noise of {nu.numel()} elements for a shard of {m}")
    return a, nu


class RequantDecodeTargets:
    """What every ``RequantBackend.requant_decode`` checks and writes into: ``buf`` must hold a payload of ``m``
    elements at ``offset``; ``out`` / ``noise`` are contiguous fp32 the kernel writes (the caller's tensors, or
    scratch copied back by ``finish`` where those are not contiguous fp32)."""

    def __init__(self, buf: torch.Tensor, offset: int, m: int, with_noise: bool, out: torch.Tensor,
                 noise_out: torch.Tensor | None):
        need = sizes.REQUANT_HEADER_BYTES + 4 * sizes.requant_groups(m) + -(-m // 2)
        if with_noise:
            need += 4 * sizes.requant_groups(m) + -(-m // 8)
        if not buf.is_contiguous() or buf.dtype != torch.uint8 or offset < 0 or offset + need > buf.numel():
            raise ValueError(f"TernGrad: no requantized payload of {m} elements at byte {offset} of a "
                             f"{buf.numel()}-byte buffer")
        if out.numel() != m or (noise_out is not None and noise_out.numel() != m):
            raise ValueError(f"TernGrad: outputs of {out.numel()} elements for a payload of {m}")
        self.given_out, self.given_noise = out, noise_out if with_noise else None
        self.out, self.noise = self._fp32(out, m, buf.device), None
        if self.given_noise is not None:
            self.noise = self._fp32(self.given_noise, m, buf.device)

    @staticmethod
    def _fp32(t: torch.Tensor, m: int, device) -> torch.Tensor:
        return t if t.is_contiguous() and t.dtype == torch.float32 else torch.empty(m, device=device)

    def finish(self) -> None:
        """Copies scratch outputs back into the caller's tensors."""
        if self.out is not self.given_out:
            self.given_out.copy_(self.out.view(self.given_out.shape))
        if self.noise is not None and self.noise is not self.given_noise:
            self.given_noise.copy_(self.noise.view(self.given_noise.shape))
