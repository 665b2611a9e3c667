"""``exchange="auto"`` on the link it actually runs on: measure once, agree, and decide whether ternarizing
pays at all (and which TernGrad exchange to use).

Per gradient element, for N ranks and a link of B bytes/s as an fp32 allreduce reaches it:

    full precision (ring allreduce):   t_fp32 = 2(N-1)/N · 4 / B
    TernGrad (allgather of payloads):  t_tern = c + (N-1) · b / B

with c the codec's time per element on this machine (statistics + encode + decode of N payloads) and b the
payload bytes per element (``codec.sizes``: 1/4 for 2-bit, 1/5 for base-3).  Ternarizing pays when
t_tern < t_fp32.  On 1 Gbit/s Ethernet it does by a wide margin (B = 125 MB/s: t_fp32 = 32 ns, t_tern =
c + 2 ns with c ~ 2 ns on a CPU core); on InfiniBand or a fast local link the CPU codec alone can cost
more than the bytes it saves, and the tensors then travel as with ``Compression.none``.

How it is measured, so that every rank takes the same decision:

1. an allreduce-sum of a 1 per rank: who takes part.  A rank in ``hvd.join()`` adds 0; then the decision is
   left open (this step compresses, and the next step asks again), so a rank that joined before the
   decision never misses the collectives that make it;
2. ``PROBE_NUMEL`` zeros allreduced ``PROBE_REPEATS`` times (the first one also absorbs the ranks' skew);
   the fastest of the others gives B;
3. the codec on ``PROBE_NUMEL`` random elements with this rank's backend gives c;
4. an allreduce-sum of (B-time, c-time) from every rank: the mean over the ranks, the same float on every
   rank, from which every rank computes the same decision.

Cost: once per engine (per Horovod world and process set), 4 + 4·PROBE_NUMEL·PROBE_REPEATS + 16 bytes per
rank, about 10 ms at 1 Gbit/s per repeat.  The decision is not saved in ``state_dict()``: a resumed or
re-initialized (elastic) job measures its own link again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import backends, codec
from ..codec import sizes as wire
from . import cost

PROBE_NUMEL = 1 << 18       #: elements of the probe allreduce and of the codec timing (1 MiB of fp32)
PROBE_REPEATS = 3


@dataclass(frozen=True)
class LinkDecision:
    """What the probe measured (agreed by every rank) and what ``exchange="auto"`` decided from it."""

    ranks: int
    allreduce_Bps: float        #: bytes/s an fp32 ring allreduce moves across each rank's link
    codec_s_per_element: float  #: prepare + encode + decode of N payloads, per element, mean over ranks
    packing: str

    @property
    def fp32_s_per_element(self) -> float:
        return 2 * (self.ranks - 1) / self.ranks * 4 / self.allreduce_Bps

    @property
    def terngrad_s_per_element(self) -> float:
        bytes_per_element = wire.payload_size(PROBE_NUMEL, self.packing) / PROBE_NUMEL
        return self.codec_s_per_element + (self.ranks - 1) * bytes_per_element / self.allreduce_Bps

    @property
    def compresses(self) -> bool:
        """One rank sends nothing either way: it ternarizes, so that a 1-rank run computes what N ranks do."""
        return self.ranks == 1 or self.terngrad_s_per_element < self.fp32_s_per_element

    def network(self, latency_s: float) -> cost.Network:
        """The measured link as the cost model's network (for the allgather/sharded choice per group)."""
        return cost.Network("measured", latency_s, self.allreduce_Bps)

    def describe(self) -> str:
        verdict = ("ternarizing" if self.compresses else
                   "compression OFF: gradients travel at full precision, as with Compression.none "
                   "(pass exchange='allgather' to ternarize anyway)")
        return (f"TernGrad exchange='auto': measured {8 * self.allreduce_Bps / 1e9:.2f} Gbit/s per link (fp32 "
                f"allreduce, {self.ranks} ranks) and a codec of {1e9 * self.codec_s_per_element:.2f} ns/element: "
                f"{1e9 * self.terngrad_s_per_element:.2f} ns/element ternary vs "
                f"{1e9 * self.fp32_s_per_element:.2f} ns/element at full precision; {verdict}")


def _codec_seconds(device: torch.device, n_ranks: int, packing: str) -> float:
    """One pass of this rank's backend over PROBE_NUMEL elements: statistics, encode, decode of N payloads."""
    backend = backends.for_device(device)
    g = torch.randn(PROBE_NUMEL, generator=torch.Generator().manual_seed(0)).to(device)
    t0 = time.perf_counter()
    prep = backend.prepare(g, 0, 2.5)
    payload = backend.encode(g, prep.threshold, prep.scalers, 0, (0, 0), packing)
    gathered = payload.repeat(n_ranks)
    headers, offsets = codec.packing.walk(gathered, n_ranks, "link probe")
    backend.decode(gathered, headers, offsets, n_ranks)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def measure(coll, device: torch.device, packing: str, name: str = "terngrad.link") -> LinkDecision | None:
    """The agreed measurement (see the module docstring), or None while a rank is in ``hvd.join()``.
    Collective failures propagate as the collectives' own error class."""
    n = coll.size
    if n == 1:
        return LinkDecision(1, float("inf"), 0.0, packing)
    present = int(coll.synchronize(coll.allreduce_sum_async(
        torch.ones(1, dtype=torch.int32, device=device), f"{name}.present"))[0])
    if present != n:
        return None
    zeros = torch.zeros(PROBE_NUMEL, dtype=torch.float32, device=device)
    times = []
    for i in range(PROBE_REPEATS):
        t0 = time.perf_counter()
        coll.synchronize(coll.allreduce_sum_async(zeros, f"{name}.probe.{i}"))
        times.append(time.perf_counter() - t0)
    t_allreduce = min(times[1:]) if len(times) > 1 else times[0]
    t_codec = _codec_seconds(device, n, packing)
    mean = coll.synchronize(coll.allreduce_sum_async(
        torch.tensor([t_allreduce, t_codec], dtype=torch.float64, device=device), f"{name}.agree")).cpu() / n
    t_allreduce, t_codec = max(float(mean[0]), 1e-9), float(mean[1])
    return LinkDecision(n, 2 * (n - 1) / n * 4 * PROBE_NUMEL / t_allreduce, t_codec / PROBE_NUMEL, packing)

