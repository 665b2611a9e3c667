"""The runtime cost model: how long each transport takes on an alpha-beta network, and which of a given list
of candidate transports is the cheapest for a group.  Pure pricing: which transports a user's ``exchange=`` or
``hierarchical=`` setting weighs is decided in policy.py, which prices its candidates here.  No torch, no
plotting: the engine imports it on the training path, and the performance model (modelling/perfmodel.py) and
the timeline build on it.

Transports (the wire algorithms, one module each): allgather, sharded, reternarized, requantized, and joined
(the allreduce-sum while a rank is in ``hvd.join()``, not priced here).  Besides them it prices the owner-step
exchange (exchange/owner_step.py), which ``optim.OwnerStepOptimizer`` runs and no policy picks.  The methods' and
transports' names are names.py's.

A message of m bytes over one link costs alpha + m·beta (alpha: latency per message, beta = 1/bandwidth).
For N ranks and one buffer ("bytes" is what crosses each rank's link in each direction):

* allreduce of B bytes: the cheaper of two algorithms (``Network.allreduce`` "auto", the default), as the
  libraries pick per message size (NCCL >= 2.4: ring or double binary tree; Open MPI's tuned allreduce:
  recursive doubling for small messages; gloo: halving-doubling):
      ring:  T = 2(N-1)·alpha + 2(N-1)/N · B · beta            (received 2(N-1)/N·B, 2(N-1) messages)
      tree:  T = 2·ceil(log2 N)·alpha + 2 · B · beta           (received 2B, 2·ceil(log2 N) messages)
  the tree's bandwidth term is a conservative one (never better than the ring's); ``allreduce="ring"``
  charges the ring only (the model before this choice; also what a gloo ring runs);
* allgather of P bytes per rank:        T = (N-1)·alpha + (N-1) · P · beta
* pairwise alltoall, c bytes per peer:  T = (N-1)·alpha + max(N-1, G·(N-G)) · c · beta  (G ranks share a NIC)

``Network.peer_links`` = K: independent links from each rank to its peers inside a fully connected node
(1: one port, as a GPU's x16 port into a PCIe switch; 3: four P100s fully connected by NVLink).  With
N <= K+1 ranks on such a link, L = min(K, N-1) peers are reached at once: the allgather and the alltoall
take ceil((N-1)/L) stages, T = ceil((N-1)/L)·alpha + (N-1)/L · P · beta, and an allreduce runs L
link-disjoint rings (K4 decomposes into 3 directed Hamiltonian cycles; NCCL builds several channels), its
bandwidth term divided by L.  K = 1 gives the formulas above.

TernGrad exchanges of a group of tensors n_1..n_k, with every size from ``codec.sizes`` (the one place
they are computed, so this model charges exactly the bytes the engine sends):

* allgather: P = sum_i payload_size(n_i) per rank, plus, with a shared scaler, the handshake: an allreduce
  of H = handshake_size(scalers of each member) bytes.  With per-rank scalers (the allgather's default) each
  payload carries its own scaler and there is no handshake: the engine's only other collective is one
  4-byte presence check per step (:func:`presence_cost`), not per group;
* sharded: each member is sharded on its own (20-aligned slices); rank r receives its slice of every member
  from N-1 peers (alltoall, c = the largest rank's sum over members of its code bytes) and the owners' packed
  sums of every member (allgather, P_sum = the largest owner's sum over members), plus the handshake.
  No chunk headers: the scalers come from the handshake.
* owner-step (:func:`terngrad_owner_step_cost`, ``optim.OwnerStepOptimizer``): every ternarized tensor of the step
  in one alltoall of shard payloads to their owners (c, as the re-ternarized exchange's first stage, with the
  squares trailer), one allgather of the owners' ternary weight differences (P = the largest owner's), one
  allreduce of the nonfinite flags and one fp32 allgather of the full-precision tensors.

Node-aware exchange (exchange/hierarchical.py) of a group on M nodes of G ranks (:func:`hierarchical_cost`,
sizes from ``topology.shard_plan`` / ``topology.intra_node_bytes``, the transport's own): an fp32 alltoall
inside the node (c = the largest shard, to each local peer), the TernGrad exchange of each local rank's
pieces among M ranks on a G-th of the node's link (:func:`cross_network`; the slowest local rank sets the
time), an fp32 allgather inside the node (P = shard + a status word per piece).  :func:`hierarchy_for` says
whether it is cheaper than the flat exchange on all M·G ranks (policy.py asks it).

Every function prices the network it is given; where a caller gives none it prices the configured network
(:func:`configured_network`, read from the environment in network_env.py).  Cost of this module: O(tensors) per
decision (O(tensors·G) for the hierarchy).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from ..codec import sizes as wire
from . import network_env, topology
from .names import (FP16, FP32, TERNGRAD_ALLGATHER, TERNGRAD_BEST, TERNGRAD_HIERARCHICAL,  # noqa: F401 (cost.X)
                    TERNGRAD_OWNER_STEP, TERNGRAD_REQUANTIZED, TERNGRAD_RETERNARIZED, TERNGRAD_SHARDED, TRANSPORTS,
                    transport_of)

#: the network priced where a caller gives none (read from the environment: network_env.py)
configured_network = network_env.configured_network

METHODS = (FP32, FP16, TERNGRAD_ALLGATHER, TERNGRAD_SHARDED, TERNGRAD_BEST)
TERNGRAD_EXCHANGES = (TERNGRAD_ALLGATHER, TERNGRAD_SHARDED)
#: the transports that hand horovod_terngrad.optim its noise estimate after a single ternary rounding: the
#: allgather and the requantized one (not the sharded transport, which gives no estimate; not the re-ternarized
#: one, which rounds to ternary twice).  :func:`cheapest_transport` weighs them unless given other candidates.
NOISE_TRANSPORTS = (TERNGRAD_ALLGATHER, TERNGRAD_REQUANTIZED)


# Horovod 0.28.1's default HOROVOD_FUSION_THRESHOLD: its BackgroundThreadLoop sets 128 MiB (the docs still say 64)
HOROVOD_FUSION_BYTES = 128 * 1024 * 1024
TERNGRAD_FUSION_NUMEL = 1 << 22            #: TernGradConfig.fusion_numel's default

ALLREDUCE_AUTO = "auto"    #: an allreduce is charged the cheaper of the ring and the tree (the default)
ALLREDUCE_RING = "ring"    #: ring only
ALLREDUCE_TREE = "tree"    #: tree (latency-optimal: double binary tree, recursive doubling) only
ALLREDUCE_ALGORITHMS = (ALLREDUCE_AUTO, ALLREDUCE_RING, ALLREDUCE_TREE)


@dataclass(frozen=True)
class Network:
    """Alpha-beta link: ``latency_s`` = alpha (s per message), ``bandwidth_Bps`` = 1/beta (bytes/s).

    ``ranks_per_node`` ranks share one NIC; ``intra_node`` is the link used when all ranks fit in one
    node (N <= ranks_per_node), or None to use this link there too.  ``allreduce``: which allreduce
    algorithm the library runs on this link, "auto" (the cheaper of ring and tree per message, as NCCL,
    Open MPI and gloo choose; the default), "ring" or "tree" (:func:`allreduce_terms`).  ``peer_links``:
    independent links from each rank to its peers (1: one port, every message through it; 3: four GPUs
    fully connected by NVLink), used by every collective among ranks of this link (see the module
    docstring); bandwidth_Bps is one link's.
    """

    name: str
    latency_s: float
    bandwidth_Bps: float
    ranks_per_node: int = 1
    intra_node: "Network | None" = None
    efficiency: tuple = ()   #: ((collective, factor), ...): measured fraction of the link rate it reaches
    allreduce: str = ALLREDUCE_AUTO
    peer_links: int = 1

    def __post_init__(self):
        if self.allreduce not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"allreduce must be one of {ALLREDUCE_ALGORITHMS}, got {self.allreduce!r}")
        if int(self.peer_links) < 1:
            raise ValueError("peer_links must be >= 1")

    def with_allreduce(self, algorithm: str) -> "Network":
        """This network, and its intra-node link, charging allreduces with ``algorithm`` ("ring": the
        ring-only model)."""
        intra = replace(self.intra_node, allreduce=algorithm) if self.intra_node is not None else None
        return replace(self, allreduce=algorithm, intra_node=intra)

    def lanes(self, workers: int) -> int:
        """Links a rank uses at once among ``workers`` ranks of this link: min(peer_links, N-1), at least 1."""
        return max(1, min(int(self.peer_links), int(workers) - 1))

    def eff(self, collective: str) -> float:
        """Fraction of ``bandwidth_Bps`` that ``collective`` ("allreduce", "allgather", "alltoall")
        achieves on this network: 1 unless calibrated (:func:`calibrated_efficiency`).  Covers what
        alpha-beta leaves out: the implementation's algorithm, reductions and copies, and the host CPU
        cost of the transport (large on TCP over shared cores)."""
        for kind, factor in self.efficiency:
            if kind == collective:
                return factor
        return 1.0

    @property
    def alpha(self) -> float:
        return self.latency_s

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth_Bps

    @classmethod
    def from_gbps(cls, name: str, bandwidth_gbps: float, latency_us: float, ranks_per_node: int = 1,
                  intra_node: "Network | None" = None, *, allreduce: str = ALLREDUCE_AUTO,
                  peer_links: int = 1) -> "Network":
        """Build from Gbit/s (10^9 bit/s, of one link) and microseconds."""
        if bandwidth_gbps <= 0 or latency_us < 0:
            raise ValueError("bandwidth must be > 0 and latency >= 0")
        return cls(name, latency_us * 1e-6, bandwidth_gbps * 1e9 / 8, ranks_per_node, intra_node,
                   allreduce=allreduce, peer_links=int(peer_links))

    def link_for(self, workers: int) -> "Network":
        """The link a job of ``workers`` ranks runs on: ``intra_node`` when it fits in one node."""
        if self.intra_node is not None and workers <= self.ranks_per_node:
            return self.intra_node
        return self

    def describe(self) -> str:
        s = f"{self.name}: {self.bandwidth_Bps * 8 / 1e9:g} Gbit/s, alpha {self.latency_s * 1e6:g} us"
        if self.ranks_per_node > 1:
            s += f", {self.ranks_per_node} ranks per node"
        if self.peer_links > 1:
            s += f", {self.peer_links} links per rank"
        if self.intra_node is not None:
            links = f" x {self.intra_node.peer_links} links per rank" if self.intra_node.peer_links > 1 else ""
            s += (f" (inside a node: {self.intra_node.name}, {self.intra_node.bandwidth_Bps / 1e9:g} GB/s{links}, "
                  f"alpha {self.intra_node.latency_s * 1e6:g} us)")
        if self.allreduce != ALLREDUCE_AUTO:
            s += f"; allreduce: {self.allreduce} only"
        return s


# (The paper's clusters, PCIE_SWITCH, NVLINK, ETHERNET_1G and INFINIBAND_100G, are in modelling/perfmodel.py.)


def ring_allreduce_bytes(nbytes: float, workers: int) -> float:
    """Bytes one rank sends (= receives) in a ring allreduce of ``nbytes``: 2(N-1)/N·B."""
    return 2 * (workers - 1) / workers * nbytes if workers > 1 else 0.0


def tree_allreduce_bytes(nbytes: float, workers: int) -> float:
    """Bytes one rank receives in a tree allreduce of ``nbytes``, as charged: 2B (a double binary tree's
    rank receives its two children's halves and its parent's half in the tree where it is inner, and its
    parent's half in the other: 2B at most; recursive doubling receives B·log2 N, which the libraries run
    only for messages where latency dominates)."""
    return 2.0 * nbytes if workers > 1 else 0.0


def ring_allgather_bytes(bytes_per_rank: float, workers: int) -> float:
    """Bytes one rank sends (= receives) in a ring allgather of ``bytes_per_rank`` each: (N-1)·P."""
    return (workers - 1) * bytes_per_rank if workers > 1 else 0.0


def ring_allreduce_time(nbytes: float, workers: int, link: Network) -> float:
    """The ring: 2(N-1)·alpha + 2(N-1)/N·B·beta/L  (0 for N = 1; L = ``link.lanes(N)`` rings on
    link-disjoint paths, 1 unless the link has several ``peer_links``)."""
    N = workers
    if N <= 1:
        return 0.0
    return 2 * (N - 1) * link.alpha + 2 * (N - 1) / N * nbytes * link.beta / (link.eff("allreduce") * link.lanes(N))


def tree_allreduce_time(nbytes: float, workers: int, link: Network) -> float:
    """The tree: 2·ceil(log2 N)·alpha + 2·B·beta/L  (0 for N = 1): log-depth latency (reduce up, broadcast
    down: NCCL's double binary tree; Open MPI's recursive doubling, gloo's halving-doubling), with a
    bandwidth term never better than the ring's."""
    N = workers
    if N <= 1:
        return 0.0
    return (2 * math.ceil(math.log2(N)) * link.alpha
            + 2 * nbytes * link.beta / (link.eff("allreduce") * link.lanes(N)))


def allreduce_terms(nbytes: float, workers: int, link: Network) -> tuple[str, float, float]:
    """(algorithm, latency part, bandwidth part) of an allreduce of ``nbytes`` on ``link``: the ring
    or the tree as ``link.allreduce`` says; "auto" takes the tree where it is strictly faster (small
    messages, many ranks), else the ring."""
    N = workers
    if N <= 1:
        return ALLREDUCE_RING, 0.0, 0.0
    ring_lat = ring_allreduce_time(0, N, link)
    ring = (ALLREDUCE_RING, ring_lat, ring_allreduce_time(nbytes, N, link) - ring_lat)
    if link.allreduce == ALLREDUCE_RING:
        return ring
    tree_lat = tree_allreduce_time(0, N, link)
    tree = (ALLREDUCE_TREE, tree_lat, tree_allreduce_time(nbytes, N, link) - tree_lat)
    if link.allreduce == ALLREDUCE_TREE or tree[1] + tree[2] < ring[1] + ring[2]:
        return tree
    return ring


def allreduce_algorithm(nbytes: float, workers: int, link: Network) -> str:
    """"ring" or "tree": the algorithm :func:`allreduce_time` charges for this message."""
    return allreduce_terms(nbytes, workers, link)[0]


def allreduce_time(nbytes: float, workers: int, link: Network) -> float:
    """An allreduce of ``nbytes`` as the library runs it (:func:`allreduce_terms`): min(ring, tree) by default."""
    _, lat, bw = allreduce_terms(nbytes, workers, link)
    return lat + bw


def _stages(workers: int, link: Network) -> int:
    """Latency terms of an allgather or alltoall among ``workers`` ranks of ``link``: N-1, or
    ceil((N-1)/L) with L peer links."""
    return -(-(int(workers) - 1) // link.lanes(workers)) if workers > 1 else 0


def _allreduce(nbytes: float, workers: int, link: Network) -> tuple[float, float, int]:
    """(time, bytes received per rank, messages) of one allreduce, with the algorithm it is charged."""
    N = workers
    if N <= 1:
        return 0.0, 0.0, 0
    algo, lat, bw = allreduce_terms(nbytes, N, link)
    if algo == ALLREDUCE_TREE:
        return lat + bw, tree_allreduce_bytes(nbytes, N), 2 * math.ceil(math.log2(N))
    return lat + bw, ring_allreduce_bytes(nbytes, N), 2 * (N - 1)


def ring_allgather_time(bytes_per_rank: float, workers: int, link: Network) -> float:
    """(N-1)·alpha + (N-1)·P·beta  (0 for N = 1).  On a link with L = ``link.lanes(N)`` > 1 peer links
    (a fully connected node) each rank sends its P to L peers at once: ceil((N-1)/L)·alpha + (N-1)/L·P·beta."""
    N = workers
    if N <= 1:
        return 0.0
    return _stages(N, link) * link.alpha + (N - 1) / link.lanes(N) * bytes_per_rank * link.beta / link.eff("allgather")


def alltoall_time(bytes_per_peer: float, workers: int, link: Network, ranks_per_node: int = 1) -> float:
    """(N-1)·alpha + beta·max((N-1)·c, G·(N-G)·c), G = min(ranks_per_node, N) ranks sharing a NIC.

    With G = 1 (one NIC per rank) this is (N-1)·alpha + (N-1)·c·beta.  Within one node (G = N) the second
    term vanishes and the first, (N-1)·c, applies on the intra-node link; with L = ``link.lanes(N)`` > 1
    peer links (a fully connected node) L peers are reached at once: ceil((N-1)/L)·alpha + (N-1)/L·c·beta.
    """
    N = workers
    if N <= 1:
        return 0.0
    G = max(1, min(int(ranks_per_node), N))
    return (_stages(N, link) * link.alpha
            + max((N - 1) / link.lanes(N), G * (N - G)) * bytes_per_peer * link.beta / link.eff("alltoall"))


# calibration fits one large message of each collective: for the allreduce that is the ring (the tree is
# chosen only where latency dominates), whose bandwidth term the efficiency then scales for both algorithms
_COLLECTIVE_TIME = {"allreduce": ring_allreduce_time, "allgather": ring_allgather_time, "alltoall": alltoall_time}


def calibrated_efficiency(network: Network, workers: int, measured: dict, strict: bool = True) -> Network:
    """``network`` with per-collective efficiencies fitted to measured times.

    ``measured``: {collective: (bytes, seconds)} where bytes is the argument of that collective's time
    function (allreduce: buffer bytes B; allgather: bytes per rank P; alltoall: bytes to each peer c),
    e.g. from ``python -m horovod_terngrad.operations.bench step --calibrate`` run on the cluster itself.  The
    efficiency is the alpha-beta model's bandwidth term over the measured time less the latency term,
    so one large measurement per collective calibrates it (like nccl-tests' bus bandwidth).  Fitted as
    for one rank per NIC on ``network`` itself (not its intra-node link): calibrate with the same
    placement you predict for.
    """
    factors = []
    for kind, (nbytes, seconds) in measured.items():
        base = replace(network, efficiency=())
        latency_part = _COLLECTIVE_TIME[kind](0, workers, base)
        wire = _COLLECTIVE_TIME[kind](nbytes, workers, base) - latency_part
        if seconds <= latency_part or wire <= 0:
            if strict:
                raise ValueError(f"measured {kind} time {seconds:.6f}s is not above its latency term")
            continue
        factors.append((kind, wire / (seconds - latency_part)))
    return replace(network, efficiency=tuple(factors))


@dataclass(frozen=True)
class ExchangeCost:
    """Cost of one exchange on one rank: time, bytes received (= sent) and messages (latency terms)."""

    method: str
    time_s: float
    bytes_received: float
    messages: int
    elements: int

    @property
    def bits_per_element(self) -> float:
        """Received bits per gradient element (headers and handshake included)."""
        return 8.0 * self.bytes_received / self.elements if self.elements else 0.0

    def __add__(self, other: "ExchangeCost") -> "ExchangeCost":
        method = self.method if self.method == other.method else TERNGRAD_BEST
        return ExchangeCost(method, self.time_s + other.time_s, self.bytes_received + other.bytes_received,
                            self.messages + other.messages, self.elements + other.elements)


def _sizes(sizes: int | Sequence[int]) -> list[int]:
    out = [int(sizes)] if isinstance(sizes, (int,)) or hasattr(sizes, "__index__") else [int(s) for s in sizes]
    if any(s < 0 for s in out):
        raise ValueError("tensor sizes must be >= 0")
    return out


def presence_cost(workers: int, network: Network) -> ExchangeCost:
    """The per-rank scalers' presence check: one allreduce-sum of a 4-byte int32 per step (the engine asks
    it in the step's first per-rank group, whatever the number of groups).  It carries no gradient elements.
    Latency-bound: charged as the tree where the network's libraries have one (2·ceil(log2 N)·alpha)."""
    return replace(allreduce_cost(1, workers, network, 4), method=TERNGRAD_ALLGATHER, elements=0)


def _handshake(ns: list, bucket_size: int, workers: int, link: Network) -> tuple[float, float, int]:
    """Shared-scaler handshake: one allreduce of the group's handshake vector."""
    nbytes = wire.handshake_size([wire.num_buckets(n, bucket_size) for n in ns])
    return _allreduce(nbytes, workers, link)


def allreduce_cost(sizes: int | Sequence[int], workers: int, network: Network,
                   bytes_per_element: int = 4) -> ExchangeCost:
    """Allreduce of one buffer of B = bytes_per_element·n bytes (:func:`allreduce_terms`): the ring,
    T = 2(N-1)·alpha + 2(N-1)/N·B·beta (received 2(N-1)/N·B per rank, 2(N-1) messages), or, where the
    network's ``allreduce`` setting allows it and it is faster, the tree, T = 2·ceil(log2 N)·alpha + 2·B·beta
    (received 2B, 2·ceil(log2 N) messages).
    """
    ns = _sizes(sizes)
    n, N = sum(ns), int(workers)
    method = {4: FP32, 2: FP16}.get(bytes_per_element, f"allreduce{8 * bytes_per_element}")
    if N <= 1:
        return ExchangeCost(method, 0.0, 0.0, 0, n)
    t, received, messages = _allreduce(bytes_per_element * n, N, network.link_for(N))
    return ExchangeCost(method, t, received, messages, n)


def fp32_allreduce_cost(sizes: int | Sequence[int], workers: int, network: Network) -> ExchangeCost:
    """fp32 allreduce: min(ring 2(N-1)·alpha + 2(N-1)/N·4n·beta, tree 2·ceil(log2 N)·alpha + 2·4n·beta)."""
    return allreduce_cost(sizes, workers, network, 4)


def fp16_allreduce_cost(sizes: int | Sequence[int], workers: int, network: Network) -> ExchangeCost:
    """fp16 allreduce: min(ring 2(N-1)·alpha + 2(N-1)/N·2n·beta, tree 2·ceil(log2 N)·alpha + 2·2n·beta)."""
    return allreduce_cost(sizes, workers, network, 2)


def terngrad_allgather_cost(sizes: int | Sequence[int], workers: int, network: Network,
                            packing: str = "2bit", bucket_size: int = 0,
                            shared_scaler: bool = True) -> ExchangeCost:
    """TernGrad allgather exchange of one group of tensors n_1..n_k.

    P = sum_i payload_size(n_i);  T = (N-1)·alpha + (N-1)·P·beta + the handshake, an allreduce of H = the
    group's handshake bytes (:func:`allreduce_terms`; ring: 2(N-1)·alpha + 2(N-1)/N·H·beta, received
    2(N-1)/N·H; tree, which the small H gets at large N: 2·ceil(log2 N)·alpha + 2·H·beta, received 2H).
    Received bytes per rank: (N-1)·P + the handshake's.  Messages: (N-1) + the handshake's (ring: 2(N-1)).
    ``shared_scaler=False`` (per-rank scalers): no handshake terms, T = (N-1)·alpha + (N-1)·P·beta.
    """
    ns = _sizes(sizes)
    n, N = sum(ns), int(workers)
    if N <= 1:
        return ExchangeCost(TERNGRAD_ALLGATHER, 0.0, 0.0, 0, n)
    link = network.link_for(N)
    P = sum(wire.payload_size(x, packing, bucket_size) for x in ns)
    hs_t, hs_b, hs_m = _handshake(ns, bucket_size, N, link) if shared_scaler else (0.0, 0.0, 0)
    return ExchangeCost(TERNGRAD_ALLGATHER, ring_allgather_time(P, N, link) + hs_t, (N - 1) * P + hs_b,
                        _stages(N, link) + hs_m, n)


def sharded_bytes(sizes: Sequence[int], workers: int, packing: str = "2bit") -> tuple[int, int]:
    """(c, P_sum) of a sharded group: the most code bytes any rank receives from one peer (its slice of
    every member) and the most packed-sum bytes any owner contributes to the allgather."""
    N = int(workers)
    codes = [wire.shard_code_bytes(x, N, packing) for x in sizes]
    sums = [wire.shard_sum_bytes(x, N) for x in sizes]
    c = max((sum(m[r] for m in codes) for r in range(N)), default=0)
    p_sum = max((sum(m[r] for m in sums) for r in range(N)), default=0)
    return c, p_sum


def terngrad_sharded_cost(sizes: int | Sequence[int], workers: int, network: Network,
                          packing: str = "2bit", bucket_size: int = 0) -> ExchangeCost:
    """TernGrad sharded exchange (reduce-scatter by alltoall, then allgather of L-bit sums).

    Every member of the group is sharded on its own, as the engine does (:func:`sharded_bytes`);
    T = alltoall(c) + (N-1)·alpha + (N-1)·P_sum·beta + handshake (an allreduce of H bytes: ring
    2(N-1)·alpha + 2(N-1)/N·H·beta, or the tree where it is faster, as :func:`allreduce_terms`).
    Received bytes per rank: (N-1)·(c + P_sum) + the handshake's ~ (N-1)/N·n·(b + L)/8.  Messages: 2(N-1)
    + the handshake's (ring: 4(N-1) in all).
    """
    ns = _sizes(sizes)
    n, N = sum(ns), int(workers)
    if N <= 1:
        return ExchangeCost(TERNGRAD_SHARDED, 0.0, 0.0, 0, n)
    link = network.link_for(N)
    c, P_sum = sharded_bytes(ns, N, packing)
    hs_t, hs_b, hs_m = _handshake(ns, bucket_size, N, link)
    G = network.ranks_per_node if link is network else N
    t = alltoall_time(c, N, link, G) + ring_allgather_time(P_sum, N, link) + hs_t
    return ExchangeCost(TERNGRAD_SHARDED, t, (N - 1) * (c + P_sum) + hs_b, 2 * _stages(N, link) + hs_m, n)


def reternarized_bytes(sizes: Sequence[int], workers: int, packing: str = "2bit", bucket_size: int = 0,
                       first: str | None = None) -> int:
    """The most bytes of one group any owner receives from one peer, and hands the allgather, in the
    re-ternarized exchange: its shard's payload of every member (codec.sizes.reternarized_chunk_bytes; the first
    stage in ``first``'s format, ``packing``'s by default: TernGradConfig.first_stage_format), the larger of the
    two stages' (equal where the formats' sizes are)."""
    N = int(workers)

    def most(fmt: str) -> int:
        chunks = [wire.reternarized_chunk_bytes(x, N, fmt, bucket_size) for x in sizes]
        return max((sum(m[r] for m in chunks) for r in range(N)), default=0)
    return max(most(packing), most(first or packing))


def terngrad_reternarized_cost(sizes: int | Sequence[int], workers: int, network: Network,
                               packing: str = "2bit", bucket_size: int = 0,
                               shared_scaler: bool = False, first: str | None = None) -> ExchangeCost:
    """TernGrad re-ternarized exchange (exchange/reternarized.py): alltoall of each shard's payload to its owner,
    allgather of the owners' re-ternarized payloads.  With c = :func:`reternarized_bytes`,
    T = alltoall(c) + (N-1)·alpha + (N-1)·c·beta (+ the handshake with ``shared_scaler``).  Received bytes per
    rank: 2·(N-1)·c ~ 2·(N-1)/N·n·b/8, flat in N.  Messages: 2(N-1) (ring).  Owners' decode and encode of their
    shard are codec time, not charged here (as no exchange's codec is)."""
    ns = _sizes(sizes)
    n, N = sum(ns), int(workers)
    if N <= 1:
        return ExchangeCost(TERNGRAD_RETERNARIZED, 0.0, 0.0, 0, n)
    link = network.link_for(N)
    c = reternarized_bytes(ns, N, packing, bucket_size, first)
    enc = [wire.reternarized_encode_bucket(x, N, bucket_size) for x in ns]
    hs_t, hs_b, hs_m = (_allreduce(wire.handshake_size([wire.num_buckets(x, b) for x, b in zip(ns, enc)]), N, link)
                        if shared_scaler else (0.0, 0.0, 0))
    G = network.ranks_per_node if link is network else N
    t = alltoall_time(c, N, link, G) + ring_allgather_time(c, N, link) + hs_t
    return ExchangeCost(TERNGRAD_RETERNARIZED, t, 2 * (N - 1) * c + hs_b, 2 * _stages(N, link) + hs_m, n)


def requantized_bytes(sizes: Sequence[int], workers: int, packing: str = "2bit", bucket_size: int = 0,
                      noise: bool = True, first: str | None = None) -> tuple[int, int]:
    """(c, P): the most bytes of one group any owner receives from one peer in the alltoall (the re-ternarized
    exchange's first stage; with ``noise``, each shard with the sender's squares, codec/squares.py), and the most
    any owner hands the allgather (its shard of every member in 4-bit groups, with the noise channel if ``noise``:
    codec.sizes.requantized_owner_chunk_bytes).  ``first``: the first stage's format where it is not ``packing``
    (TernGradConfig.first_stage_format)."""
    N = int(workers)
    up = [wire.reternarized_chunk_bytes(x, N, first or packing, bucket_size, squares=noise) for x in sizes]
    down = [wire.requantized_owner_chunk_bytes(x, N, noise, bucket_size) for x in sizes]
    return (max((sum(m[r] for m in up) for r in range(N)), default=0),
            max((sum(m[r] for m in down) for r in range(N)), default=0))


def terngrad_requantized_cost(sizes: int | Sequence[int], workers: int, network: Network,
                              packing: str = "2bit", bucket_size: int = 0, noise: bool = True,
                              first: str | None = None) -> ExchangeCost:
    """TernGrad requantized exchange (exchange/requantized.py): alltoall of each shard's ternary payload to its
    owner, allgather of the owners' 4-bit averages (and, with ``noise``, the noise channel: the default, as
    horovod_terngrad.optim asks for it).  With (c, P) = :func:`requantized_bytes`,
    T = alltoall(c) + (N-1)·alpha + (N-1)·P·beta.  Received bytes per rank (N-1)·(c + P) ~ (N-1)/N·n·(b + 4.25
    [+ 1.25])/8, flat in N.  Messages 2(N-1) (ring).  Per-rank scalers: no handshake."""
    ns = _sizes(sizes)
    n, N = sum(ns), int(workers)
    if N <= 1:
        return ExchangeCost(TERNGRAD_REQUANTIZED, 0.0, 0.0, 0, n)
    link = network.link_for(N)
    c, P = requantized_bytes(ns, N, packing, bucket_size, noise, first)
    G = network.ranks_per_node if link is network else N
    t = alltoall_time(c, N, link, G) + ring_allgather_time(P, N, link)
    return ExchangeCost(TERNGRAD_REQUANTIZED, t, (N - 1) * (c + P), 2 * _stages(N, link), n)


def owner_step_bytes(sizes: Sequence[int], workers: int, packing: str = "base3", bucket_size: int = 0,
                     noise: bool = True, weight_bucket: int = 0, first: str | None = None) -> tuple[int, int]:
    """(c, P) of the owner-step exchange (exchange/owner_step.py) of ternarized tensors of these sizes, all fused
    in one step: the most bytes any owner receives from one peer in the gradients' alltoall (the re-ternarized
    exchange's first stage; with ``noise``, each shard with the sender's squares trailer:
    codec.sizes.reternarized_chunk_bytes) and the most any owner hands the weights' allgather (its shards' ternary
    weight differences, one scaler per ``weight_bucket`` elements or per shard:
    codec.sizes.owner_step_weight_chunk_bytes).  ``first``: the gradients' format where it is not ``packing``
    (TernGradConfig.first_stage_format("requantized"): the four-level code's 2 bits)."""
    N = int(workers)
    up = [wire.reternarized_chunk_bytes(x, N, first or packing, bucket_size, squares=noise) for x in sizes]
    down = [wire.owner_step_weight_chunk_bytes(x, N, packing, bucket_size, weight_bucket) for x in sizes]
    return (max((sum(m[r] for m in up) for r in range(N)), default=0),
            max((sum(m[r] for m in down) for r in range(N)), default=0))


OWNER_STEP_FLAG_BYTES = 8      #: the owner-step exchange's nonfinite flag per ternarized tensor (fp64, max-reduced)


def terngrad_owner_step_cost(sizes: int | Sequence[int], workers: int, network: Network, packing: str = "base3",
                             bucket_size: int = 0, noise: bool = True,
                             exact: Sequence[int] = (), weight_bucket: int = 0,
                             first: str | None = None) -> ExchangeCost:
    """The owner-step exchange of one step (``optim.OwnerStepOptimizer``, exchange/owner_step.py): ``sizes`` the
    ternarized tensors, ``exact`` the full-precision ones (the config's ``min_numel`` and ``exclude``).  With
    (c, P) = :func:`owner_step_bytes`:

    T = alltoall(c) + (N-1)·alpha + (N-1)·P·beta + allreduce(8·k)  [+ (N-1)·alpha + (N-1)·4·n_exact·beta]

    the gradients' alltoall to the owners, the owners' weight differences by allgather, one allreduce-max of the
    k tensors' fp64 nonfinite flags, and, where there are full-precision tensors, one fp32 allgather of them (each
    rank sums the N rows in rank order).  Received bytes per rank: (N-1)·(c + P) + the flags' + (N-1)·4·n_exact,
    about (N-1)/N·2b bits per ternarized element (3.2 base-3) plus 52 bytes per shard and sender (header, scaler,
    squares), and with ``weight_bucket`` K (``OwnerStepOptimizer(weight_bucket_size=K)``) (N-1)/N·32/K bits more for
    the weight differences' scalers.  Messages 2(N-1) (+ the flags', + N-1).  Per-rank scalers: no handshake, no presence check.
    ``max_grad_norm``'s 8-byte allgather of the norm is not charged.  The owners' optimizer step is not charged
    (no method's optimizer is)."""
    ns, ex = _sizes(sizes), _sizes(list(exact))
    N = int(workers)
    n = sum(ns) + sum(ex)
    if N <= 1:
        return ExchangeCost(TERNGRAD_OWNER_STEP, 0.0, 0.0, 0, n)
    link = network.link_for(N)
    G = network.ranks_per_node if link is network else N
    t, received, messages = 0.0, 0.0, 0
    if ns:
        c, P = owner_step_bytes(ns, N, packing, bucket_size, noise, weight_bucket, first)
        flag_t, flag_b, flag_m = _allreduce(OWNER_STEP_FLAG_BYTES * len(ns), N, link)
        t += alltoall_time(c, N, link, G) + ring_allgather_time(P, N, link) + flag_t
        received += (N - 1) * (c + P) + flag_b
        messages += 2 * _stages(N, link) + flag_m
    if ex:
        t += ring_allgather_time(4 * sum(ex), N, link)
        received += (N - 1) * 4 * sum(ex)
        messages += _stages(N, link)
    return ExchangeCost(TERNGRAD_OWNER_STEP, t, received, messages, n)


_COST_FUNCTIONS = {
    FP32: lambda s, N, net, packing, bucket_size, shared: fp32_allreduce_cost(s, N, net),
    FP16: lambda s, N, net, packing, bucket_size, shared: fp16_allreduce_cost(s, N, net),
    TERNGRAD_ALLGATHER: terngrad_allgather_cost,
    # the sharded exchange always shares the scaler (owners add codes of one scale)
    TERNGRAD_SHARDED: lambda s, N, net, packing, bucket_size, shared: terngrad_sharded_cost(s, N, net, packing,
                                                                                            bucket_size),
    # per-rank scalers unless set otherwise (its default): no handshake
    TERNGRAD_RETERNARIZED: lambda s, N, net, packing, bucket_size, shared: terngrad_reternarized_cost(
        s, N, net, packing, bucket_size, False),
    TERNGRAD_REQUANTIZED: lambda s, N, net, packing, bucket_size, shared: terngrad_requantized_cost(
        s, N, net, packing, bucket_size),
    # the ternarized tensors alone, with the noise estimate's squares (OwnerStepOptimizer's default AdamW asks it)
    TERNGRAD_OWNER_STEP: lambda s, N, net, packing, bucket_size, shared: terngrad_owner_step_cost(
        s, N, net, packing, bucket_size),
}


@dataclass(frozen=True)
class ExchangeChoice:
    """What :func:`cheapest_method` decided: the method, its cost and every candidate's cost."""

    method: str
    cost: ExchangeCost
    costs: dict


def method_cost(method: str, sizes: int | Sequence[int], workers: int, network: Network,
                  packing: str = "2bit", bucket_size: int = 0, shared_scaler: bool = True) -> ExchangeCost:
    """Cost of one buffer under ``method`` (one of :data:`METHODS`; "terngrad" = the cheaper TernGrad).
    ``shared_scaler`` is the allgather's scaler setting (``TernGradConfig.scaler_shared_for("allgather")``)."""
    if method == TERNGRAD_BEST:
        return cheapest_method(sizes, workers, network, packing, candidates=cheapest_candidates(workers),
                               bucket_size=bucket_size, shared_scaler=shared_scaler).cost
    if method not in _COST_FUNCTIONS:
        raise ValueError(f"method must be one of "
                         f"{METHODS + (TERNGRAD_RETERNARIZED, TERNGRAD_REQUANTIZED, TERNGRAD_OWNER_STEP)}, "
                         f"got {method!r}")
    return _COST_FUNCTIONS[method](sizes, workers, network, packing, bucket_size, shared_scaler)


def cheapest_method(sizes: int | Sequence[int], workers: int, network: Network, packing: str = "2bit",
                    candidates: Sequence[str] = TERNGRAD_EXCHANGES, bucket_size: int = 0,
                    shared_scaler: bool = True) -> ExchangeChoice:
    """Pick the cheapest of ``candidates`` (methods, by modelled time) for one tensor or fused buffer.

    ``sizes``: n (one tensor) or the element counts of the tensors fused in the buffer.  By default it
    weighs the allgather and sharded transports (:data:`TERNGRAD_EXCHANGES`; the engine's candidates are the
    policy's, :func:`cheapest_transport`); pass ``candidates=METHODS[:4]`` to let fp32/fp16 allreduce compete too.  Ties go to the earlier
    candidate (allgather first: fewer messages).  ``shared_scaler``: the allgather's scaler setting (the
    sharded exchange always has a handshake).  Cost: O(k) for k tensors.
    """
    costs = {m: method_cost(m, sizes, workers, network, packing, bucket_size, shared_scaler) for m in candidates}
    best = min(candidates, key=lambda m: (costs[m].time_s, candidates.index(m)))
    return ExchangeChoice(best, costs[best], costs)


def cross_network(network: Network, ranks_per_node: int) -> Network:
    """The inter-node link as each of a node's G = ``ranks_per_node`` ranks sees it in the hierarchical
    exchange: all G cross groups use the node's one link at once, so each gets a G-th of its bandwidth
    (one rank per link, no intra-node link).  The transport decides its cross exchange on this link."""
    G = max(1, int(ranks_per_node))
    return replace(network, bandwidth_Bps=network.bandwidth_Bps / G, ranks_per_node=1, intra_node=None)


def _flat_terngrad_cost(ns: list, workers: int, network: Network, packing: str, bucket_size: int,
                        shared_scaler: bool, transport: str | None) -> ExchangeCost:
    """The flat exchange of one group on all ranks by ``transport``: "allgather", "sharded", "reternarized",
    "requantized", or None (the cheapest of :data:`NOISE_TRANSPORTS`, as :func:`cheapest_transport` picks it)."""
    N = int(workers)
    if transport is None:
        transport = cheapest_transport(ns, N, packing, bucket_size, network=network, shared_scaler=shared_scaler)
    if transport not in TRANSPORTS:      # a setting's name ("default", ...) is policy.py's to resolve
        raise ValueError(f"transport must be one of {TRANSPORTS} or None, got {transport!r}")
    if transport == "sharded":
        return terngrad_sharded_cost(ns, N, network, packing, bucket_size)
    if transport == "reternarized":
        return terngrad_reternarized_cost(ns, N, network, packing, bucket_size)
    if transport == "requantized":
        return terngrad_requantized_cost(ns, N, network, packing, bucket_size)
    return terngrad_allgather_cost(ns, N, network, packing, bucket_size, shared_scaler)


def hierarchical_cost(sizes: int | Sequence[int], nodes: int, ranks_per_node: int, network: Network,
                      packing: str = "2bit", bucket_size: int = 0, shared_scaler: bool = False,
                      cross: str | None = None, intra_width: int = 4) -> ExchangeCost:
    """The node-aware exchange (exchange/hierarchical.py) of one group on M = ``nodes`` nodes of G =
    ``ranks_per_node`` ranks (``topology.shard_plan``: local rank j owns shard j's pieces):

    T = alltoall(c, G ranks, intra) + max_j T_cross(pieces of shard j, M ranks, cross link) + allgather(P, G, intra)

    * c, P = ``topology.intra_node_bytes`` at ``intra_width`` bytes per element (4: fp32, 2: bf16,
      ``TernGradConfig.intra_node_width``): the largest shard each rank sends each local peer, and
      the largest averaged shard plus one status word per piece; alltoall and allgather on G ranks of
      ``network.intra_node`` (``network`` itself if None): (G-1)·alpha + (G-1)·c·beta and
      (G-1)·alpha + (G-1)·P·beta through one port; with L = min(peer_links, G-1) links per rank (a fully
      connected node) ceil((G-1)/L)·alpha + (G-1)/L·c·beta and the same with P;
    * T_cross: the TernGrad exchange of local rank j's pieces (each its own tensor: payload_size per
      piece) among the M ranks of its cross group, on :func:`cross_network` (the inter-node link at a G-th
      of its bandwidth: all G local ranks cross the node's link at once); ``cross`` the transport
      ("allgather", scaler per ``shared_scaler``; "sharded", "reternarized", "requantized") or None (each
      rank takes the cheapest for its own pieces, as :func:`cheapest_transport` on M ranks).  The slowest
      local rank sets the time.

    Bytes received: the slowest local rank's cross exchange (what it takes of the node's link; the node's
    link carries G times that); the fp32 bytes inside the node are ``topology.intra_node_bytes``'s.
    Messages (latency terms): 2(G-1) inside the node (2·ceil((G-1)/L) with L peer links) plus the cross
    exchange's.  With M < 2 or G < 2 the hierarchy does
    not apply (topology.Topology.flat_reason) and the runtime exchanges flat on all M·G ranks: this returns
    that flat exchange's cost (``cross`` picks it).  Per step, the Horovod frontend adds two 4-byte
    allreduces on every rank (:func:`presence_cost`: the presence check and the end-of-step sync)."""
    ns = _sizes(sizes)
    n, M, G = sum(ns), int(nodes), int(ranks_per_node)
    if M < 1 or G < 1:
        raise ValueError("nodes and ranks_per_node must be >= 1")
    if M < 2 or G < 2:
        flat_net = replace(network, ranks_per_node=G)
        return _flat_terngrad_cost(ns, M * G, flat_net, packing, bucket_size, shared_scaler, cross)
    intra = network.intra_node or network
    link = cross_network(network, G)
    c, P = topology.intra_node_bytes(ns, G, intra_width)
    t_local = alltoall_time(c, G, intra, G) + ring_allgather_time(P, G, intra)
    worst = None
    for pieces in topology.shard_plan(ns, G):
        sizes_j = [p.numel for p in pieces]
        if not sizes_j:
            cost_j = ExchangeCost(TERNGRAD_ALLGATHER, 0.0, 0.0, 0, 0)
        else:
            cost_j = _flat_terngrad_cost(sizes_j, M, link, packing, bucket_size, shared_scaler, cross)
        if worst is None or cost_j.time_s > worst.time_s:
            worst = cost_j
    return ExchangeCost(TERNGRAD_HIERARCHICAL, t_local + worst.time_s, worst.bytes_received,
                        2 * _stages(G, intra) + worst.messages, n)


_SAME = object()     # hierarchy_for / hierarchy_plan: the cross transport is the flat one


def hierarchy_for(numels: Sequence[int], nodes: int, ranks_per_node: int, packing: str = "2bit",
                  bucket_size: int = 0, network: Network | None = None, shared_scaler: bool = False,
                  transport: str | None = None, step_allreduces: int = 0, intra_width: int = 4,
                  cross_transport=_SAME) -> bool:
    """Whether the node-aware exchange (:func:`hierarchical_cost`) is cheaper
    than the flat TernGrad exchange on all N = M·G ranks (G of them per node sharing its link: the
    collectives' formulas on the inter-node link, the alltoall's G·(N-G) bytes per link) for a group of these sizes.
    ``transport``: the flat exchange's transport ("allgather", "sharded", "reternarized", "requantized"; None:
    the cheapest, :func:`cheapest_transport`); ``cross_transport`` the one across nodes (default: the same).
    ``network``: the inter-node link with its
    ``intra_node`` link (default: :func:`configured_network`).  ``step_allreduces``: the 4-byte allreduces
    of all ranks the node-aware engine adds to a step that uses it (Horovod frontend: 2, its presence
    check and end-of-step sync; DDP: 0); the group must save their time (:func:`presence_cost` each) on
    its own, so that a step of groups each decided this way is never slower than the flat step.  False
    where the hierarchy cannot apply (M < 2 or G < 2)."""
    M, G = int(nodes), int(ranks_per_node)
    if M < 2 or G < 2:
        return False
    cross = transport if cross_transport is _SAME else cross_transport
    net = replace(network or configured_network(G), ranks_per_node=G)
    ns = _sizes(numels)
    flat = _flat_terngrad_cost(ns, M * G, net, packing, bucket_size, shared_scaler, transport)
    overhead = int(step_allreduces) * presence_cost(M * G, net).time_s
    return hierarchical_cost(ns, M, G, net, packing, bucket_size, shared_scaler, cross,
                             intra_width).time_s + overhead < flat.time_s


def hierarchy_plan(groups: Sequence[Sequence[int]], nodes: int, ranks_per_node: int, packing: str = "2bit",
                   bucket_size: int = 0, network: Network | None = None, shared_scaler: bool = False,
                   transport: str | None = None, step_allreduces: int = 0, intra_width: int = 4,
                   cross_transport=_SAME) -> list[bool]:
    """:func:`hierarchy_for` for a whole step of groups (element counts of each group's members) known in
    advance: the groups the node-aware exchange makes faster than the flat one go node-aware, if together
    they save more than the ``step_allreduces`` 4-byte allreduces it adds to the step (see
    :func:`hierarchy_for`); else none does.  The step is then never slower than flat in this model.
    O(tensors·G)."""
    M, G = int(nodes), int(ranks_per_node)
    if M < 2 or G < 2:
        return [False] * len(groups)
    cross = transport if cross_transport is _SAME else cross_transport
    net = replace(network or configured_network(G), ranks_per_node=G)
    saved, out = 0.0, []
    for g in groups:
        ns = _sizes(g)
        d = (_flat_terngrad_cost(ns, M * G, net, packing, bucket_size, shared_scaler, transport).time_s
             - hierarchical_cost(ns, M, G, net, packing, bucket_size, shared_scaler, cross, intra_width).time_s)
        out.append(d > 0)
        saved += max(d, 0.0)
    if saved <= int(step_allreduces) * presence_cost(M * G, net).time_s:
        return [False] * len(groups)
    return out


def cheapest_transport(numels: Sequence[int], n_ranks: int, packing: str, bucket_size: int = 0,
                       network: Network | None = None, shared_scaler: bool = False,
                       candidates: Sequence[str] = NOISE_TRANSPORTS) -> str:
    """The transport ('allgather', 'requantized', ...: ``names.TRANSPORTS``) of ``candidates`` (methods,
    default :data:`NOISE_TRANSPORTS`) this model predicts to be fastest for a group of tensors of these sizes on
    ``network`` (default :func:`configured_network`).  With two ranks or fewer sharding cannot receive less and
    costs one more collective: the allgather (:func:`cheapest_candidates`).  ``shared_scaler``: whether an
    allgather group would share its scaler (``TernGradConfig.scaler_shared_for("allgather")``; False charges it
    no handshake)."""
    if n_ranks <= 2:
        return "allgather"
    choice = cheapest_method(list(numels), n_ranks, network or configured_network(), packing,
                             candidates=tuple(candidates), bucket_size=bucket_size, shared_scaler=shared_scaler)
    return transport_of(choice.method)


def cheapest_candidates(workers: int, candidates: Sequence[str] = NOISE_TRANSPORTS) -> tuple:
    """The methods :func:`cheapest_transport` weighs among ``workers`` ranks: the allgather alone at two ranks or
    fewer, else ``candidates``."""
    return (TERNGRAD_ALLGATHER,) if int(workers) <= 2 else tuple(candidates)
