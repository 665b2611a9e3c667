"""The ``identity`` steps: byte identity of one codec backend against another on a model's tensor shapes."""
from __future__ import annotations

import math

import torch


def _sample(n: int, seed: int) -> torch.Tensor:
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if n > 10:
        g[n // 3] = 40.0        # an outlier the clip cuts
        g[n // 2] = 0.0
    return g


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (so -0.0 differs from 0.0, and NaNs compare by their bits)."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def identity(shapes, backend, device, other, other_device, ranks: int = 2, fmts=("2bit", "base3"),
             bucket_size: int = 0, clip: float = 2.5) -> tuple[int, int, list]:
    """Byte identity of ``backend`` on ``device`` against ``other`` on ``other_device`` over ``shapes``: for every
    tensor and packing, each rank's statistics (threshold, scalers, non-finite flag) and payload, then the decode
    of all ranks' payloads.  Returns (identical cases, cases, the names of the first few that differ)."""
    from ... import codec
    from ...codec import packing
    same = total = 0
    differ = []
    for t_index, (name, shape) in enumerate(shapes):
        n = math.prod(shape)
        for fmt in fmts:
            total += 1
            ok = True
            payloads = ([], [])
            for rank in range(ranks):
                g = _sample(n, seed=1000 * t_index + rank) * (rank + 1)
                key = codec.stream_key(7, 3, codec.tensor_id(name), rank)
                outs = []
                for be, dev, store in ((backend, device, payloads[0]), (other, other_device, payloads[1])):
                    gd = g.to(dev)
                    prep = be.prepare(gd, bucket_size, clip)
                    payload = be.encode(gd, prep.threshold, prep.scalers, bucket_size, key, fmt, shape=shape)
                    store.append(payload)
                    outs.append((prep, payload))
                (pa, ya), (pb, yb) = outs
                ok = ok and _same(pa.scalers, pb.scalers) and _same(ya, yb) \
                    and bool(pa.nonfinite) == bool(pb.nonfinite) \
                    and (float(pa.threshold) == float(pb.threshold)
                         or (math.isinf(float(pa.threshold)) and math.isinf(float(pb.threshold))))
            if ok:
                decoded = []
                for be, store in ((backend, payloads[0]), (other, payloads[1])):
                    gathered = torch.cat(store)
                    headers, offsets = packing.walk(gathered, ranks)
                    decoded.append(be.decode(gathered, headers, offsets, ranks))
                ok = _same(decoded[0], decoded[1])
            if ok:
                same += 1
            elif len(differ) < 3:
                differ.append(f"{name} {fmt}")
    return same, total, differ
