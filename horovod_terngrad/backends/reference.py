"""The reference backend: the codec's plain torch ops, on any device (slow: several passes)."""
from __future__ import annotations

import torch

from .. import codec


class ReferenceBackend:
    name = "torch"

    def stats(self, g32: torch.Tensor, bucket_size: int) -> codec.TensorStats:
        return codec.tensor_stats(g32, bucket_size)

    def ternarize_pack(self, g32, threshold, scalers, bucket_size, key, fmt) -> torch.Tensor:
        return codec.pack(codec.ternarize(g32, threshold, scalers, bucket_size, key), fmt)

    def decode_average(self, packed: list, scalers: list, numel: int, fmt: str, bucket_size: int,
                       divisor: float) -> torch.Tensor:
        return codec.packing.average_packed(packed, scalers, numel, fmt, bucket_size, divisor)
