"""Measured links: ``exchange="auto"`` (whether ternarizing pays at all on the link it runs on) and
``hierarchical="auto"`` (the links across and inside nodes it prices the node-aware plan on).  Measure once,
agree, and decide the same on every rank, in the same way from one run to the next.

Per gradient element, for N ranks and a link of B bytes/s as an fp32 allreduce reaches it:

    full precision (ring allreduce):   t_fp32 = 2(N-1)/N · 4 / B
    TernGrad (allgather of payloads):  t_tern = c + (N-1) · b / B

with c the codec's time per element on this machine (statistics + encode + decode of N payloads) and b the
payload bytes per element (``codec.sizes``: 1/4 for 2-bit, 1/5 for base-3).  Ternarizing pays when
t_tern < t_fp32.  On 1 Gbit/s Ethernet it does by a wide margin (B = 125 MB/s: t_fp32 = 32 ns, t_tern =
c + 2 ns with c ~ 2 ns on a CPU core); on InfiniBand or a fast local link the CPU codec alone can cost
more than the bytes it saves, and the tensors then travel as with ``Compression.none``.

The probe (:func:`probe`), on one set of collectives (the world; or a node's ranks):

1. an allreduce-sum of a 1 per rank: who takes part.  A rank in ``hvd.join()`` adds 0; then the decision is
   left open (this step goes on undecided, and the next step asks again), so a rank that joined before the
   decision never misses the collectives that make it;
2. one untimed pair (``SMALL_NUMEL`` then ``LARGE_NUMEL`` fp32 zeros allreduced): connection setup and the
   ranks' skew land there;
3. ``PROBE_REPEATS`` timed pairs.  The small allreduce also lines the ranks up for the large one right after it
   (a late rank would otherwise time only the tail of the large one).  Each size's fastest repeat counts: a
   collective never runs faster than its link allows, while a busy core (another rank's training, another job)
   only ever makes it slower;
4. the rate from the two sizes (alpha-beta, from the ranks' figures as agreed below):
   B = 2(N-1)/N · 4 · (LARGE - SMALL) / (t_large - t_small) for a ring (``sent_bytes``: (N-1) · 4 · ... for a
   node's group carried by world collectives), which leaves out what every collective costs whatever its size
   (the framework's negotiation round, the ring's per-message latency, waking a thread); the large size alone
   where the difference is not positive.

Why not one 1 MiB allreduce: on 2 emulated hosts x 2 ranks over 1 Gbit/s with the cores busy it reads anything
from 0.06 Gbit/s up, and the plan differs from one run of a job to the next: its 12 ms of bytes are a fraction
of the negotiation and scheduling around them, and a mean over ranks carries one rank's stall to every rank.

Agreement: one allreduce-sum of an N x k float64 matrix, each rank filling its own row (the others 0, so the
sum is exact): every rank holds the same figures of every rank, and computes the same decision from them by
plain arithmetic (``agreed_rate_Bps``): the fixed cost is the fastest small allreduce of any rank (the least
disturbed one: a busy core inflates a 64 KiB allreduce from 1 ms to 90), the large one the median over the
ranks (which one or two stalled ranks cannot move).

Snapping (:func:`snap_gbps`): the agreed rate is priced as the nearest point of a coarse grid, 1 and 3 per
decade (..., 0.3, 1, 3, 10, 30, 100, 300, ... Gbit/s: 1 GbE -> 1, 2.5/5 GbE -> 3, 10 GbE -> 10, 25-50 GbE ->
30, 100 GbE or EDR -> 100, HDR/NDR -> 300; inside a node the same grid), nearest on a log scale.  Each grid
point's cell spans x/÷ 1.7 or more, so measurement noise of +-40% around a grid rate is priced at that rate and
cannot flip the plan; only a link measured near a cell's edge (1.7, 5.5, 17 ... Gbit/s) can land on either side.

A rate the user gives wins: ``HOROVOD_TERNGRAD_GBPS`` turns the probe off (``hierarchical="auto"`` prices the
configured links; ``exchange="auto"`` times only the codec and prices the given rate), and
``HOROVOD_TERNGRAD_INTRA_GBPS`` keeps the configured link inside a node (the node's probe still runs, on every
rank alike; a job whose ranks disagree about it raises).

Cost: once per engine.  Per probe PROBE_REPEATS + 1 pairs of allreduces, 4·(SMALL_NUMEL + LARGE_NUMEL) bytes
each, plus the two agreement allreduces (4 and 8·k·N bytes).  At 1 Gbit/s a ring puts 1.5 x 4.2 MB through
each host link per large allreduce, 50 ms: about 0.25 s for the world's probe; a node's probe (shared memory,
loopback, NVLink) takes a few ms to tens of ms.  ``exchange="auto"`` adds the codec on ``LARGE_NUMEL``
elements (a few ms).  Nothing is saved in ``state_dict()``: a resumed or re-initialized (elastic) job measures
its own links again.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field, replace

import torch

from .. import backends, codec
from ..codec import sizes as wire
from ..errors import TernGradError
from . import cost, network_env

SMALL_NUMEL = 1 << 14       #: elements of the small probe allreduce (64 KiB of fp32)
LARGE_NUMEL = 1 << 20       #: elements of the large probe allreduce (4 MiB of fp32) and of the codec timing
PROBE_REPEATS = 3
PROBE_NUMEL = LARGE_NUMEL
GRID_PER_DECADE = (1.0, 3.0)    #: the rates a measured one is priced as, times every power of 10 (Gbit/s)


def snap_gbps(gbps: float) -> float:
    """The grid rate (1 or 3 times a power of 10, Gbit/s) nearest to ``gbps`` on a log scale (the lower of two
    at exactly the same distance); ``gbps`` itself where it is not a positive finite number."""
    if not (gbps > 0 and math.isfinite(gbps)):
        return gbps
    decade = math.floor(math.log10(gbps))
    points = [m * 10.0 ** e for e in (decade - 1, decade, decade + 1) for m in GRID_PER_DECADE]
    best = min(points, key=lambda p: (abs(math.log(gbps / p)), p))
    return float(f"{best:.6g}")      # 0.3, not 0.30000000000000004


def _median(values) -> float:
    """The median of ``values`` (the mean of the middle two for an even count): the same float on every rank
    from the same list."""
    v = sorted(float(x) for x in values)
    if not v:
        raise ValueError("median of nothing")
    h = len(v) // 2
    return v[h] if len(v) % 2 else (v[h - 1] + v[h]) / 2


def sent_bytes(coll, numel: int) -> float:
    """Bytes each rank of ``coll`` sends in an fp32 allreduce of ``numel`` elements: a ring's 2(N-1)/N · 4n, or
    (N-1) · 4n where ``coll`` is a group carried by world collectives (world_groups.py: an allgather, then the
    sum on every rank)."""
    n = coll.size
    if getattr(coll, "spans_world", False):
        return (n - 1) * 4.0 * numel
    return 2 * (n - 1) / n * 4 * numel


def rate_Bps(coll, t_small: float, t_large: float) -> float:
    """The link rate (bytes/s per rank's link) from a small and a large probe allreduce on ``coll``: the slope
    between the two sizes, or the large one alone where the slope is not positive."""
    dt = t_large - t_small
    if dt > 0:
        return (sent_bytes(coll, LARGE_NUMEL) - sent_bytes(coll, SMALL_NUMEL)) / dt
    return sent_bytes(coll, LARGE_NUMEL) / max(t_large, 1e-9)


def agreed_rate_Bps(coll, times) -> float:
    """The rate from every rank's (t_small, t_large) on ``coll``: the fastest small allreduce of any rank (the
    least disturbed: the cost every collective pays whatever its size) and the median large one (the bytes on top
    of that cost, which one or two stalled ranks cannot move)."""
    return rate_Bps(coll, min(t[0] for t in times), _median(t[1] for t in times))


def _present(coll, device, name: str) -> bool:
    return int(coll.synchronize(coll.allreduce_sum_async(
        torch.ones(1, dtype=torch.int32, device=device), f"{name}.present"))[0]) == coll.size


def probe(coll, device: torch.device, name: str) -> tuple[float, float]:
    """This rank's (t_small, t_large): the fastest of PROBE_REPEATS timed pairs after an untimed one (see the
    module docstring).  Every rank of ``coll`` must call it at the same point."""
    small = torch.zeros(SMALL_NUMEL, dtype=torch.float32, device=device)
    large = torch.zeros(LARGE_NUMEL, dtype=torch.float32, device=device)
    t_small, t_large = [], []
    for i in range(PROBE_REPEATS + 1):
        t0 = time.perf_counter()
        coll.synchronize(coll.allreduce_sum_async(small, f"{name}.small.{i}"))
        t1 = time.perf_counter()
        coll.synchronize(coll.allreduce_sum_async(large, f"{name}.large.{i}"))
        t2 = time.perf_counter()
        if i:
            t_small.append(t1 - t0)
            t_large.append(t2 - t1)
    return min(t_small), min(t_large)


def agree(coll, device, mine: list, name: str) -> list[list[float]]:
    """Every rank's row of figures, the same on every rank: one allreduce-sum of an N x len(mine) float64
    matrix in which each rank fills its own row (x + 0 is exact: the sum is every rank's figures as sent)."""
    rows = torch.zeros(coll.size, len(mine), dtype=torch.float64, device=device)
    rows[coll.rank] = torch.tensor([float(x) for x in mine], dtype=torch.float64)
    return coll.synchronize(coll.allreduce_sum_async(rows, name)).cpu().tolist()


@dataclass(frozen=True)
class LinkDecision:
    """What the probe measured (agreed by every rank) and what ``exchange="auto"`` decided from it."""

    ranks: int
    allreduce_Bps: float        #: the agreed rate snapped to the grid (snap_gbps): what the decision prices
    codec_s_per_element: float  #: prepare + encode + decode of N payloads, per element, median over ranks
    packing: str
    measured_Bps: float = 0.0   #: the agreed rate as measured (median over ranks), before snapping

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
        measured = (f"measured {8 * self.measured_Bps / 1e9:.2f} Gbit/s, priced as " if self.measured_Bps else
                    "HOROVOD_TERNGRAD_GBPS: ")
        return (f"exchange='auto': {measured}{8 * self.allreduce_Bps / 1e9:.2f} Gbit/s per link (fp32 "
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


def _snapped_Bps(measured_Bps: float) -> float:
    return snap_gbps(8 * measured_Bps / 1e9) * 1e9 / 8


def measure(coll, device: torch.device, packing: str, name: str = "terngrad.link") -> LinkDecision | None:
    """``exchange="auto"``'s agreed measurement (see the module docstring), or None while a rank is in
    ``hvd.join()``.  Collective failures propagate as the collectives' own error class."""
    n = coll.size
    if n == 1:
        return LinkDecision(1, float("inf"), 0.0, packing)
    if not _present(coll, device, name):
        return None
    given = user_rate_Bps()
    # a rate the user gives wins: no probe (every rank reads the same variable, or none does: the launcher
    # exports it to every rank), only the codec is timed
    t_small, t_large = (0.0, 0.0) if given is not None else probe(coll, device, f"{name}.probe")
    t_codec = _codec_seconds(device, n, packing)
    rows = agree(coll, device, [t_small, t_large, t_codec], f"{name}.agree")
    codec_s = _median(r[2] for r in rows) / PROBE_NUMEL
    if given is not None:
        return LinkDecision(n, given, codec_s, packing)
    measured = max(agreed_rate_Bps(coll, [r[:2] for r in rows]), 1.0)
    return LinkDecision(n, _snapped_Bps(measured), codec_s, packing, measured)


def user_rate_Bps() -> float | None:
    """The link rate the user gave (``HOROVOD_TERNGRAD_GBPS``; ``terngrad-launch --gbps`` sets it), in bytes/s, or
    None: then it is measured."""
    if "HOROVOD_TERNGRAD_GBPS" not in os.environ:
        return None
    return network_env.configured_network().bandwidth_Bps


@dataclass(frozen=True)
class MeasuredLinks:
    """``hierarchical="auto"``'s agreed links: across nodes (the world's ring crosses every node's link) and
    inside a node (each node's own ring), as measured (median over every rank of the job) and as priced
    (snapped to the grid).  ``inside_given``: HOROVOD_TERNGRAD_INTRA_GBPS set, the configured link kept inside."""

    ranks: int
    ranks_per_node: int
    across_Bps: float
    inside_Bps: float           #: 0 where no node has two ranks to measure between
    inside_given: bool = False
    #: every rank's (t_small, t_large) of the world's probe and of its node's, seconds (0 where not measured)
    times: tuple = field(default=(), compare=False)

    @property
    def across_priced_Bps(self) -> float:
        return _snapped_Bps(self.across_Bps)

    @property
    def inside_priced_Bps(self) -> float:
        return _snapped_Bps(self.inside_Bps) if self.inside_Bps > 0 else 0.0

    def network(self, configured: cost.Network) -> cost.Network:
        """``configured`` (its latencies, links per rank, ranks per node) at the priced rates."""
        inside = configured.intra_node or configured
        if not self.inside_given and self.inside_Bps > 0:
            inside = replace(inside, name="measured intra-node", bandwidth_Bps=self.inside_priced_Bps)
        return replace(configured, name="measured", bandwidth_Bps=self.across_priced_Bps, intra_node=inside)

    def describe(self) -> str:
        inside = ("not measured" if self.inside_Bps <= 0 else
                  f"{8 * self.inside_Bps / 1e9:.2f} Gbit/s inside a node ({self.ranks_per_node} ranks)")
        priced = (f"priced as {snap_gbps(8 * self.across_Bps / 1e9):g} Gbit/s across and "
                  + ("the configured HOROVOD_TERNGRAD_INTRA_GBPS inside" if self.inside_given or self.inside_Bps <= 0
                     else f"{snap_gbps(8 * self.inside_Bps / 1e9):g} Gbit/s inside"))
        return (f"measured {8 * self.across_Bps / 1e9:.2f} Gbit/s across nodes (fp32 allreduce of {self.ranks} "
                f"ranks) and {inside}, {priced}")


def measure_links(world, local, device: torch.device, name: str = "terngrad.link") -> MeasuredLinks | None:
    """The probe on ``world`` (every rank) and on ``local`` (this rank's node), agreed over the world by one
    allreduce: the median over the ranks of each rate (each node measures its own link inside).  None while a
    rank is in ``hvd.join()``.  Every rank of the world must call it at the same point; collective failures
    propagate as the collectives' own error class."""
    if not _present(world, device, name):
        return None
    n = world.size
    t_world = probe(world, device, f"{name}.world") if n > 1 else None
    t_node = probe(local, device, f"{name}.node") if local.size > 1 else None
    given = "HOROVOD_TERNGRAD_INTRA_GBPS" in os.environ
    rows = agree(world, device, [float(given), *(t_world or (0.0, 0.0)), *(t_node or (0.0, 0.0))], f"{name}.agree")
    set_on = [r for r, row in enumerate(rows) if row[0]]
    if 0 < len(set_on) < n:
        raise TernGradError(f"TernGrad: hierarchical='auto': HOROVOD_TERNGRAD_INTRA_GBPS is set on ranks "
                            f"{_ranks(set_on)} and not on the others; set it alike on every rank")
    across = agreed_rate_Bps(world, [row[1:3] for row in rows]) if n > 1 else 0.0
    inside = agreed_rate_Bps(local, [row[3:5] for row in rows]) if local.size > 1 else 0.0
    return MeasuredLinks(n, local.size, max(across, 1.0), inside, bool(set_on), tuple(tuple(row[1:]) for row in rows))


def _ranks(ranks: list) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8} more)" if len(ranks) > 8 else "")


def plan_summary(node_aware, largest: int = 1 << 30) -> str:
    """Which fused groups the node-aware plan takes, in words, from ``node_aware(numel) -> bool`` (the transport's
    own decision for one group of that many elements) at every power of two up to ``largest``."""
    sizes = [1 << k for k in range(largest.bit_length())]
    takes = [bool(node_aware(s)) for s in sizes]
    if all(takes):
        return "node-aware for every group"
    if not any(takes):
        return f"flat for every group up to {largest:,} elements"
    first = takes.index(True)
    if all(takes[first:]):
        return f"node-aware for groups of {sizes[first]:,} elements or more, flat below"
    return ("node-aware for groups of " + ", ".join(f"{s:,}" for s, t in zip(sizes, takes) if t)
            + " elements (powers of two), flat for the others")
