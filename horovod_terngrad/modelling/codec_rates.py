"""The codec's speed on this machine, per element of each stage: what the scheduled step model
(modelling/timeline.py) charges the main thread for the codec work of a step.

:func:`measure_codec_rates` times each stage of this machine's codec backend on one thread (torch is imported
there only); :class:`CodecRates` holds the result, or rates given by hand or read from a calibration
(examples/emulated_cluster_benchmark.py writes them with its measurements).  Cost: a few passes over
``numel`` elements per stage and run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CodecRates:
    """Seconds per element of each codec stage on one worker (one core).

    prepare: statistics, clip threshold and scaler, per gradient element (in the backward hook);
    encode: ternarize + pack, per element; decode_base + decode_per_payload·N: allgather decode of N
    payloads, per output element; owner_sum: per code an owner adds (sharded: N·n/N = n per step);
    decode_sums: per element of the gathered sums; cast: one fp32<->fp16 cast, per element; add: one
    fp32 pass over a vector, per element (an add of two into a third, a division, a copy: the node-aware
    exchange's node sum, its fused group's concatenation and its members' copy out of the intra-node
    allgather); None (calibrations from before it was measured): charged as ``cast``, also one pass.
    """

    prepare: float
    encode: float
    decode_base: float
    decode_per_payload: float
    owner_sum: float
    decode_sums: float
    cast: float
    add: float | None = None

    @property
    def fp32_pass(self) -> float:
        """Seconds per element of one fp32 pass (``add``, else ``cast``)."""
        return self.cast if self.add is None else self.add

    def slowed(self, factor: float) -> "CodecRates":
        """Every stage ``factor`` times slower (ranks sharing a core)."""
        return CodecRates(*(None if getattr(self, f) is None else factor * getattr(self, f)
                            for f in self.__dataclass_fields__))


def measure_codec_rates(numel: int = 4_000_000, repeat: int = 3, statistic: str = "best") -> CodecRates:
    """Time each stage of this machine's codec backend on one thread: the best of ``repeat`` runs (what the
    core can do), or with ``statistic="median"`` the typical run (what it does while other processes
    share the machine, e.g. measured on every rank of a job at once)."""
    if statistic not in ("best", "median"):
        raise ValueError(f"statistic must be 'best' or 'median', got {statistic!r}")
    import torch

    from ..backends import for_device
    from ..codec import packing
    from ..exchange import sharded

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        be = for_device(torch.device("cpu"))
        g = torch.randn(numel, generator=torch.Generator().manual_seed(0))

        def per_element(fn):
            times = []
            for i in range(repeat + 1):
                t0 = time.perf_counter()
                fn()
                if i:                                  # the first run warms up
                    times.append(time.perf_counter() - t0)
            times.sort()
            return (times[0] if statistic == "best" else times[len(times) // 2]) / numel

        prep = be.prepare(g, 0, 2.5)
        prepare = per_element(lambda: be.prepare(g, 0, 2.5))
        encode = per_element(lambda: be.encode(g, prep.threshold, prep.scalers, 0, (1, 2), "2bit"))
        pay = be.encode(g, prep.threshold, prep.scalers, 0, (1, 2), "2bit")
        out = torch.empty(numel)
        dec = {}
        for k in (1, 8):
            gathered = torch.cat([pay] * k)
            headers, offsets = packing.walk(gathered, k)
            dec[k] = per_element(lambda: be.decode(gathered, headers, offsets, float(k), out=out))
        per_payload = max(0.0, (dec[8] - dec[1]) / 7)
        codes = pay[packing.HEADER_BYTES + 4:]
        N = 8
        m = numel // N // 20 * 20
        received = torch.cat([codes[:m // 4]] * N)
        # through exchange/sharded.py, which uses this backend's kernels when it has them, else the reference
        owner = per_element(lambda: sharded.owner_sums(received, N, 0, m, "2bit")) * numel / (N * m)
        sums = torch.cat([sharded.owner_sums(received, N, 0, m, "2bit")] * N)
        one = torch.ones(1)
        dsums = per_element(lambda: sharded.decode_gathered(sums, N * m, N, one, 0, float(N), out=out[:N * m])) * numel / (N * m)
        half = torch.empty(numel, dtype=torch.float16)
        cast = per_element(lambda: half.copy_(g))
        other = torch.randn(numel, generator=torch.Generator().manual_seed(1))
        add = per_element(lambda: torch.add(g, other, out=out))
        return CodecRates(prepare, encode, max(0.0, dec[1] - per_payload), per_payload, owner, dsums, cast, add)
    finally:
        torch.set_num_threads(old)


__all__ = ["CodecRates", "measure_codec_rates"]
