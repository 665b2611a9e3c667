"""The reference backend: the codec's plain torch ops, on any device (slow: several passes)."""
from __future__ import annotations

import torch

from .. import codec
from ..codec import levels, packing


class ReferenceBackend:
    """The backend interface on ``codec``'s functions; the fallback when no fused backend loads."""

    name = "torch"
    capabilities: frozenset[str] = frozenset()

    def prepare(self, g32: torch.Tensor, bucket_size: int, clip_factor: float) -> codec.Prepared:
        return codec.prepare(g32, bucket_size, clip_factor)

    def encode(self, g32, threshold, scalers, bucket_size, key, fmt, flags=0, shape=None) -> torch.Tensor:
        payload, region = packing.new_payload(g32.numel(), fmt, scalers, bucket_size, flags, shape)
        region.copy_(codec.pack(codec.ternarize(g32, threshold, scalers, bucket_size, key), fmt))
        return payload

    def encode_levels(self, g32, threshold, scalers, bucket_size, own_key, shared_key, rank, group_size, flags=0,
                      shape=None) -> torch.Tensor:
        """``codec.levels.encode`` (which checks the group first, as every backend does, also for an empty tensor)."""
        return levels.encode(g32, threshold, scalers, bucket_size, own_key, shared_key, rank, group_size, flags, shape)

    def decode(self, gathered: torch.Tensor, headers: list, offsets: list, divisor: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        # packing.average_packed decodes ``4level`` payloads by the general formula (codec/levels.py's decode)
        parts = [packing.split(gathered[o:o + h.total_bytes], h) for h, o in zip(headers, offsets)]
        h0 = headers[0]
        avg = packing.average_packed([c for _, c in parts], [s for s, _ in parts], h0.numel, h0.fmt,
                                     h0.bucket_size, divisor)
        return avg if out is None else out.copy_(avg)
