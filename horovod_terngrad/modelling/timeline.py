"""Scheduled step-time model: when each collective runs during a step, as Horovod and this library run it.

``perfmodel.predict_step`` adds compute, communication and codec times (with an optional overlap
fraction).  That over-charges real steps in two ways that the emulated-cluster measurements showed
(docs/cluster.md): Horovod starts a gradient's collective while backward is still running, and
collectives submitted while the network is busy are fused into one round, so latency is paid per round,
not per buffer.  This module simulates one step on one worker instead, with two resources (three with
node-aware groups, below):

* the **main thread** (a CPU core): forward; backward, one tensor after the other in reverse layer order,
  each taking a share of the backward time proportional to its size; the work the compressor does on
  it, in the order exchange/engine.py does it (below); fp16's casts.
* the **channel** (Horovod's background thread and the link): one collective at a time, in submission
  order.  A collective starts ``cycle_s`` after its submission, or when the channel frees up, whichever
  is later.  An allreduce or allgather submitted before the last queued one of its kind has started
  joins it (Horovod's tensor fusion): one latency term for the round, the bandwidth terms added.  (Only
  the last queued round is joined, alltoalls never fuse, and allreduces of different dtypes or ops
  (fp32 sums, the int32 presence check, fp64 handshake maxima) do not fuse, as in Horovod; nor do
  collectives of different process sets, the world's and a cross group's.)

TernGrad, as the engine runs a group (its ``ordered`` start, the Horovod default) when the backward hook
of its last member hands it over:

* **per-rank scalers** (the allgather exchange's default, also ``exchange="auto"``'s allgather groups): the
  statistics of every member, then, in the step's first such group only, the presence check (one 4-byte allreduce-sum,
  ``terngrad.presence.<group>``) which that hook waits for; then every member is encoded with its own
  scaler and the group's payload allgather leaves, all inside the hook.  No handshake.
* **shared scaler** (the sharded exchange, ``exchange="auto"``'s sharded groups, or ``shared_scaler=True``;
  ``config.scaler_shared_for``): the statistics,
  the group's handshake (allreduce-max, ``terngrad.hs.<group>``), then every group started before the
  previous one is advanced, waiting: its handshake, encoding, its payload collective (allgather, or the
  sharded alltoall), and for the sharded exchange the alltoall, the owners' sums and their allgather.
* **two-stage per-rank exchanges** (``exchange="reternarized"``, ``"requantized"``; ``"default"``'s
  and ``"auto"``'s requantized groups): as per-rank scalers above, but the payload collective is the alltoall of each
  shard to its owner (``terngrad.rt.<group>``); at the engine's next progress the owner decodes its shard's N
  payloads and sends its payload by allgather (``terngrad.rg.<group>``: both exchanges use the re-ternarized
  exchange's names): re-ternarized, the average ternarized again (c bytes, as the alltoall's); requantized, the
  average in 4-bit groups with the noise channel (P bytes, ``exchange.cost.requantized_bytes``).
* **synchronize** (the optimizer's, tensors in hook order): the first TernGrad tensor advances every group
  still in flight (all handshakes, then all alltoalls); each member then waits for its group's allgather
  and is decoded.  Tensors the config keeps at full precision (``min_numel``, ``exclude``) go through
  Horovod's fp32 allreduce as they become ready and are waited for in their turn.  (Horovod's allreduce
  of the empty tensor TernGrad's compress hands it is not charged.)

**Node-aware groups** (exchange/hierarchical.py; the plan's ``terngrad_hierarchical`` groups, on M nodes of
G = ``network.ranks_per_node`` ranks), as that engine runs them on local rank j (``local_rank``; by default
every j in turn, and the slowest one's step is returned), with a third resource, the **intra-node
channel** (``network.intra_node``, or ``network`` if None; its own queue: intra-node collectives never wait
behind inter-node ones, nor the other way round):

* **hook**: the step's first node-aware group sends the world's presence check (4-byte allreduce-sum,
  ``terngrad.presence.<group>``, inter-node channel) and waits for it (Horovod frontend, ``joins``); a fused
  group's members are laid end to end (one fp32 pass); the fp32 alltoall of the G shards goes out on the
  intra-node channel (``terngrad.h.a2a.<group>``); then, one group of slack as the engine's ``ordered``
  start, every node-aware group before the previous one goes on across nodes (next item), waiting for its
  alltoall;
* **across nodes** (``_start_cross``): the node sum (G fp32 passes over the shard: G-1 adds and the
  division), then the cross engine on local rank j's pieces among the M ranks of its cross group, on the
  inter-node channel at ``exchange.cost.cross_network``'s rate (a G-th of the node's link; every local rank
  crosses at once): the statistics of the pieces, then per-rank scalers encode and allgather at once
  (``terngrad.ag.<group>.x<j>``; no presence check of its own), a shared scaler sends its handshake
  (``terngrad.hs.<group>.x<j>``) and advances the cross groups before its previous one as the flat engine
  does (sharded: ``terngrad.a2a.<group>.x<j>``, the owners' sums, ``terngrad.sg.<group>.x<j>``).  The
  exchange is the config's, or for ``"auto"`` ``exchange.policy.auto_transport`` on that G-th of the link;
* **synchronize**, at a node-aware group's first member: every node-aware group still waiting for its
  alltoall goes across, every cross group is advanced; then this group and every earlier one not finished
  yet: each waits for its cross exchange, decodes its pieces (M payloads, or the gathered sums) and sends
  its fp32 allgather of the averaged shard + a status word per piece (``terngrad.h.ag.<group>``, intra-node
  channel); each member then waits for its group's allgather and is copied out (one fp32 pass).  After the
  step's last node-aware member the end-of-step sync (4-byte allreduce-sum, ``terngrad.h.done.<group>``) is
  waited for (Horovod frontend).

Sizes are ``exchange.topology``'s (``shard_plan``, ``intra_node_bytes``: the largest shard, as the
collective's slowest member) and ``codec/sizes.py``'s for the pieces; times the formulas of
``exchange.cost.hierarchical_cost`` (which the schedule equals for one group without compute and codec, the
two 4-byte allreduces aside).  Which groups go node-aware is ``perfmodel.plan_buffers``'s decision
(``exchange.policy.hierarchy_for`` per group, as the engine decides, weighing the two 4-byte allreduces of
the Horovod frontend; none for the DDP hook, ``joins=False``).  Simplification: each local rank is
scheduled on its own, with its node's peers assumed as fast as itself where they meet (the intra-node
collectives); the slowest one's step is the prediction.

Collective times are exchange/cost.py's alpha-beta formulas (allreduce: the ring or, where faster and
the network's ``allreduce`` setting allows it, the tree; ring allgather, pairwise alltoall; with the
network's calibrated efficiencies), on the bytes codec/sizes.py gives: a group's
handshake (``handshake_size``), its payloads (``payload_size``), and for the sharded exchange every
member's shard on its own (``exchange.cost.sharded_bytes``: the slowest rank's bytes to each peer and
sums).  Step time = when the main thread has decoded the last gradient (TernGrad) or the last allreduce
is back and cast (fp32/fp16).

Gradient buffers: Horovod's fusion threshold for fp32/fp16 (buffers formed from the tensors ready when
the channel frees up); for TernGrad the groups and exchanges of ``perfmodel.plan_buffers`` (the
frontend's ``exchange.fusion`` cut with a TernGradConfig, each group's exchange as the engine picks it).

Codec work is charged from :class:`CodecRates` (seconds per element of each stage, measured on the
machine with :func:`measure_codec_rates`); None = free.  Cost: O(tensors) per prediction (O(G·tensors)
with node-aware groups).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ..codec import sizes as wire
from ..exchange import cost, policy, topology
from . import perfmodel as pm


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


class _Channel:
    """Collectives one at a time in submission order; same-kind submissions fuse into a queued round."""

    def __init__(self, cycle_s: float):
        self.cycle = cycle_s
        self.ops = []          # [kind, start, bandwidth_s, latency_s, [ids]]
        self.done = {}         # id -> op index

    def submit(self, t: float, kind: str, op_id, latency_s: float, bandwidth_s: float) -> None:
        if self.ops:
            last = self.ops[-1]
            if last[0] == kind and kind != "alltoall" and t <= last[1]:   # not started yet: join its round
                # (Horovod fuses allreduces and allgathers; every alltoall is a round of its own)
                last[2] += bandwidth_s
                last[3] = max(last[3], latency_s)
                last[4].append(op_id)
                self.done[op_id] = len(self.ops) - 1
                return
        free = self.ops[-1][1] + self.ops[-1][2] + self.ops[-1][3] if self.ops else 0.0
        self.ops.append([kind, max(t + self.cycle, free), bandwidth_s, latency_s, [op_id]])
        self.done[op_id] = len(self.ops) - 1

    def finish_time(self, op_id) -> float:
        op = self.ops[self.done[op_id]]
        return op[1] + op[2] + op[3]

    def rounds(self) -> int:
        return len(self.ops)


def _split(fn, nbytes: float, workers: int, link: pm.Network, *extra) -> tuple[float, float]:
    """(latency part, bandwidth part) of a perfmodel collective time (an allreduce: of the algorithm,
    ring or tree, that ``allreduce_time`` charges for this size)."""
    if fn is pm.allreduce_time:
        _, lat, bw = pm.allreduce_terms(nbytes, workers, link)
        return lat, bw
    lat = fn(0, workers, link, *extra)
    return lat, fn(nbytes, workers, link, *extra) - lat


@dataclass(frozen=True)
class Timeline:
    """What :func:`timeline_step` predicts for one step of one worker (seconds)."""

    method: str
    workers: int
    step_s: float
    compute_s: float
    backward_end_s: float     # when backward (with the hooks' codec work) is done on the main thread
    channel_busy_s: float     # total time the (inter-node) channel spent in collectives
    codec_s: float            # codec work on the main thread
    rounds: int               # collective rounds after fusion (both channels)
    collectives: int = 0      # TernGrad's own collectives (the engine's ``stats.collectives`` per step)
    issued: tuple = ()        # their names in the order the engine issues them (terngrad.<kind>.<group index>)
    intra_busy_s: float = 0.0   # total time the intra-node channel spent in collectives (node-aware groups)
    local_rank: int | None = None   # node-aware groups: the local rank scheduled (its shard, its cross group)


# the engine's ``exchange`` setting behind each TernGrad method of the performance model
TERNGRAD_METHODS = {pm.TERNGRAD_ALLGATHER: "allgather", pm.TERNGRAD_SHARDED: "sharded", pm.TERNGRAD_BEST: policy.AUTO,
                    pm.TERNGRAD_RETERNARIZED: "reternarized", pm.TERNGRAD_REQUANTIZED: "requantized",
                    pm.TERNGRAD_DEFAULT: policy.DEFAULT}
# the two-stage exchanges' collective names (exchange/sharded.py, exchange/reternarized.py): (alltoall, allgather);
# the requantized exchange is sent by reternarized.send and gathered by reternarized.after_alltoall (its own
# owner stage), so its collectives carry the re-ternarized exchange's names
_TWO_STAGE = {"sharded": ("a2a", "sg"), "reternarized": ("rt", "rg"), "requantized": ("rt", "rg")}
# the flat groups' exchanges of a plan (perfmodel.plan_buffers) that the two-stage schedule runs
_TWO_STAGE_KINDS = (pm.TERNGRAD_SHARDED, pm.TERNGRAD_RETERNARIZED, pm.TERNGRAD_REQUANTIZED)


def method_of(config: pm.TernGradConfig) -> str:
    """The performance model's method for a TernGradConfig's ``exchange`` (the inverse of TERNGRAD_METHODS)."""
    return {v: k for k, v in TERNGRAD_METHODS.items()}[config.exchange]


def _two_stage_bytes(mode: str, sizes: Sequence[int], ranks: int, cfg: pm.TernGradConfig) -> tuple:
    """(bytes to each peer in the alltoall, bytes per owner in the allgather) of a two-stage exchange of a group
    (exchange/cost.py's, from codec/sizes.py): the sharded exchange's codes and sums, the re-ternarized one's
    shard payload (both stages), the requantized one's shard payload up and 4-bit owner payload with the noise
    channel down (``requantized_bytes``: P differs from c); (0, 0) for the allgather."""
    if mode == "sharded":
        return pm.sharded_bytes(sizes, ranks, cfg.packing)
    if mode == "reternarized":
        return (cost.reternarized_bytes(sizes, ranks, cfg.packing, cfg.bucket_size),) * 2
    if mode == "requantized":
        return cost.requantized_bytes(sizes, ranks, cfg.packing, cfg.bucket_size)
    return (0, 0)


def _decode_rate(c: "CodecRates", mode: str, ranks: int) -> float:
    """Seconds per output element of a group's final decode: the owners' sums (sharded), one owner's payload
    per element (re-ternarized), or the N payloads of the allgather exchange."""
    if mode == "sharded":
        return c.decode_sums
    if mode in ("reternarized", "requantized"):   # one owner's payload per element (requantized: 4-bit groups)
        return c.decode_base + c.decode_per_payload
    return c.decode_base + c.decode_per_payload * ranks


class _Payload(NamedTuple):
    """One TernGrad exchange as the engine sends it: a flat group on all N ranks, or a local rank's pieces
    of a node-aware group among the M ranks of its cross group."""
    key: str                  # the collectives' name suffix: "<group>" or "<group>.x<j>"
    elements: int
    sharded: str              # "" (allgather), or the two-stage exchange: "sharded", "reternarized", "requantized"
    payload: float            # allgather: packed bytes per rank
    sharded_bytes: tuple      # two-stage: (bytes per peer in the alltoall, bytes per rank in the allgather)
    ranks: int
    link: pm.Network
    ranks_per_nic: int        # the alltoall's G
    allgather_kind: str       # fusion kind: a cross group's allgathers never fuse with the world's


def timeline_step(tensor_sizes: Sequence[int], compute_s: float, workers: int, network: pm.Network,
                  method: str = pm.FP32, *, codec: CodecRates | None = None, backward_fraction: float = 2 / 3,
                  packing: str | None = None, fusion_bytes: int = pm.HOROVOD_FUSION_BYTES,
                  fusion_numel: int | None = None, cycle_s: float = 0.0, config: pm.TernGradConfig | None = None,
                  names: Sequence[str] | None = None, joins: bool = True,
                  auto_network: pm.Network | None = None, hierarchical=None,
                  local_rank: int | None = None) -> Timeline:
    """Simulate one step (see the module docstring).  ``tensor_sizes`` (and ``names``) in layer (forward)
    order; ``packing``, ``fusion_numel``, ``config`` and ``names`` cut TernGrad's groups as
    ``perfmodel.exchange_plan`` does; ``config``'s scaler setting (``shared_scaler``) with the method's
    exchange decides between the per-rank and the shared-scaler schedule.  ``joins``: the Horovod frontend
    (a rank may be in ``hvd.join()``): per-rank scalers send the step's presence check, and a step with
    node-aware groups its presence check and end-of-step sync; False for torch.distributed (the DDP hook),
    which sends none of them.  ``auto_network``: the network the engine's ``exchange="auto"`` and
    ``hierarchical="auto"`` decide with (``exchange.cost.configured_network()`` in the job's environment);
    default ``network``.

    Node-aware groups: where the plan (``hierarchical``, default ``config.hierarchical``, on the nodes of
    ``network.ranks_per_node``, contiguous placement, as ``perfmodel.plan_buffers``) sends a group node-aware,
    the schedule runs the transport's stages on a second channel for ``network.intra_node`` and the cross
    exchange on the inter-node channel at ``exchange.cost.cross_network``'s rate (module docstring).
    ``local_rank``: the local rank whose shard (pieces, cross group, collective names ``...x<j>``) is
    scheduled; None: every local rank in turn, and the slowest one's step is returned (``Timeline.local_rank``
    says which)."""
    if not 0.0 <= backward_fraction <= 1.0:
        raise ValueError("backward_fraction must be in [0, 1]")
    sizes = [int(s) for s in tensor_sizes]
    N = int(workers)
    total = sum(sizes) or 1
    link = network.link_for(N)
    fwd = compute_s * (1 - backward_fraction)
    bwd = compute_s * backward_fraction
    zero = CodecRates(0, 0, 0, 0, 0, 0, 0, 0)
    c = codec or zero
    order = list(range(len(sizes)))[::-1]         # backward: last layer first
    if N <= 1:
        return Timeline(method, N, compute_s, compute_s, compute_s, 0.0, 0.0, 0)

    if method in (pm.FP32, pm.FP16):
        chan = _Channel(cycle_s)
        main = fwd
        codec_s = 0.0
        ready = {}
        width = 4 if method == pm.FP32 else 2
        for i in order:
            main += bwd * sizes[i] / total
            if method == pm.FP16:
                main += c.cast * sizes[i]
                codec_s += c.cast * sizes[i]
            ready[i] = main
        backward_end = main
        # Horovod: when the channel frees up, every ready tensor (up to the fusion threshold) goes in one buffer
        t_free, k, last_done = 0.0, 0, fwd
        while k < len(order):
            start = max(t_free, ready[order[k]] + cycle_s)
            nbytes, j = 0, k
            while j < len(order) and ready[order[j]] + cycle_s <= start and (
                    j == k or nbytes + width * sizes[order[j]] <= fusion_bytes):
                nbytes += width * sizes[order[j]]
                j += 1
            lat, bw = _split(pm.allreduce_time, nbytes, N, link)
            chan.ops.append(["allreduce", start, bw, lat, order[k:j]])
            t_free = last_done = start + lat + bw
            k = j
        end = max(backward_end, last_done)
        if method == pm.FP16:
            cast_back = c.cast * sum(sizes)
            end += cast_back
            codec_s += cast_back
        busy = sum(op[2] + op[3] for op in chan.ops)
        return Timeline(method, N, end, compute_s, backward_end, busy, codec_s, chan.rounds())

    if method not in TERNGRAD_METHODS:
        raise ValueError(f"method must be one of {(pm.FP32, pm.FP16) + tuple(TERNGRAD_METHODS)}, got {method!r}")
    # the groups as the frontend cuts them (exchange.fusion), each with the engine's exchange or node-aware;
    # members in backward order; every size from codec/sizes.py, exchange/topology.py and exchange/cost.py
    cfg = pm.terngrad_config(config, packing)
    # the scaler the engine uses with this exchange (config.shares_scaler; a per-rank scaler with the
    # sharded exchange is refused there, as TernGradConfig refuses it)
    cfg = cfg.replace(exchange=TERNGRAD_METHODS[method])
    decide_on = auto_network or network
    plan = pm.plan_buffers(method, sizes, N, decide_on, cfg.packing, fusion_bytes, fusion_numel,
                           config=cfg, names=names, hierarchical=hierarchical,
                           step_allreduces=pm.HOROVOD_STEP_ALLREDUCES if joins else 0,
                           ranks_per_node=network.ranks_per_node)
    node_aware = pm.TERNGRAD_HIERARCHICAL
    groups = [b for b in plan if b.exchange in (pm.TERNGRAD_ALLGATHER,) + _TWO_STAGE_KINDS + (node_aware,)]
    plain = {i for b in plan if b.exchange == pm.FP32 for i in b.members}   # kept at fp32
    group_of = {i: g for g, b in enumerate(groups) for i in b.members}
    last_member = {b.members[-1]: g for g, b in enumerate(groups)}
    kinds = [b.exchange for b in groups]
    numel = [sum(b.sizes) for b in groups]
    handshake = [wire.handshake_size([wire.num_buckets(n, b.bucket_size) for n in b.sizes]) for b in groups]
    payload = [sum(wire.payload_size(n, cfg.packing, b.bucket_size) for n in b.sizes) for b in groups]
    # sharded: every member sharded on its own; (bytes to each peer, bytes of sums per owner), slowest rank
    shard = [_two_stage_bytes(TERNGRAD_METHODS.get(k, ""), b.sizes, N, cfg) for b, k in zip(groups, kinds)]
    hier = [g for g, k in enumerate(kinds) if k == node_aware]
    M = G = 1
    if hier:
        M, G = pm.node_shape(N, network)
        if local_rank is not None and not 0 <= int(local_rank) < G:
            raise ValueError(f"local_rank must be in [0, {G}), got {local_rank!r}")
    intra = network.intra_node or network          # exchange.cost.hierarchical_cost's links
    xlink = cost.cross_network(network, G)
    # the intra-node stages' bytes: the largest shard to each local peer, the largest shard + status words
    intra_bytes = {g: topology.intra_node_bytes(groups[g].sizes, G, cfg.intra_node_width) for g in hier}
    split = {g: topology.shard_plan(groups[g].sizes, G) for g in hier}

    def cross_of(g: int, j: int) -> dict:
        """Local rank j's cross exchange of node-aware group g: its pieces among the M ranks of its cross
        group, with the exchange the transport gives them (the config's, or for "auto" policy.auto_transport on a
        G-th of the node's link, as hierarchical._start_cross decides)."""
        pieces = [p.numel for p in split[g][j]]
        mode = policy.transport_among(groups[g].cross, M)     # the cross engine's setting among M ranks
        if mode is None:                                       # "auto": per local rank, for its pieces
            mode = policy.auto_transport(pieces, M, cfg.packing, cfg.bucket_size,
                                         network=cost.cross_network(decide_on, G),
                                         shared_scaler=cfg.scaler_shared_for("allgather")) if pieces else "allgather"
        return {"pieces": pieces, "shard": sum(pieces), "mode": mode, "shared": cfg.scaler_shared_for(mode),
                "payload": sum(wire.payload_size(n, cfg.packing, cfg.bucket_size) for n in pieces),
                "handshake": wire.handshake_size([wire.num_buckets(n, cfg.bucket_size) for n in pieces]),
                "sharded": _two_stage_bytes(mode, pieces, M, cfg)}

    def schedule(j: int | None) -> Timeline:
        chan, local = _Channel(cycle_s), _Channel(cycle_s)     # inter-node channel, intra-node channel
        main, codec_s = fwd, 0.0
        issued = []                               # TernGrad's collectives, in the order the engine issues them
        hx = {g: cross_of(g, j) for g in hier}

        def work(seconds: float) -> None:
            nonlocal main, codec_s
            main += seconds
            codec_s += seconds

        def submit(ch: _Channel, kind: str, label: str, fn, nbytes: float, ranks: int, lk: pm.Network,
                   *extra) -> None:
            lat, bw = _split(fn, nbytes, ranks, lk, *extra)
            ch.submit(main, kind, label, lat, bw)
            issued.append(f"terngrad.{label}")

        def wait(ch: _Channel, label) -> None:
            nonlocal main
            main = max(main, ch.finish_time(label))

        # -- the engine's payload stages (exchange/engine.py), for the flat groups and, as the node-aware
        # transport reuses that engine among the M ranks of its cross group, for local rank j's pieces
        def exchange_of(g: int) -> _Payload:
            return _Payload(str(g), numel[g], TERNGRAD_METHODS[kinds[g]] if kinds[g] in _TWO_STAGE_KINDS else "",
                            payload[g], shard[g], N, link,
                            network.ranks_per_node if link is network else N, "allgather")

        def cross_exchange_of(q: int) -> _Payload:
            x = hx[q]
            return _Payload(f"{q}.x{j}", x["shard"], x["mode"] if x["mode"] in _TWO_STAGE else "", x["payload"],
                            x["sharded"], M, xlink,
                            1, "allgather@cross")

        def send(e: _Payload) -> None:               # engine: _send_per_rank / _after_handshake
            work(c.encode * e.elements)
            if e.sharded:
                submit(chan, "alltoall", f"{_TWO_STAGE[e.sharded][0]}.{e.key}", pm.alltoall_time, e.sharded_bytes[0],
                       e.ranks, e.link,
                       e.ranks_per_nic)
            else:
                submit(chan, e.allgather_kind, f"ag.{e.key}", pm.ring_allgather_time, e.payload, e.ranks, e.link)

        def advance(pending: list) -> None:
            """The engine's progress(block=True) over ``pending`` exchanges (in start order): every handshake,
            then every alltoall that this queued (sharded: the owners' sums and their allgather)."""
            for e in pending:
                wait(chan, f"hs.{e.key}")
                send(e)
            owner_steps(pending)

        def owner_steps(pending: list) -> None:
            """Every two-stage exchange of ``pending`` whose alltoall went out, in start order: the owners' work
            (sharded: add the N chunks; re-ternarized: decode the shard's N payloads, ternarize it again) and
            their allgather.  Empties ``pending``'s two-stage entries' queue when given one."""
            for e in pending:
                if e.sharded:
                    a2a, ag = _TWO_STAGE[e.sharded]
                    wait(chan, f"{a2a}.{e.key}")
                    if e.sharded == "sharded":
                        work(c.owner_sum * e.elements)
                    elif e.sharded == "reternarized":   # the owner decodes its shard's N payloads, ternarizes again
                        work((c.decode_base + c.decode_per_payload * e.ranks + c.prepare + c.encode)
                             * e.elements / e.ranks)
                    else:   # requantized: decodes them, forms the noise estimate from them (a second decode's
                        # work), and encodes the average in 4-bit groups (charged as statistics + encode)
                        work((2 * (c.decode_base + c.decode_per_payload * e.ranks) + c.prepare + c.encode)
                             * e.elements / e.ranks)
                    submit(chan, e.allgather_kind, f"{ag}.{e.key}", pm.ring_allgather_time, e.sharded_bytes[1],
                           e.ranks, e.link)

        # per-rank two-stage exchanges sent from the hook: their owner steps wait for the engine's next progress
        # (the first finish), flat and cross engine each their own
        flat_owner, cross_owner = [], []

        a2a_queue, previous, cross_queue, x_started = [], None, [], []
        crossed, gathered, live = set(), set(), 0
        unfinished = {g: len(groups[g].members) for g in hier}

        def start_cross(q: int) -> None:              # hierarchical._start_cross
            nonlocal x_started
            wait(local, f"h.a2a.{q}")
            x = hx[q]
            work(c.fp32_pass * G * x["shard"])        # node sum: G-1 adds of the shard, then / G
            cross_queue.append(q)
            if not x["pieces"]:
                return
            work(c.prepare * x["shard"])              # the cross engine's statistics of every piece
            if not x["shared"]:
                e = cross_exchange_of(q)              # per-rank scalers: no presence check of its own
                send(e)
                if e.sharded:
                    cross_owner.append(e)
            else:
                submit(chan, "allreduce_max@cross", f"hs.{q}.x{j}", pm.allreduce_time, x["handshake"], M, xlink)
                advance([cross_exchange_of(p) for p in x_started[:-1]])   # its ordered start: every group before the previous one
                x_started = x_started[-1:] + [q]

        def finish_cross(q: int) -> None:             # hierarchical._finish_cross
            x = hx[q]
            if x["pieces"]:
                wait(chan, f"{_TWO_STAGE.get(x['mode'], ('', 'ag'))[1]}.{q}.x{j}")
                work(_decode_rate(c, x["mode"], M) * x["shard"])
            submit(local, "allgather", f"h.ag.{q}", pm.ring_allgather_time, intra_bytes[q][1], G, intra)
            crossed.add(q)

        started = []                                  # flat shared scaler: handshake out, not advanced
        presence_sent = h_presence_sent = False
        for i in order:
            main += bwd * sizes[i] / total
            if i in plain:               # kept at full precision: Horovod's fp32 allreduce (fuses with fp32 only)
                lat, bw = _split(pm.allreduce_time, 4 * sizes[i], N, link)
                chan.submit(main, "allreduce_fp32", ("ar", i), lat, bw)
            g = last_member.get(i)
            if g is None:
                continue
            if kinds[g] == node_aware:   # hierarchical.start_group, in the hook
                if joins and not h_presence_sent:     # its own presence check, at the step's first such group
                    h_presence_sent = True
                    submit(chan, "allreduce_i32", f"presence.{g}", pm.allreduce_time, 4, N, link)
                    wait(chan, f"presence.{g}")
                if len(groups[g].members) > 1:
                    work(c.fp32_pass * numel[g])      # the members laid end to end
                submit(local, "alltoall", f"h.a2a.{g}", pm.alltoall_time, intra_bytes[g][0], G, intra, G)
                live += 1
                for q in a2a_queue:      # ordered: one group of slack, earlier groups go on across nodes
                    if q != previous:
                        start_cross(q)
                a2a_queue = [q for q in a2a_queue if q == previous] + [g]
                previous = g
                continue
            work(c.prepare * numel[g])       # start_group: the statistics of every member, in the hook
            if not cfg.scaler_shared_for(TERNGRAD_METHODS[kinds[g]]):   # per-rank ("auto": its allgather groups)
                if joins and not presence_sent:   # the presence check goes out with the step's first such group
                    presence_sent = True
                    submit(chan, "allreduce_i32", f"presence.{g}", pm.allreduce_time, 4, N, link)
                    wait(chan, f"presence.{g}")
                e = exchange_of(g)           # payloads leave from the hook, with each rank's own scalers
                send(e)
                if e.sharded:
                    flat_owner.append(e)
            else:
                submit(chan, "allreduce_max", f"hs.{g}", pm.allreduce_time, handshake[g], N, link)
                advance([exchange_of(p) for p in started[:-1]])   # ordered start: every group before the previous one, waiting
                started = started[-1:] + [g]
        backward_end = main
        # the optimizer's synchronize: tensors in hook order; the first flat TernGrad finish advances every
        # flat group, a node-aware finish every node-aware one (each engine its own queues)
        for i in order:
            if i in plain:
                wait(chan, ("ar", i))
                continue
            g = group_of[i]
            if kinds[g] == node_aware:   # hierarchical.finish
                if g not in crossed:
                    for q in a2a_queue:
                        start_cross(q)
                    a2a_queue = []
                    advance([cross_exchange_of(p) for p in x_started])
                    x_started = []
                    owner_steps(cross_owner)
                    cross_owner = []
                    at = cross_queue.index(g)   # its intra-node allgather and every earlier group's
                    for q in cross_queue[:at + 1]:
                        finish_cross(q)
                    cross_queue = cross_queue[at + 1:]
                if g not in gathered:
                    wait(local, f"h.ag.{g}")
                    gathered.add(g)
                work(c.fp32_pass * sizes[i])            # the member's values out of the gathered shards
                unfinished[g] -= 1
                if unfinished[g] == 0:
                    live -= 1
                    if live == 0 and joins:             # the end-of-step sync (Horovod frontend)
                        submit(chan, "allreduce_i32", f"h.done.{g}", pm.allreduce_time, 4, N, link)
                        wait(chan, f"h.done.{g}")
                continue
            if started:
                advance([exchange_of(p) for p in started])
                started = []
            if flat_owner:
                owner_steps(flat_owner)
                flat_owner = []
            mode = TERNGRAD_METHODS[kinds[g]]
            wait(chan, f"{_TWO_STAGE.get(mode, ('', 'ag'))[1]}.{g}")
            work(_decode_rate(c, mode, N) * sizes[i])
        busy = sum(op[2] + op[3] for op in chan.ops)
        intra_busy = sum(op[2] + op[3] for op in local.ops)
        return Timeline(method, N, main, compute_s, backward_end, busy, codec_s, chan.rounds() + local.rounds(),
                        len(issued), tuple(issued), intra_busy, j)

    if not hier:
        return schedule(None)
    ranks = range(G) if local_rank is None else [int(local_rank)]
    return max((schedule(j) for j in ranks), key=lambda t: t.step_s)    # ties: the lowest local rank


HOROVOD_CYCLE_TIME_S = 1e-3     #: Horovod 0.28's default HOROVOD_CYCLE_TIME: its background loop's period


def negotiation_s(workers: int, network: pm.Network, cycle_time_s: float = HOROVOD_CYCLE_TIME_S) -> float:
    """The ``cycle_s`` of :func:`timeline_step` for Horovod's default, world-group negotiation: how long a
    collective waits between its submission and its start.  Horovod's background loop runs a cycle every
    ``cycle_time_s``; a collective submitted during one waits for the next (half a cycle on average), whose
    coordination then agrees over the whole world on what is ready: with the response cache hit (every step
    after the first), one allreduce of the ranks' bit vectors, a tree of 2·ceil(log2 N) latencies.  0 for one
    worker."""
    N = int(workers)
    if N <= 1:
        return 0.0
    return cycle_time_s / 2 + 2 * math.ceil(math.log2(N)) * network.link_for(N).latency_s


def scheduled_scaling(model: pm.ModelSpec, cluster: pm.Cluster, workers: Sequence[int] = None,
                      methods: Sequence[str] = (pm.FP32, pm.FP16, pm.TERNGRAD_DEFAULT, pm.TERNGRAD_BEST,
                                                pm.TERNGRAD_RETERNARIZED, pm.TERNGRAD_REQUANTIZED),
                      negotiation: bool = True, compute_s: float | None = None, **kwargs) -> list[dict[str, Timeline]]:
    """Weak scaling from the scheduled step model: for each N, {method: Timeline} of one worker's step with
    the paper's batch per GPU, each collective waiting :func:`negotiation_s` (``negotiation=False``: none).
    The fraction of linear scaling is ``compute_s / step_s``.  ``kwargs`` go to :func:`timeline_step` (the
    codec is free unless ``codec=`` rates are given, as in the Fig.-5 tables)."""
    workers = list(workers) if workers is not None else pm.worker_counts()
    c = model.compute_s[cluster.gpu] if compute_s is None else compute_s
    sizes, names = model.sizes, [n for n, _ in model.tensors]
    rows = []
    for N in workers:
        cyc = negotiation_s(N, cluster.network) if negotiation else 0.0
        rows.append({m: timeline_step(sizes, c, N, cluster.network, m, cycle_s=cyc, names=names, **kwargs)
                     for m in methods})
    return rows


__all__ = ["CodecRates", "HOROVOD_CYCLE_TIME_S", "TERNGRAD_METHODS", "Timeline", "measure_codec_rates", "method_of",
           "negotiation_s", "scheduled_scaling", "timeline_step"]
