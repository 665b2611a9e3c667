"""Performance model of data-parallel training with and without TernGrad (paper §5, Fig. 5).

The paper (Wen et al., NeurIPS 2017, §5) predicts training throughput up to 512 GPUs by combining a
single-GPU profile with an analytical model of communication.  Its own model is a parameter-server model
described in the supplementary material; this module is the same idea for the exchanges this project
runs (ring collectives, as Horovod does), with an alpha-beta network.

One model of the system: every size on the wire comes from ``codec/sizes.py`` and every collective time,
exchange cost and exchange choice from ``exchange/cost.py`` (the runtime cost model the engine itself
uses for ``exchange="auto"``); TernGrad's fusion groups are ``exchange/fusion.py``'s cut, the one the
Horovod frontend makes.  This module adds the step model, the paper's networks and clusters, and the CLI;
the names of ``exchange/cost.py`` stay available here (``perfmodel.Network``, ``perfmodel.cheapest_method``...).

Step time (one iteration, every worker, weak scaling: fixed batch per worker)
-----------------------------------------------------------------------------
    T_step = T_compute + T_comm + T_codec - min(T_comm + T_codec, overlap · T_compute)

* ``T_compute``: forward + backward of one worker's batch (measured with :func:`profile_compute`, or
  taken from published single-GPU timings, see :data:`MODELS`).
* ``T_comm``: sum over the buffers of :func:`exchange_plan` of each one's exchange time (below).
* ``T_codec``: optional; ternarize/pack/decode work divided by a rate (elements/s) you give.  Off
  (0) unless ``codec_elements_per_s`` is set.
* ``overlap``: fraction of the compute time during which communication can run concurrently.  The basic
  model (the default, overlap = 0) does NOT overlap communication with compute; overlap = 1 gives
  max(T_compute, T_comm + T_codec).

Images/s on N workers = N · batch_per_worker / T_step.  Speedup of a method = T_step(fp32) / T_step(method)
at the same N.

Network: alpha-beta (exchange/cost.py)
--------------------------------------
A message of m bytes over one link costs alpha + m·beta (alpha: latency per message in s, beta =
1/bandwidth in s/byte).  For N ranks and one buffer (per rank; every rank sends as many bytes as it
receives, so "bytes" below is what crosses each rank's link in each direction):

* allreduce of B bytes, the cheaper of (as NCCL, Open MPI and gloo pick per message size; the network's
  ``allreduce="ring"`` charges the ring only):
      ring:  T = 2(N-1)·alpha + 2(N-1)/N · B · beta
      tree:  T = 2·ceil(log2 N)·alpha + 2 · B · beta      (a bandwidth term never better than the ring's)
      fp32: B = 4n;  fp16: B = 2n.
* ring allgather of P bytes/rank:  T = (N-1)·alpha + (N-1) · P · beta
* pairwise alltoall, c bytes to each peer:  T = (N-1)·alpha + (N-1) · c · beta
* inside a fully connected node (``Network.peer_links`` = K links per rank, NVLink: 3) L = min(K, N-1)
  peers are reached at once: the allgather and alltoall take ceil((N-1)/L)·alpha + (N-1)/L·(P or c)·beta,
  an allreduce runs L link-disjoint rings (bandwidth term / L).

TernGrad exchanges of a group of tensors of n_1..n_k elements (a lone tensor: k = 1), packing of b bits
per element (b = 2 for "2bit", 4 codes a byte; b = 1.6 for "base3", 5 codes a byte), B_i scalers per
member (1 layer-wise; ceil(n_i/bucket_size) with buckets).  Sizes are ``codec/sizes.py``'s:

* handshake (shared scaler): one allreduce of H bytes of fp64 slots, H = handshake_size:
      H = 8·(8 + B) for a lone tensor (72 bytes layer-wise),
      H = 8·(4 + 2k + sum_i B_i) for k fused tensors (32 + 24k layer-wise);
* allgather exchange (``exchange/allgather.py``): each rank's payload is
      P = sum_i payload_size(n_i) = sum_i (20 + 4·B_i + ceil(n_i·b/8))   (header, fp32 scalers, codes)
  sent by ring allgather, plus the handshake if the scaler is shared:
      T = (N-1)·alpha + (N-1)·P·beta  +  allreduce(H)   (ring 2(N-1)·alpha + 2(N-1)/N·H·beta, or tree)
  With per-rank scalers (the allgather's default: each payload carries its scaler) there is no handshake;
  the step pays one 4-byte presence allreduce instead, whatever the number of groups.
  Received bits per element ~ (N-1)·b: grows with N.
* sharded exchange (``exchange/sharded.py``): every member of the group is sharded on its own: rank r
  owns elements [r·m_i, (r+1)·m_i) of member i, m_i = ceil(n_i/N) rounded up to a multiple of 20 (so a
  shard starts on a byte of both packings; trailing shards may be short or empty).  One alltoall sends
  each owner its slice of every member's packed codes; the owner sums the N slices (integers in [-N, N])
  and packs the sums in L = ceil(log2(2N+1)) bits; one ring allgather returns every owner's sums of every
  member.  With the slowest rank setting the time (``exchange.cost.sharded_bytes``):
      c     = max_r sum_i code bytes of member i's shard r     (bytes to each peer)
      P_sum = max_r sum_i ceil(|shard r of member i| · L / 8)  (bytes per rank in the allgather)
      T = (N-1)·alpha + (N-1)·c·beta  +  (N-1)·alpha + (N-1)·P_sum·beta  +  handshake
  No headers in either stage (the scalers come from the handshake).  Received bits per element ~
  (N-1)/N · (b + L): 9.84 at N = 64 with 2-bit (L = 8), 12.97 at N = 512 (L = 11).
* re-ternarized and requantized exchanges (``exchange/reternarized.py``, ``exchange/requantized.py``): the same
  alltoall of each shard's ternary payload (c bytes to each peer, ``exchange.cost.reternarized_bytes``), then
  the owners' allgather of their shard: ternarized again (c bytes) or the exact average in 4-bit groups with the
  1-bit noise channel (P bytes, ``exchange.cost.requantized_bytes``): T = (N-1)·alpha + (N-1)·c·beta +
  (N-1)·alpha + (N-1)·(c or P)·beta, per-rank scalers (no handshake).  ~4 and ~7.5 bits per element at any N.
* owner-step (``optim.OwnerStepOptimizer``, :data:`TERNGRAD_OWNER_STEP`; ``exchange.cost.terngrad_owner_step_cost``):
  not an engine transport but the optimizer a user swaps in, which exchanges every parameter in one step: the
  ternarized tensors (``min_numel``, ``exclude``; no fusion cut) in one alltoall of shard payloads to their owners
  (c, the re-ternarized first stage with the squares trailer) and one allgather of the owners' ternary weight
  differences (P, one scaler per shard), one allreduce of the nonfinite flags, and the full-precision tensors in
  one fp32 allgather; flat on all N ranks (no node-aware stage), base-3 unless a config or ``packing`` says
  otherwise (its optimizer's default).  ~3.2 bits per element at any N (base-3) plus 52 bytes per shard and sender.
  The owners step 1/N of the parameters each, but no method's optimizer step is priced, so that saving is not in
  the model.
* the default, ``TernGradConfig()`` (:data:`TERNGRAD_DEFAULT`): ``exchange="default"`` =
  ``exchange.policy.default_transport(N)``, the allgather among N <= 4 ranks and the requantized exchange above
  (node-aware: of the cross group's M ranks), with ``hierarchical="auto"``.

Topology: ranks on a node share one NIC (``Network.ranks_per_node`` = G, placed contiguously).  A ring
crosses each node boundary once per direction, so ring formulas hold as written with the inter-node link
(a tree among nodes, likewise: NCCL chains the ranks of a node and builds its trees among nodes).
An alltoall pushes G·(N-G)·c bytes through each node's NIC, so its bandwidth term is
beta·max((N-1)·c, G·(N-G)·c).  When N <= G every hop is inside one node and the ``intra_node`` link
(PCIe switch, NVLink) is used instead, if given.  Switches are non-blocking; no congestion, no
stragglers, no contention between concurrent buffers (buffers are sent one after the other).

Buffers (:func:`exchange_plan`): fp32/fp16 tensors are fused by Horovod up to ``fusion_bytes`` on the
wire.  TernGrad tensors are cut by ``exchange.fusion.cut`` with a ``TernGradConfig`` (fusion_numel, and
exclude / min_numel: the tensors the policy keeps at full precision travel as fp32 allreduce buffers);
each group uses the method's exchange, or for "terngrad" (= ``exchange="auto"``) and "terngrad_default" the one
``exchange.policy.flat_plan`` picks for it (``auto_transport``: allgather or requantized; ``default_transport``),
exactly as the engine decides.

Crossovers these formulas give (one large tensor, 2-bit, shared scaler: fp32 by ring, the 72-byte
handshake by tree from N = 4 on): allgather is cheaper than the fp32 allreduce iff
n·(8/N - 1/4) > -alpha/beta·(1 - 2·ceil(log2 N)/(N-1)) + 24 + 144/(N-1),  so for large n it wins for
N <= 32 and loses for N >= 33 (bandwidth terms equal at N = 32: (N-1)·2 bits vs 2(N-1)/N·32 bits, where the
allgather has fewer latency terms); with base3 up to N = 40.  Rings only (``allreduce="ring"``):
n·(8/N - 1/4) > alpha/beta + 24 + 144/N, N <= 31 (base3 39).  Sharded
receives fewer bits than allgather from N = 3 on (b + L < N·b) but pays one more round of (N-1)·alpha, so
:func:`cheapest_method` picks allgather for small tensors or few workers and sharded for large N.

Costs of this module itself: every function is O(number of tensors · number of worker counts); nothing
here touches the network.  torch is imported only by :func:`profile_compute` (and a module passed to
:func:`tensor_sizes_of` brings its own); matplotlib only by ``modelling/plots.py``.

HSDP: modelling/hsdp.py's ``predict_hsdp_step`` / ``predict_hsdp`` price one step of a GPT (``GPT3_1P3B``,
every parameter tensor with its shape) under FSDP2 inside a node and fp32, bf16 or TernGrad averaging of each
rank's shard across nodes (frontends/fsdp.py), with the same step formula and overlap (0 by default) as above; the
math is in that module's docstring.  CLI:
``python -m horovod_terngrad.modelling hsdp [--cluster ...] [--workers 8,16,...] [--markdown]``.

CLI: ``python -m horovod_terngrad.modelling [--cluster ethernet|infiniband|both|custom ...]
[--model ...] [--max-workers 512] [--png docs/perfmodel/fig5.png]`` (see ``--help`` and docs/perfmodel.md).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from ..codec import sizes as wire
from ..config import TernGradConfig
from ..exchange import fusion, policy, topology
from ..exchange.cost import (  # noqa: F401 (the runtime cost model, re-exported as perfmodel.X)
    _COLLECTIVE_TIME, FP16, FP32, HOROVOD_FUSION_BYTES, METHODS, NOISE_TRANSPORTS,
    TERNGRAD_ALLGATHER, TERNGRAD_BEST, TERNGRAD_EXCHANGES, TERNGRAD_FUSION_NUMEL, TERNGRAD_HIERARCHICAL,
    TERNGRAD_OWNER_STEP, TERNGRAD_REQUANTIZED, TERNGRAD_RETERNARIZED, TERNGRAD_SHARDED, ExchangeChoice,
    ALLREDUCE_ALGORITHMS, ALLREDUCE_AUTO, ALLREDUCE_RING, ALLREDUCE_TREE, ExchangeCost, Network,
    allreduce_algorithm, allreduce_cost, allreduce_terms, allreduce_time, alltoall_time, calibrated_efficiency,
    cheapest_method,
    cheapest_transport, configured_network, cross_network, method_cost,
    fp16_allreduce_cost,
    fp32_allreduce_cost, hierarchical_cost, owner_step_bytes, ring_allgather_time, ring_allreduce_time,
    presence_cost, requantized_bytes, sharded_bytes, terngrad_allgather_cost, terngrad_owner_step_cost,
    terngrad_requantized_cost, terngrad_reternarized_cost, terngrad_sharded_cost, tree_allreduce_time)
from ..exchange.names import (TERNGRAD_DEFAULT, TERNGRAD_METHODS, method_of_transport,  # noqa: F401 (perfmodel.X)
                              setting_of, short, transport_of)
from ..exchange.policy import (  # noqa: F401 (the engine's policy, re-exported as perfmodel.X)
    AUTO_TRANSPORTS, DEFAULT_ALLGATHER_MAX_RANKS, auto_transport, default_transport)

# The paper's clusters (Fig. 5): 128 nodes of 4 GPUs each.  Inter-node bandwidth is the paper's; the
# latencies and the intra-node links are this model's assumptions (typical figures: ~50 us for TCP over
# 1 GbE, ~5 us for MPI over InfiniBand, ~10 GB/s through a PCIe 3.0 x16 switch, 20 GB/s per direction
# of one NVLink 1.0 link).  Inside an Ethernet node every GPU has one x16 port into the PCIe switch, which
# serializes its sends (peer_links 1); the InfiniBand node's four P100s are fully connected by NVLink
# (4 links per P100, one to each of the 3 others at least, as a DGX-1 quad), so a GPU reaches its 3
# peers over 3 links at once (peer_links 3).
PCIE_SWITCH = Network("pcie-switch", 10e-6, 10e9)
NVLINK = Network("nvlink", 5e-6, 20e9, peer_links=3)
ETHERNET_1G = Network.from_gbps("ethernet", 1.0, 50.0, ranks_per_node=4, intra_node=PCIE_SWITCH)
INFINIBAND_100G = Network.from_gbps("infiniband", 100.0, 5.0, ranks_per_node=4, intra_node=NVLINK)


# --------------------------------------------------------------------------------------------------
# Sizes on the wire, per rank and buffer: thin names for codec/sizes.py (no formulas here)
def packed_bytes(numel: int, packing: str = "2bit") -> int:
    """ceil(n·b/8): bytes of n ternary codes, 4 a byte ("2bit") or 5 a byte ("base3")."""
    return wire.packed_size(numel, packing)


def payload_bytes(numel: int, packing: str = "2bit", bucket_size: int = 0) -> int:
    """One tensor's TernGrad payload: header, fp32 scalers, packed codes (20 + 4 + ceil(n·b/8) layer-wise)."""
    return wire.payload_size(numel, packing, bucket_size)


def sum_bits(workers: int) -> int:
    """L = ceil(log2(2N+1)): bits to hold a sum of N ternary values (integers in [-N, N])."""
    return wire.sum_bits(workers)


def shard_numel(numel: int, workers: int) -> int:
    """Elements owned by the largest owner of one tensor in the sharded exchange (``codec.sizes.shard_bounds``:
    ceil(n/N) rounded up to a multiple of 20, at most n)."""
    return max((hi - lo for lo, hi in wire.shard_bounds(int(numel), int(workers))), default=0)


def handshake_bytes(tensors: int) -> int:
    """Shared-scaler handshake of a group of ``tensors`` layer-wise tensors (``codec.sizes.handshake_size``):
    72 bytes for a tensor alone, 32 + 24k for k fused tensors, 0 for none."""
    return wire.handshake_size([1] * int(tensors))


# --------------------------------------------------------------------------------------------------
# Buffers: how a model's gradients travel
def fuse_buffers(tensor_sizes: Sequence[int], fusion_bytes: int,
                 bytes_per_element: float = 4.0) -> list[list[int]]:
    """Group consecutive tensors into buffers of at most ``fusion_bytes`` (as Horovod's tensor fusion).

    A tensor larger than the threshold travels alone; ``fusion_bytes`` <= 0 gives one buffer per tensor.
    ``bytes_per_element`` is what the method puts on the wire (4 fp32, 2 fp16).
    """
    sizes = [int(s) for s in tensor_sizes]
    if fusion_bytes <= 0:
        return [[s] for s in sizes]
    buffers, current, current_bytes = [], [], 0.0
    for s in sizes:
        b = s * bytes_per_element
        if current and current_bytes + b > fusion_bytes:
            buffers.append(current)
            current, current_bytes = [], 0.0
        current.append(s)
        current_bytes += b
    if current:
        buffers.append(current)
    return buffers


def _fuse_indices(indices: Sequence[int], sizes: Sequence[int], fusion_bytes: int,
                  bytes_per_element: float) -> list[list[int]]:
    """:func:`fuse_buffers` of the tensors ``indices`` (in that order), as lists of indices."""
    out, pos = [], 0
    for buf in fuse_buffers([sizes[i] for i in indices], fusion_bytes, bytes_per_element):
        out.append(list(indices[pos:pos + len(buf)]))
        pos += len(buf)
    return out


#: the packing and first-stage code ``optim.OwnerStepOptimizer`` runs without a config of the user's:
#: ``TernGradConfig(packing="base3", levels=3)``
OWNER_STEP_PACKING = "base3"
OWNER_STEP_LEVELS = 3


def terngrad_config(config: TernGradConfig | None = None, packing: str | None = None,
                    fusion_numel: int | None = None, method: str | None = None) -> TernGradConfig:
    """The ``TernGradConfig`` a plan is cut and charged with: ``config`` (default ``TernGradConfig()``; for
    ``method`` :data:`TERNGRAD_OWNER_STEP` the optimizer's own default, base-3 packing), with ``fusion_numel`` and
    ``packing`` put in when given (a packing that contradicts an explicit ``config`` is refused rather than
    silently ignored)."""
    if config is None:
        owner = method == TERNGRAD_OWNER_STEP
        config = TernGradConfig(packing=packing or (OWNER_STEP_PACKING if owner else "2bit"),
                                levels=OWNER_STEP_LEVELS if owner else TernGradConfig.levels)
    elif packing is not None and packing != config.packing:
        raise ValueError(f"packing={packing!r} contradicts config.packing={config.packing!r}")
    if fusion_numel is not None:
        config = config.replace(fusion_numel=int(fusion_numel))
    return config


@dataclass(frozen=True)
class PlannedBuffer:
    """One buffer of :func:`plan_buffers`: the method that carries it (``TERNGRAD_ALLGATHER``, ...,
    ``TERNGRAD_HIERARCHICAL``, ``FP32``) and the tensors in it (indices into the model's ``tensor_sizes``, in the
    order they travel, and their sizes).  A node-aware group (``method == TERNGRAD_HIERARCHICAL``) has ``cross``:
    the setting across nodes (a transport's name, "default", or "auto", where each local rank picks for its
    pieces), which ``exchange.policy.transport_among`` resolves among the M nodes."""

    method: str
    members: tuple
    sizes: tuple
    cross: str | None = None
    bucket_size: int = 0      #: a flat buffer's configured buckets (``TernGradConfig.bucket_size``)
    #: an owner-step buffer's full-precision tensors (indices), which its one fp32 allgather carries
    exact: tuple = ()


#: 4-byte allreduces of all ranks that the node-aware engine adds to a step under the Horovod frontend
#: (its presence check and end-of-step sync), charged once per step that has a node-aware group.  (The
#: engine decides per group with them, ``policy.hierarchy_for(step_allreduces=...)``, as ``timeline_step`` plans;
#: ``plan_buffers`` weighs them when given ``step_allreduces``; ``exchange.policy.hierarchy_plan`` per step.)
HOROVOD_STEP_ALLREDUCES = 2

#: the methods of the CLI tables: fp32, fp16, what TernGradConfig() picks, and each TernGrad exchange
ALL_METHODS = (FP32, FP16, TERNGRAD_DEFAULT, TERNGRAD_ALLGATHER, TERNGRAD_SHARDED, TERNGRAD_BEST,
               TERNGRAD_RETERNARIZED, TERNGRAD_REQUANTIZED, TERNGRAD_OWNER_STEP)


def node_shape(workers: int, network: Network) -> tuple[int, int] | None:
    """(M nodes, G ranks per node) of a job of ``workers`` ranks placed contiguously on ``network``'s
    nodes of ``ranks_per_node``, or None where the node-aware exchange cannot apply
    (``topology.Topology.flat_reason``: one node, one rank per node, or nodes of different sizes)."""
    G = max(1, int(network.ranks_per_node))
    topo = topology.Topology.contiguous(int(workers), G)
    return None if topo.flat_reason() is not None else (topo.num_nodes, G)


def plan_buffers(method: str, tensor_sizes: Sequence[int], workers: int, network: Network,
                 packing: str | None = None, fusion_bytes: int = HOROVOD_FUSION_BYTES,
                 fusion_numel: int | None = None, *, config: TernGradConfig | None = None,
                 names: Sequence[str] | None = None, hierarchical=None, step_allreduces: int = 0,
                 ranks_per_node: int | None = None) -> list[PlannedBuffer]:
    """:func:`exchange_plan` with the tensors of each buffer (see there).

    ``step_allreduces``: the 4-byte world allreduces the node-aware engine adds to a step, which
    ``hierarchical="auto"`` weighs per group as the engine does (``exchange.policy.hierarchy_for``; the
    Horovod frontend's engine: :data:`HOROVOD_STEP_ALLREDUCES`, the DDP hook's: 0; default 0).
    ``ranks_per_node``: the job's nodes (default ``network.ranks_per_node``), where ``network`` is only
    what the engine decides with (``timeline_step``'s ``auto_network``).  ``TERNGRAD_OWNER_STEP``: one buffer, the
    tensors the config compresses, with the others in its ``exact`` (``hierarchical``, ``fusion_numel`` and the
    fusion threshold do not apply: the optimizer fuses every parameter and exchanges flat)."""
    sizes = [int(x) for x in tensor_sizes]
    if method in (FP32, FP16):
        width = 4.0 if method == FP32 else 2.0
        return [PlannedBuffer(method, tuple(b), tuple(sizes[i] for i in b))
                for b in _fuse_indices(list(range(len(sizes))), sizes, fusion_bytes, width)]
    if method == TERNGRAD_OWNER_STEP:
        return [_owner_step_buffer(sizes, workers, terngrad_config(config, packing, method=method),
                                   _tensor_names(names, sizes))]
    if method not in TERNGRAD_METHODS:
        raise ValueError(f"method must be one of {(FP32, FP16, TERNGRAD_OWNER_STEP) + TERNGRAD_METHODS}, "
                         f"got {method!r}")
    cfg = terngrad_config(config, packing, fusion_numel)
    if hierarchical is not None:
        cfg = cfg.replace(hierarchical=hierarchical)
    nodes = network if ranks_per_node is None else replace(network, ranks_per_node=int(ranks_per_node))
    shape = node_shape(workers, nodes) if cfg.hierarchical is not False else None
    shared = cfg.scaler_shared_for("allgather")
    setting = setting_of(method)
    flat = policy.transport_among(setting, int(workers))    # None: "auto", which decides per group
    auto_cfg = cfg.replace(exchange=setting) if flat is None else None
    names = _tensor_names(names, sizes)
    index = {n: i for i, n in enumerate(names)}
    cut = fusion.cut_sizes(sizes, cfg, names)
    out = []
    for group in cut.groups:
        members = tuple(index[n] for n in group)
        numels = [sizes[i] for i in members]
        if shape is not None and (cfg.hierarchical is True or policy.hierarchy_for(
                setting, numels, *shape, cfg.packing, cfg.bucket_size, network=network, shared_scaler=shared,
                step_allreduces=step_allreduces,
                intra_width=cfg.intra_node_width)):   # node-aware, as the engine decides
            out.append(PlannedBuffer(TERNGRAD_HIERARCHICAL, members, tuple(numels), setting))
            continue
        transport = flat or policy.flat_plan(auto_cfg, numels, int(workers), network=network).transport
        out.append(PlannedBuffer(method_of_transport(transport), members, tuple(numels),
                                 bucket_size=cfg.bucket_size))
    # tensors the policy keeps at full precision: Horovod's own fp32 allreduce, fused by its threshold
    plain = [index[n] for n in cut.uncompressed]
    out += [PlannedBuffer(FP32, tuple(b), tuple(sizes[i] for i in b))
            for b in _fuse_indices(plain, sizes, fusion_bytes, 4.0)]
    return out


def _tensor_names(names: Sequence[str] | None, sizes: Sequence[int]) -> list[str]:
    """The tensors' names ("0", "1", ... where none are given), checked distinct and one per tensor."""
    names = [str(i) for i in range(len(sizes))] if names is None else [str(n) for n in names]
    if len(names) != len(sizes) or len(set(names)) != len(names):
        raise ValueError(f"names must be {len(sizes)} distinct names, one per tensor")
    return names


def _owner_step_buffer(sizes: list, workers: int, cfg: TernGradConfig, names: list) -> PlannedBuffer:
    """``optim.OwnerStepOptimizer``'s one exchange of a step: the tensors ``cfg`` compresses (``min_numel``,
    ``exclude``; none on one rank), every one of them in the same collectives (no fusion cut, flat: no node-aware
    stage), and the others in its fp32 allgather (``exact``)."""
    tern = [i for i, (n, x) in enumerate(zip(names, sizes)) if int(workers) > 1 and cfg.compresses(n, x)]
    chosen = set(tern)
    plain = [i for i in range(len(sizes)) if i not in chosen]
    return PlannedBuffer(TERNGRAD_OWNER_STEP, tuple(tern), tuple(sizes[i] for i in tern),
                         bucket_size=cfg.bucket_size, exact=tuple(plain))


def exchange_plan(method: str, tensor_sizes: Sequence[int], workers: int, network: Network,
                  packing: str | None = None, fusion_bytes: int = HOROVOD_FUSION_BYTES,
                  fusion_numel: int | None = None, *, config: TernGradConfig | None = None,
                  names: Sequence[str] | None = None, hierarchical=None) -> list[tuple[str, list[int]]]:
    """How a model's gradients travel under ``method``: [(exchange, tensor sizes of the buffer), ...].

    ``tensor_sizes`` (and ``names``, default "0", "1", ...) in registration (forward) order.
    fp32/fp16: Horovod fuses consecutive tensors up to ``fusion_bytes`` on the wire (0 = none).
    TernGrad, as the Horovod frontend does: ``exchange.fusion.cut`` of the tensors in backward order with
    ``config`` (:func:`terngrad_config`: fusion_numel, default :data:`TERNGRAD_FUSION_NUMEL`, 0 = none; a
    larger tensor travels alone; the policy's ``exclude`` patterns, matched against ``names``, and
    ``min_numel``); each group uses the method's exchange, or for "terngrad" (= exchange="auto") the one
    ``exchange.policy.auto_transport`` picks for it, as the engine does.  Tensors the policy keeps at full
    precision come last, as fp32 allreduce buffers fused up to ``fusion_bytes``.  ``config.exchange`` is
    not read: ``method`` says which exchange.

    Node-aware exchange (``hierarchical``, default ``config.hierarchical``, whose default is "auto"): on
    ``network``'s nodes of ``ranks_per_node`` ranks (contiguous placement, :func:`node_shape`), a group goes
    node-aware ("terngrad_hierarchical") where ``exchange.policy.hierarchy_for`` finds it cheaper than the
    flat exchange ("auto", as the engine decides), or always (True, where the topology allows it); its
    exchange across nodes is the method's (the cheaper per local rank for "terngrad").
    """
    return [(b.method, list(b.sizes)) for b in plan_buffers(method, tensor_sizes, workers, network, packing,
                                                               fusion_bytes, fusion_numel, config=config, names=names,
                                                               hierarchical=hierarchical,
                                                               step_allreduces=HOROVOD_STEP_ALLREDUCES)]


def model_exchange_cost(method: str, tensor_sizes: Sequence[int], workers: int, network: Network,
                        packing: str | None = None, fusion_bytes: int = HOROVOD_FUSION_BYTES,
                        fusion_numel: int | None = None, *, config: TernGradConfig | None = None,
                        names: Sequence[str] | None = None, hierarchical=None) -> tuple[ExchangeCost, list[str]]:
    """Cost of exchanging all of a model's gradients: the sum over its buffers (:func:`exchange_plan`),
    each charged by ``exchange.cost.method_cost`` with the config's packing and bucket size.

    An allgather buffer pays the handshake only if the config shares its scaler
    (``scaler_shared_for("allgather")``); with per-rank scalers the step pays one presence check instead
    (``exchange.cost.presence_cost``), as the engine does.  A node-aware group is charged
    ``exchange.cost.hierarchical_cost`` (M = N/G nodes of G = ``network.ranks_per_node``); a step with one
    pays two 4-byte allreduces of every rank (the node-aware engine's presence check and the Horovod
    frontend's end-of-step sync), besides the flat engine's presence check if it sends per-rank groups too.

    ``TERNGRAD_OWNER_STEP`` (``optim.OwnerStepOptimizer``) is one buffer, ``exchange.cost.terngrad_owner_step_cost``
    of its ternarized and its full-precision tensors; no presence check.

    Returns (total cost, exchange used per buffer).
    """
    cfg = terngrad_config(config, packing, method=method)
    shared = cfg.scaler_shared_for("allgather")
    total, used = None, []
    for b in plan_buffers(method, tensor_sizes, workers, network, packing, fusion_bytes, fusion_numel,
                          config=config, names=names, hierarchical=hierarchical,
                          step_allreduces=HOROVOD_STEP_ALLREDUCES):     # decided as the Horovod engine does
        if b.method == TERNGRAD_HIERARCHICAL:
            M, G = node_shape(workers, network)
            cost = hierarchical_cost(list(b.sizes), M, G, network, cfg.packing, cfg.bucket_size, shared,
                                     policy.transport_among(b.cross, M), cfg.intra_node_width)
        elif b.method == TERNGRAD_OWNER_STEP:
            cost = terngrad_owner_step_cost(list(b.sizes), workers, network, cfg.packing, b.bucket_size,
                                            exact=[int(tensor_sizes[i]) for i in b.exact],
                                            first=cfg.first_stage_format("requantized"))
        else:
            cost = method_cost(b.method, list(b.sizes), workers, network, cfg.packing, b.bucket_size, shared)
        total = cost if total is None else total + cost
        used.append(b.method)
    # per-rank scalers (the allgather's default, the re-ternarized and requantized exchanges'): the engine's
    # presence check, once per step
    if any(e in used and not cfg.scaler_shared_for(transport_of(e))
           for e in (TERNGRAD_ALLGATHER, TERNGRAD_RETERNARIZED, TERNGRAD_REQUANTIZED)):
        total = total + presence_cost(workers, network)
    if TERNGRAD_HIERARCHICAL in used:       # presence check + end-of-step sync
        for _ in range(HOROVOD_STEP_ALLREDUCES):
            total = total + presence_cost(workers, network)
    if total is None:
        total = ExchangeCost(method, 0.0, 0.0, 0, 0)
    return replace(total, method=method), used


def codec_work_elements(method: str, numel: int, workers: int, ranks_per_node: int = 1,
                        cross: str | None = "allgather") -> float:
    """Element operations of the codec per step (for the optional codec term).

    fp32: 0; fp16: 2n (cast out and back); allgather: n encode + N·n decode (every payload is decoded);
    sharded: n encode + n (owners sum N chunks of n/N) + n decode of the sums = 3n; re-ternarized: n encode +
    n (the owner decodes N chunks of n/N) + n/N (it ternarizes its shard again) + n decode = 3n + n/N;
    requantized: n encode + n (the owner decodes N chunks of n/N) + n (its noise estimate from the same N chunks)
    + n/N (its 4-bit encode) + n decode = 4n + n/N; owner-step (``optim.OwnerStepOptimizer``, the re-ternarized
    pattern with its noise estimate): n encode + n (the owner decodes N chunks of n/N) + n (its noise estimate) + n/N
    (its weight difference to the nearest ternary level) + n (every rank decodes the N owners' shards) = 4n + n/N;
    "default": the allgather's among up to 4 ranks, the
    requantized one's above (``default_transport(N)``).  N = 1: 0.
    Node-aware (G = ``ranks_per_node``, M = N/G nodes): n (the node sum of G slices of n/G) plus the
    ``cross`` exchange's work on n/G elements among M ranks ("allgather", "sharded", "reternarized",
    "requantized", "default": ``default_transport(M)``).
    """
    if method == TERNGRAD_HIERARCHICAL:
        G = max(1, int(ranks_per_node))
        M = max(1, int(workers) // G)
        shard = numel / G
        transport = policy.transport_among(cross, M)       # None: "auto", charged as the allgather
        inner = TERNGRAD_ALLGATHER if transport is None else method_of_transport(transport)
        return float(numel) + codec_work_elements(inner, shard, M)
    if workers <= 1 or method == FP32:
        return 0.0
    if method == FP16:
        return 2.0 * numel
    if method == TERNGRAD_DEFAULT:
        method = method_of_transport(default_transport(workers))
    if method == TERNGRAD_ALLGATHER:
        return float(numel) * (1 + workers)
    if method == TERNGRAD_SHARDED:
        return 3.0 * numel
    if method == TERNGRAD_RETERNARIZED:      # encode n, owner: decode N chunks of n/N and encode n/N, decode n
        return 3.0 * numel + numel / workers
    if method in (TERNGRAD_REQUANTIZED, TERNGRAD_OWNER_STEP):   # as re-ternarized, and the owner's noise estimate
        return 4.0 * numel + numel / workers
    raise ValueError(method)


# --------------------------------------------------------------------------------------------------
# Step prediction
@dataclass(frozen=True)
class StepPrediction:
    """Predicted iteration of one worker.  Times in seconds; speedups are ratios of step times."""

    method: str
    workers: int
    compute_s: float
    comm_s: float
    codec_s: float
    step_s: float
    bits_per_element: float
    exchanges: tuple
    batch_per_worker: int | None = None
    speedup_vs_fp32: float = float("nan")

    @property
    def images_per_s(self) -> float:
        """N · batch / T_step (needs batch_per_worker)."""
        if self.batch_per_worker is None:
            return float("nan")
        return self.workers * self.batch_per_worker / self.step_s

    @property
    def speedup_vs_one_worker(self) -> float:
        """N · T_compute / T_step: throughput over one worker's (weak scaling)."""
        return self.workers * self.compute_s / self.step_s

    @property
    def scaling_efficiency(self) -> float:
        return self.compute_s / self.step_s


def predict_step(tensor_sizes: Sequence[int], compute_s: float, workers: int, network: Network,
                 method: str = FP32, *, packing: str | None = None, fusion_bytes: int = HOROVOD_FUSION_BYTES,
                 fusion_numel: int | None = None, overlap: float = 0.0, codec_elements_per_s: float | None = None,
                 batch_per_worker: int | None = None, config: TernGradConfig | None = None,
                 names: Sequence[str] | None = None, hierarchical=None) -> StepPrediction:
    """T_step = T_compute + T_comm + T_codec - min(T_comm + T_codec, overlap·T_compute).

    ``tensor_sizes``: gradient element counts in layer (registration) order, travelling in the buffers of
    :func:`exchange_plan` (``packing``, ``fusion_bytes``, ``fusion_numel``, ``config`` and ``names`` go
    there); the order only changes how many buffers, hence latency terms, there are (the :data:`MODELS`
    lists are in layer order).  ``overlap`` in [0, 1]; 0 (default) = no overlap of communication with
    compute.  ``codec_elements_per_s``: None = the codec is free; else T_codec = :func:`codec_work_elements` / rate.
    ``hierarchical`` ("auto", True, False; default ``config.hierarchical``, "auto"): the node-aware
    exchange on ``network``'s nodes (:func:`exchange_plan`).
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError("overlap must be in [0, 1]")
    if compute_s < 0 or workers < 1:
        raise ValueError("compute_s must be >= 0 and workers >= 1")
    plan_kw = dict(config=config, names=names, hierarchical=hierarchical)
    cost, used = model_exchange_cost(method, tensor_sizes, workers, network, packing, fusion_bytes, fusion_numel,
                                     **plan_kw)
    plan_kw["step_allreduces"] = HOROVOD_STEP_ALLREDUCES
    codec = 0.0
    if codec_elements_per_s:
        cfg = terngrad_config(config, packing)
        work = 0.0
        for b in plan_buffers(method, tensor_sizes, workers, network, packing, fusion_bytes, fusion_numel, **plan_kw):
            cross = b.cross
            if b.method == TERNGRAD_HIERARCHICAL:
                M, G = node_shape(workers, network)
                if policy.transport_among(cross, M) is None:      # "auto": what the largest shard's rank picks
                    pieces = [p.numel for p in topology.shard_plan(b.sizes, G)[0]]
                    cross = auto_transport(pieces, M, cfg.packing, cfg.bucket_size,
                                           network=cross_network(network, G),
                                           shared_scaler=cfg.scaler_shared_for("allgather"))
            work += codec_work_elements(b.method, sum(b.sizes), workers, network.ranks_per_node, cross)
        codec = work / codec_elements_per_s
    exposed = cost.time_s + codec
    step = compute_s + exposed - min(exposed, overlap * compute_s)
    return StepPrediction(method, int(workers), compute_s, cost.time_s, codec, step, cost.bits_per_element,
                          tuple(used), batch_per_worker)


def compare_exchanges(model_or_sizes, compute_s: float, workers: int, network: Network,
                      methods: Sequence[str] = ALL_METHODS, **kwargs) -> dict[str, StepPrediction]:
    """Predicted step of a user's model under each method, with ``speedup_vs_fp32`` filled in.

    ``model_or_sizes``: a ``torch.nn.Module`` (its trainable parameters) or a list of tensor sizes.
    ``compute_s``: measured forward+backward time per iteration on one worker (see :func:`profile_compute`).
    ``kwargs`` go to :func:`predict_step` (packing, fusion_bytes, fusion_numel, overlap,
    codec_elements_per_s, batch_per_worker, config, names); a module's or ModelSpec's parameter names are
    the default ``names`` (what a config's ``exclude`` patterns match).  Returns {method: StepPrediction}.
    """
    sizes = tensor_sizes_of(model_or_sizes)
    if kwargs.get("names") is None:
        kwargs["names"] = tensor_names_of(model_or_sizes)
    base = predict_step(sizes, compute_s, workers, network, FP32, **kwargs)
    out = {}
    for m in methods:
        p = base if m == FP32 else predict_step(sizes, compute_s, workers, network, m, **kwargs)
        out[m] = replace(p, speedup_vs_fp32=base.step_s / p.step_s)
    return out


def compute_time_for_speedup(target_speedup: float, tensor_sizes: Sequence[int], workers: int,
                             network: Network, method: str = TERNGRAD_ALLGATHER, **kwargs) -> float:
    """The compute time C that makes T_step(fp32)/T_step(method) = target (no overlap, no codec).

    (C + M_fp32) / (C + M) = s  =>  C = (M_fp32 - s·M) / (s - 1).  Negative: no compute time reaches s
    (s is above the bandwidth-bound limit M_fp32/M).
    """
    m32 = model_exchange_cost(FP32, tensor_sizes, workers, network, **kwargs)[0].time_s
    m = model_exchange_cost(method, tensor_sizes, workers, network, **kwargs)[0].time_s
    return (m32 - target_speedup * m) / (target_speedup - 1)


def tensor_sizes_of(model_or_sizes) -> list[int]:
    """Element counts of a module's trainable parameters, a :class:`ModelSpec`'s tensors, or a list of
    sizes passed through."""
    if isinstance(model_or_sizes, ModelSpec):
        return list(model_or_sizes.sizes)
    if hasattr(model_or_sizes, "parameters"):
        return [int(p.numel()) for p in model_or_sizes.parameters() if p.requires_grad]
    return [int(s) for s in model_or_sizes]


def tensor_names_of(model_or_sizes) -> list[str] | None:
    """Names of a module's trainable parameters or a ModelSpec's tensors, in :func:`tensor_sizes_of`'s
    order; None for a plain list of sizes."""
    if isinstance(model_or_sizes, ModelSpec):
        return [n for n, _ in model_or_sizes.tensors]
    if hasattr(model_or_sizes, "named_parameters"):
        return [n for n, p in model_or_sizes.named_parameters() if p.requires_grad]
    return None


def profile_compute(model, batch: int, input_shape: Sequence[int], steps: int = 10, warmup: int = 2,
                    device=None, loss_fn=None) -> float:
    """Median seconds of forward + backward of ``model`` on a random batch, on this machine.

    Input: randn(batch, *input_shape); loss: ``loss_fn(output)`` or output.float().square().mean().
    Gradients are zeroed (set to None) before each step; the optimizer step is not timed.  On CUDA the
    device is synchronized around each step.  Cost: (warmup + steps) forward+backward passes.
    """
    import torch

    if device is None:
        try:
            device = next(model.parameters()).device
        except StopIteration:
            device = torch.device("cpu")
    device = torch.device(device)
    x = torch.randn((int(batch), *[int(d) for d in input_shape]), device=device)
    loss_fn = loss_fn or (lambda out: out.float().square().mean())

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    was_training = model.training
    model.train()
    try:
        for i in range(int(warmup) + int(steps)):
            model.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            loss_fn(model(x)).backward()
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        model.train(was_training)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------------
# The paper's networks: layer-by-layer parameter tensors (weight and bias of every layer)
def _conv(name: str, c_in: int, c_out: int, k: int, groups: int = 1) -> list[tuple[str, int]]:
    return [(f"{name}.weight", c_out * (c_in // groups) * k * k), (f"{name}.bias", c_out)]


def _fc(name: str, n_in: int, n_out: int) -> list[tuple[str, int]]:
    return [(f"{name}.weight", n_out * n_in), (f"{name}.bias", n_out)]


def alexnet_tensors() -> list[tuple[str, int]]:
    """AlexNet as in Krizhevsky et al. / Caffe's bvlc_alexnet (conv2, conv4, conv5 in 2 groups).

    16 tensors, 60,965,224 parameters (fc6 alone 37.7M).
    """
    return (_conv("conv1", 3, 96, 11) + _conv("conv2", 96, 256, 5, 2) + _conv("conv3", 256, 384, 3)
            + _conv("conv4", 384, 384, 3, 2) + _conv("conv5", 384, 256, 3, 2)
            + _fc("fc6", 256 * 6 * 6, 4096) + _fc("fc7", 4096, 4096) + _fc("fc8", 4096, 1000))


# GoogLeNet inception modules (Szegedy et al. 2015, Table 1):
# (in, #1x1, #3x3 reduce, #3x3, #5x5 reduce, #5x5, pool proj)
_INCEPTION = {
    "3a": (192, 64, 96, 128, 16, 32, 32), "3b": (256, 128, 128, 192, 32, 96, 64),
    "4a": (480, 192, 96, 208, 16, 48, 64), "4b": (512, 160, 112, 224, 24, 64, 64),
    "4c": (512, 128, 128, 256, 24, 64, 64), "4d": (512, 112, 144, 288, 32, 64, 64),
    "4e": (528, 256, 160, 320, 32, 128, 128), "5a": (832, 256, 160, 320, 32, 128, 128),
    "5b": (832, 384, 192, 384, 48, 128, 128),
}


def googlenet_tensors() -> list[tuple[str, int]]:
    """GoogLeNet (Inception v1) main branch with biases, no BN, no auxiliary classifiers.

    3 stem convolutions + 9 inception modules x 6 convolutions + 1 fc = 58 layers = 116 tensors,
    6,998,552 parameters (the paper's "6.8M" rounds its Table 1; the two training-time auxiliary heads,
    not counted here, would add about 6.3M in 10 more tensors).
    """
    t = _conv("conv1", 3, 64, 7) + _conv("conv2_reduce", 64, 64, 1) + _conv("conv2", 64, 192, 3)
    for name, (c_in, n1, r3, n3, r5, n5, pp) in _INCEPTION.items():
        p = f"inception_{name}"
        t += (_conv(f"{p}.1x1", c_in, n1, 1) + _conv(f"{p}.3x3_reduce", c_in, r3, 1)
              + _conv(f"{p}.3x3", r3, n3, 3) + _conv(f"{p}.5x5_reduce", c_in, r5, 1)
              + _conv(f"{p}.5x5", r5, n5, 5) + _conv(f"{p}.pool_proj", c_in, pp, 1))
    return t + _fc("loss3_classifier", 1024, 1000)


def vgga_tensors() -> list[tuple[str, int]]:
    """VGG-A (VGG-11, Simonyan & Zisserman config A): 8 convolutions + 3 fc = 22 tensors, 132,863,336."""
    t, c_in = [], 3
    for i, c_out in enumerate((64, 128, 256, 256, 512, 512, 512, 512), 1):
        t += _conv(f"conv{i}", c_in, c_out, 3)
        c_in = c_out
    return t + _fc("fc6", 512 * 7 * 7, 4096) + _fc("fc7", 4096, 4096) + _fc("fc8", 4096, 1000)


@dataclass(frozen=True)
class ModelSpec:
    """A network for the Fig.-5 predictions: tensors, per-GPU batch (paper), compute time per GPU kind."""

    name: str
    tensors: tuple
    batch_per_gpu: int
    compute_s: dict = field(default_factory=dict)   # {"gtx1080": s, "p100": s} for batch_per_gpu
    source: str = ""

    @property
    def sizes(self) -> list[int]:
        return [n for _, n in self.tensors]

    @property
    def parameters(self) -> int:
        return sum(self.sizes)


# Single-GPU forward+backward time per iteration at the paper's per-GPU batch (Fig. 5 caption: 128,
# 64 and 32).  Base figures: Caffe2's convnet_benchmarks.py docstring, GTX TITAN X (Maxwell) with cuDNN
# v4, forward+backward per batch: AlexNet 90.1 ms (batch 128), Inception/GoogLeNet 233.6 ms (batch 64),
# VGG model A 551.7 ms (batch 64, so 275.9 ms at 32 assuming time linear in batch).
# GTX 1080 = TITAN X (Maxwell) / 1.13: the measured ratio in jcjohnson/cnn-benchmarks (Torch, cuDNN 5:
# VGG-16 262.42/232.55 = 1.13, ResNet-50 171.02/153.90 = 1.11).
# P100 = GTX 1080 / 1.2: ratio of peak fp32 throughput (P100 SXM2 10.6 TFLOP/s, GTX 1080 8.9); an
# assumption, no published same-software measurement was used.
GTX1080_OVER_TITANX_MAXWELL = 1.13
P100_OVER_GTX1080 = 1.2
_TITANX_MAXWELL_S = {"alexnet": 0.0901, "googlenet": 0.2336, "vgga": 0.5517 / 2}


def _gpu_times(name: str) -> dict:
    g1080 = _TITANX_MAXWELL_S[name] / GTX1080_OVER_TITANX_MAXWELL
    return {"gtx1080": g1080, "p100": g1080 / P100_OVER_GTX1080}


_SOURCE = ("Caffe2 convnet_benchmarks (TITAN X Maxwell, cuDNN v4) scaled by 1/1.13 (GTX 1080, "
           "jcjohnson/cnn-benchmarks) and 1/1.2 more (P100, peak-FLOPS ratio)")
MODELS = {
    "alexnet": ModelSpec("AlexNet", tuple(alexnet_tensors()), 128, _gpu_times("alexnet"), _SOURCE),
    "googlenet": ModelSpec("GoogLeNet", tuple(googlenet_tensors()), 64, _gpu_times("googlenet"), _SOURCE),
    "vgga": ModelSpec("VGG-A", tuple(vgga_tensors()), 32, _gpu_times("vgga"), _SOURCE),
}


@dataclass(frozen=True)
class Cluster:
    """A paper cluster: its network and the GPU kind that sets the compute time."""

    name: str
    network: Network
    gpu: str
    description: str = ""


CLUSTERS = {
    "ethernet": Cluster("Ethernet", ETHERNET_1G, "gtx1080",
                        "128 nodes x 4 GTX 1080 on one PCIe switch per node, 1 Gbit/s Ethernet"),
    "infiniband": Cluster("InfiniBand", INFINIBAND_100G, "p100",
                          "128 nodes x 4 P100 with NVLink, 100 Gbit/s InfiniBand"),
}


def worker_counts(max_workers: int = 512) -> list[int]:
    """1, 2, 4, ... up to max_workers (and max_workers itself if it is not a power of 2)."""
    out, n = [], 1
    while n <= max_workers:
        out.append(n)
        n *= 2
    if out[-1] != max_workers:
        out.append(int(max_workers))
    return out


TERNGRAD_FLAT = "terngrad_flat"   #: a row of predict_scaling(flat_too=True): "terngrad" with hierarchical=False


def predict_scaling(model: ModelSpec, cluster: Cluster, workers: Iterable[int] = None,
                    methods: Sequence[str] = ALL_METHODS, compute_s: float | None = None,
                    batch_per_worker: int | None = None, flat_too: bool = False,
                    **kwargs) -> list[dict[str, StepPrediction]]:
    """Fig.-5 predictions: for each N, {method: StepPrediction} (images/s and speedup vs fp32).

    Weak scaling: batch per worker fixed (the paper's, unless given); compute time from
    ``model.compute_s[cluster.gpu]`` unless given.  ``kwargs`` go to :func:`predict_step` (``hierarchical``
    among them: default the config's, "auto").  ``flat_too``: each row also holds :data:`TERNGRAD_FLAT`,
    the "terngrad" method with the flat exchange only (``hierarchical=False``), its speedup against the
    same fp32.  Cost: O(len(workers) · len(methods) · tensors).
    """
    workers = list(workers) if workers is not None else worker_counts()
    c = model.compute_s[cluster.gpu] if compute_s is None else compute_s
    b = model.batch_per_gpu if batch_per_worker is None else batch_per_worker
    rows = []
    for N in workers:
        row = compare_exchanges(model, c, N, cluster.network, methods, batch_per_worker=b, **kwargs)
        if flat_too:
            flat = compare_exchanges(model, c, N, cluster.network, (FP32, TERNGRAD_BEST), batch_per_worker=b,
                                     **{**kwargs, "hierarchical": False})[TERNGRAD_BEST]
            row[TERNGRAD_FLAT] = replace(flat, speedup_vs_fp32=row[FP32].step_s / flat.step_s)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------
# Output: table (figures: modelling/plots.py)
def _chosen(p: StepPrediction) -> str:
    """The exchanges a prediction's buffers use, short names joined by "+" ("-" on one worker)."""
    return "-" if p.workers == 1 else "+".join(short(c) for c in sorted(set(p.exchanges)))


def format_table(model: ModelSpec, cluster: Cluster, rows: list[dict[str, StepPrediction]]) -> str:
    """Workers x images/s for fp32, fp16, ``default`` (what ``TernGradConfig()`` picks: exchange="default",
    node-aware where cheaper), its speedup and fraction of linear scaling (N x one GPU's images/s), TernGrad's
    exchanges one by one (allgather, sharded, and where the rows hold them re-ternarized and requantized), the
    owner-step optimizer's exchange (``optim.OwnerStepOptimizer``) where the rows hold it,
    ``auto`` (exchange="auto") with its speedup and fraction of linear scaling, and, where the rows hold
    :data:`TERNGRAD_FLAT`, auto's flat exchange beside them; then auto's bits per element and the exchanges
    default and auto use."""
    first = rows[0][FP32]
    head = (f"{model.name} on {cluster.name} ({cluster.network.describe()}); {model.parameters / 1e6:.1f}M "
            f"parameters in {len(model.tensors)} tensors; batch {first.batch_per_worker}/worker; compute "
            f"{first.compute_s * 1e3:.1f} ms/iteration")
    flat = all(TERNGRAD_FLAT in r for r in rows)
    rt = all(TERNGRAD_RETERNARIZED in r for r in rows)
    rq = all(TERNGRAD_REQUANTIZED in r for r in rows)
    os_ = all(TERNGRAD_OWNER_STEP in r for r in rows)
    dflt = all(TERNGRAD_DEFAULT in r for r in rows)
    cols = ["workers", "fp32 img/s", "fp16 img/s"]
    cols += ["default", "dflt spd", "dflt/linear"] if dflt else []
    cols += ["TG-allgather", "TG-sharded"]
    cols += ["TG-reternarized", "RT/linear"] if rt else []
    cols += ["TG-requantized", "RQ/linear"] if rq else []
    cols += ["owner-step", "OS/linear"] if os_ else []
    cols += ["auto", "speedup", "TG/linear"]
    cols += ["flat TG", "flat spd"] if flat else []
    cols += ["TG bits/elt"] + (["default chose"] if dflt else []) + ["chosen"]
    rows_out = []
    for r in rows:
        tg = r[TERNGRAD_BEST]
        vals = [f"{tg.workers}", f"{r[FP32].images_per_s:.0f}", f"{r[FP16].images_per_s:.0f}"]
        if dflt:
            d = r[TERNGRAD_DEFAULT]
            vals += [f"{d.images_per_s:.0f}", f"{d.speedup_vs_fp32:.2f}x", f"{d.scaling_efficiency:.3f}"]
        vals += [f"{r[TERNGRAD_ALLGATHER].images_per_s:.0f}", f"{r[TERNGRAD_SHARDED].images_per_s:.0f}"]
        if rt:
            vals += [f"{r[TERNGRAD_RETERNARIZED].images_per_s:.0f}", f"{r[TERNGRAD_RETERNARIZED].scaling_efficiency:.3f}"]
        if rq:
            vals += [f"{r[TERNGRAD_REQUANTIZED].images_per_s:.0f}", f"{r[TERNGRAD_REQUANTIZED].scaling_efficiency:.3f}"]
        if os_:
            vals += [f"{r[TERNGRAD_OWNER_STEP].images_per_s:.0f}", f"{r[TERNGRAD_OWNER_STEP].scaling_efficiency:.3f}"]
        vals += [f"{tg.images_per_s:.0f}", f"{tg.speedup_vs_fp32:.2f}x", f"{tg.scaling_efficiency:.3f}"]
        if flat:
            vals += [f"{r[TERNGRAD_FLAT].images_per_s:.0f}", f"{r[TERNGRAD_FLAT].speedup_vs_fp32:.2f}x"]
        vals += [f"{tg.bits_per_element:.2f}"] + ([_chosen(r[TERNGRAD_DEFAULT])] if dflt else []) + [_chosen(tg)]
        rows_out.append(vals)
    width = [max(len(c), 8, *(len(v[i]) for v in rows_out)) for i, c in enumerate(cols)]
    lines = [head, "  ".join(f"{c:>{w}}" for c, w in zip(cols, width))]
    lines += ["  ".join(f"{v:>{w}}" for v, w in zip(vals, width)) for vals in rows_out]
    return "\n".join(lines)


def max_workers_where_allgather_wins(numel: int, network: Network, packing: str = "2bit",
                                     max_workers: int = 4096) -> int:
    """Largest N (>= 2) at which the TernGrad allgather of one tensor is cheaper than fp32 allreduce.

    Returns 1 if it never is.  With the formulas above, for large n: 32 (2bit), 40 (base3); with rings
    only (``network.with_allreduce("ring")``) 31 and 39.
    """
    best = 1
    for N in range(2, max_workers + 1):
        if (terngrad_allgather_cost(numel, N, network, packing).time_s
                < fp32_allreduce_cost(numel, N, network).time_s):
            best = N
    return best
