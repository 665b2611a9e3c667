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

Codec work is charged from ``CodecRates`` (modelling/codec_rates.py: seconds per element of each stage,
measured on the machine with ``codec_rates.measure_codec_rates``); None = free.  Cost: O(tensors) per prediction
(O(G·tensors) with node-aware groups).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from ..codec import sizes as wire
from ..exchange import cost, policy, topology
from ..exchange.names import method_of_setting, setting_of, transport_of
from . import perfmodel as pm
from .codec_rates import CodecRates


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


# the two-stage exchanges' collective names (exchange/sharded.py, exchange/reternarized.py): (alltoall, allgather);
# the requantized exchange is sent by reternarized.send and gathered by reternarized.after_alltoall (its own
# owner stage), so its collectives carry the re-ternarized exchange's names
_TWO_STAGE = {"sharded": ("a2a", "sg"), "reternarized": ("rt", "rg"), "requantized": ("rt", "rg")}
# the flat groups' methods of a plan (perfmodel.plan_buffers) that the two-stage schedule runs
_TWO_STAGE_KINDS = (pm.TERNGRAD_SHARDED, pm.TERNGRAD_RETERNARIZED, pm.TERNGRAD_REQUANTIZED)


def method_of(config: pm.TernGradConfig) -> str:
    """The performance model's method for a TernGradConfig's ``exchange`` (``exchange.names.method_of_setting``)."""
    return method_of_setting(config.exchange)


def _two_stage_bytes(transport: str, sizes: Sequence[int], ranks: int, cfg: pm.TernGradConfig) -> tuple:
    """(bytes to each peer in the alltoall, bytes per owner in the allgather) of a two-stage exchange of a group
    (exchange/cost.py's, from codec/sizes.py): the sharded exchange's codes and sums, the re-ternarized one's
    shard payload (both stages), the requantized one's shard payload up and 4-bit owner payload with the noise
    channel down (``requantized_bytes``: P differs from c); (0, 0) for the allgather."""
    if transport == "sharded":
        return pm.sharded_bytes(sizes, ranks, cfg.packing)
    if transport == "reternarized":
        return (cost.reternarized_bytes(sizes, ranks, cfg.packing, cfg.bucket_size),) * 2
    if transport == "requantized":
        return cost.requantized_bytes(sizes, ranks, cfg.packing, cfg.bucket_size)
    return (0, 0)


def _decode_rate(c: CodecRates, transport: str, ranks: int) -> float:
    """Seconds per output element of a group's final decode: the owners' sums (sharded), one owner's payload
    per element (re-ternarized), or the N payloads of the allgather exchange."""
    if transport == "sharded":
        return c.decode_sums
    if transport in ("reternarized", "requantized"):   # one owner's payload per element (requantized: 4-bit groups)
        return c.decode_base + c.decode_per_payload
    return c.decode_base + c.decode_per_payload * ranks


class _Payload(NamedTuple):
    """One TernGrad exchange as the engine sends it: a flat group on all N ranks, or a local rank's pieces
    of a node-aware group among the M ranks of its cross group."""
    key: str                  # the collectives' name suffix: "<group>" or "<group>.x<j>"
    elements: int
    two_stage: str            # "" (allgather), or the two-stage exchange: "sharded", "reternarized", "requantized"
    payload: float            # allgather: packed bytes per rank
    two_stage_bytes: tuple    # two-stage: (bytes per peer in the alltoall, bytes per rank in the allgather)
    ranks: int
    link: pm.Network
    ranks_per_nic: int        # the alltoall's G
    allgather_kind: str       # fusion kind: a cross group's allgathers never fuse with the world's


def _owner_seconds(c: CodecRates, e: _Payload) -> float:
    """The owners' work of a two-stage exchange between its alltoall and its allgather: sharded, add the N chunks;
    re-ternarized, decode the shard's N payloads and ternarize it again; requantized, decode them, form the noise
    estimate from them (a second decode's work) and encode the average in 4-bit groups (charged as statistics +
    encode)."""
    if e.two_stage == "sharded":
        return c.owner_sum * e.elements
    if e.two_stage == "reternarized":
        return (c.decode_base + c.decode_per_payload * e.ranks + c.prepare + c.encode) * e.elements / e.ranks
    return (2 * (c.decode_base + c.decode_per_payload * e.ranks) + c.prepare + c.encode) * e.elements / e.ranks


class _Step(NamedTuple):
    """The step simulated, whatever its method: the tensors (layer order) and the backward's order, the compute
    before and during backward, the link among all ranks, the codec's rates and the engine's options."""
    method: str
    sizes: list
    order: list               # backward: last layer first
    total: int                # elements of all tensors (1 for none)
    fwd: float
    bwd: float
    compute_s: float
    workers: int
    network: pm.Network
    link: pm.Network          # ``network.link_for(workers)``
    codec: CodecRates
    cycle_s: float
    joins: bool


def _full_precision_step(step: _Step, fusion_bytes: int) -> Timeline:
    """fp32 or fp16: backward (fp16: each gradient cast on the way), Horovod's allreduces fused from the tensors
    ready when the channel frees up, fp16's cast back."""
    s, c, sizes, order = step, step.codec, step.sizes, step.order
    chan = _Channel(s.cycle_s)
    main = s.fwd
    codec_s = 0.0
    ready = {}
    width = 4 if s.method == pm.FP32 else 2
    for i in order:
        main += s.bwd * sizes[i] / s.total
        if s.method == pm.FP16:
            main += c.cast * sizes[i]
            codec_s += c.cast * sizes[i]
        ready[i] = main
    backward_end = main
    # Horovod: when the channel frees up, every ready tensor (up to the fusion threshold) goes in one buffer
    t_free, k, last_done = 0.0, 0, s.fwd
    while k < len(order):
        start = max(t_free, ready[order[k]] + s.cycle_s)
        nbytes, j = 0, k
        while j < len(order) and ready[order[j]] + s.cycle_s <= start and (
                j == k or nbytes + width * sizes[order[j]] <= fusion_bytes):
            nbytes += width * sizes[order[j]]
            j += 1
        lat, bw = _split(pm.allreduce_time, nbytes, s.workers, s.link)
        chan.ops.append(["allreduce", start, bw, lat, order[k:j]])
        t_free = last_done = start + lat + bw
        k = j
    end = max(backward_end, last_done)
    if s.method == pm.FP16:
        cast_back = c.cast * sum(sizes)
        end += cast_back
        codec_s += cast_back
    busy = sum(op[2] + op[3] for op in chan.ops)
    return Timeline(s.method, s.workers, end, s.compute_s, backward_end, busy, codec_s, chan.rounds())


class _Cross(NamedTuple):
    """A local rank's cross exchange of a node-aware group: its pieces among the M ranks of its cross group."""
    pieces: list              # element counts
    shard: int                # their sum
    transport: str            # the cross engine's transport for them
    shared: bool              # whether it shares the scaler (a handshake first)
    payload: int              # allgather: packed bytes per rank
    handshake: int            # shared scaler: the handshake's bytes
    two_stage_bytes: tuple    # two-stage: (bytes per peer in the alltoall, bytes per rank in the allgather)


@dataclass(frozen=True)
class _Groups:
    """TernGrad's groups of one step as the frontend cuts them and the engine sends them (``perfmodel.plan_buffers``:
    each group's method, flat or node-aware), members in backward order, with every size the schedule charges:
    codec/sizes.py's, exchange/topology.py's and exchange/cost.py's."""
    cfg: pm.TernGradConfig
    groups: list              # the TernGrad groups (perfmodel.PlannedBuffer)
    plain: set                # the tensors kept at full precision (Horovod's fp32 allreduce)
    group_of: dict            # tensor -> its group
    last_member: dict         # a group's last member (whose hook hands the group over) -> the group
    kinds: list               # each group's method
    numel: list
    handshake: list           # shared scaler: the handshake's bytes
    payload: list             # allgather: packed bytes per rank
    shard: list               # two-stage: (bytes to each peer, bytes per owner), the slowest rank's
    hier: list                # the node-aware groups
    M: int                    # nodes (1 without node-aware groups)
    G: int                    # ranks per node (1 without node-aware groups)
    intra: pm.Network         # the link inside a node (exchange.cost.hierarchical_cost's)
    xlink: pm.Network         # a G-th of the inter-node link, as each cross group sees it
    intra_bytes: dict         # node-aware group -> (the largest shard to each local peer, + status words back)
    split: dict               # node-aware group -> its shard plan (exchange.topology.shard_plan)
    decide_on: pm.Network     # the network the engine's "auto" decides with

    def cross_of(self, g: int, j: int) -> _Cross:
        """Local rank j's cross exchange of node-aware group g: its pieces among the M ranks of its cross
        group, with the transport the setting gives them (the config's, or for "auto" policy.auto_transport on a
        G-th of the node's link, as hierarchical._start_cross decides)."""
        cfg, pieces = self.cfg, [p.numel for p in self.split[g][j]]
        transport = policy.transport_among(self.groups[g].cross, self.M)   # the cross engine's among M ranks
        if transport is None:                                              # "auto": per local rank, for its pieces
            transport = "allgather" if not pieces else policy.auto_transport(
                pieces, self.M, cfg.packing, cfg.bucket_size, network=cost.cross_network(self.decide_on, self.G),
                shared_scaler=cfg.scaler_shared_for("allgather"))
        return _Cross(pieces, sum(pieces), transport, cfg.scaler_shared_for(transport),
                      sum(wire.payload_size(n, cfg.packing, cfg.bucket_size) for n in pieces),
                      wire.handshake_size([wire.num_buckets(n, cfg.bucket_size) for n in pieces]),
                      _two_stage_bytes(transport, pieces, self.M, cfg))


def _plan_groups(step: _Step, config: pm.TernGradConfig | None, packing: str | None, fusion_bytes: int,
                 fusion_numel: int | None, names: Sequence[str] | None, auto_network: pm.Network | None,
                 hierarchical) -> _Groups:
    """The groups as the frontend cuts them (exchange.fusion), each with the engine's exchange or node-aware."""
    N, network = step.workers, step.network
    # the scaler the engine uses with this exchange (config.shares_scaler; a per-rank scaler with the
    # sharded exchange is refused there, as TernGradConfig refuses it)
    cfg = pm.terngrad_config(config, packing).replace(exchange=setting_of(step.method))
    decide_on = auto_network or network
    plan = pm.plan_buffers(step.method, step.sizes, N, decide_on, cfg.packing, fusion_bytes, fusion_numel,
                           config=cfg, names=names, hierarchical=hierarchical,
                           step_allreduces=pm.HOROVOD_STEP_ALLREDUCES if step.joins else 0,
                           ranks_per_node=network.ranks_per_node)
    node_aware = pm.TERNGRAD_HIERARCHICAL
    groups = [b for b in plan if b.method in (pm.TERNGRAD_ALLGATHER,) + _TWO_STAGE_KINDS + (node_aware,)]
    kinds = [b.method for b in groups]
    hier = [g for g, k in enumerate(kinds) if k == node_aware]
    M, G = pm.node_shape(N, network) if hier else (1, 1)
    return _Groups(
        cfg, groups, plain={i for b in plan if b.method == pm.FP32 for i in b.members},
        group_of={i: g for g, b in enumerate(groups) for i in b.members},
        last_member={b.members[-1]: g for g, b in enumerate(groups)}, kinds=kinds,
        numel=[sum(b.sizes) for b in groups],
        handshake=[wire.handshake_size([wire.num_buckets(n, b.bucket_size) for n in b.sizes]) for b in groups],
        payload=[sum(wire.payload_size(n, cfg.packing, b.bucket_size) for n in b.sizes) for b in groups],
        shard=[_two_stage_bytes(transport_of(k) or "", b.sizes, N, cfg) for b, k in zip(groups, kinds)],
        hier=hier, M=M, G=G, intra=network.intra_node or network, xlink=cost.cross_network(network, G),
        intra_bytes={g: topology.intra_node_bytes(groups[g].sizes, G, cfg.intra_node_width) for g in hier},
        split={g: topology.shard_plan(groups[g].sizes, G) for g in hier}, decide_on=decide_on)


class _Schedule:
    """One TernGrad step of local rank ``j`` (None: no node-aware group): the main thread and the inter-node
    and intra-node channels, driven as the flat engine (exchange/engine.py) and the node-aware one
    (exchange/hierarchical.py) drive them (the module docstring); :meth:`run` returns the Timeline."""

    def __init__(self, step: _Step, plan: _Groups, j: int | None):
        self.step, self.plan, self.j, self.c = step, plan, j, step.codec
        self.chan, self.local = _Channel(step.cycle_s), _Channel(step.cycle_s)   # inter-node, intra-node channel
        self.main, self.codec_s = step.fwd, 0.0
        self.issued = []                  # TernGrad's collectives, in the order the engine issues them
        self.hx = {g: plan.cross_of(g, j) for g in plan.hier}
        # per-rank two-stage exchanges sent from the hook: their owner steps wait for the engine's next progress
        # (the first finish), flat and cross engine each their own
        self.flat_owner, self.cross_owner = [], []
        self.started = []                 # flat shared scaler: handshake out, not advanced
        self.presence_sent = self.h_presence_sent = False
        # node-aware: alltoall out (the previous group is the ordered start's slack), gone across (in order),
        # shared-scaler cross groups not advanced yet, finished across, gathered; groups in flight, members left
        self.a2a_queue, self.previous, self.cross_queue, self.x_started = [], None, [], []
        self.crossed, self.gathered, self.live = set(), set(), 0
        self.unfinished = {g: len(plan.groups[g].members) for g in plan.hier}

    # -- the main thread and the channels
    def work(self, seconds: float) -> None:
        self.main += seconds
        self.codec_s += seconds

    def submit(self, ch: _Channel, kind: str, label: str, fn, nbytes: float, ranks: int, lk: pm.Network,
               *extra) -> None:
        lat, bw = _split(fn, nbytes, ranks, lk, *extra)
        ch.submit(self.main, kind, label, lat, bw)
        self.issued.append(f"terngrad.{label}")

    def wait(self, ch: _Channel, label) -> None:
        self.main = max(self.main, ch.finish_time(label))

    def presence(self, g: int) -> None:
        """A presence check (4-byte allreduce-sum of all ranks, sent with group g), waited for in the hook."""
        self.submit(self.chan, "allreduce_i32", f"presence.{g}", pm.allreduce_time, 4, self.step.workers,
                    self.step.link)
        self.wait(self.chan, f"presence.{g}")

    # -- the engine's payload stages (exchange/engine.py), for the flat groups and, as the node-aware transport
    # reuses that engine among the M ranks of its cross group, for local rank j's pieces
    def flat_payload(self, g: int) -> _Payload:
        s, p = self.step, self.plan
        return _Payload(str(g), p.numel[g], transport_of(p.kinds[g]) if p.kinds[g] in _TWO_STAGE_KINDS else "",
                        p.payload[g], p.shard[g], s.workers, s.link,
                        s.network.ranks_per_node if s.link is s.network else s.workers, "allgather")

    def cross_payload(self, q: int) -> _Payload:
        x = self.hx[q]
        return _Payload(f"{q}.x{self.j}", x.shard, x.transport if x.transport in _TWO_STAGE else "", x.payload,
                        x.two_stage_bytes, self.plan.M, self.plan.xlink, 1, "allgather@cross")

    def send(self, e: _Payload) -> None:               # engine: _send_per_rank / _after_handshake
        self.work(self.c.encode * e.elements)
        if e.two_stage:
            self.submit(self.chan, "alltoall", f"{_TWO_STAGE[e.two_stage][0]}.{e.key}", pm.alltoall_time,
                        e.two_stage_bytes[0], e.ranks, e.link, e.ranks_per_nic)
        else:
            self.submit(self.chan, e.allgather_kind, f"ag.{e.key}", pm.ring_allgather_time, e.payload, e.ranks,
                        e.link)

    def advance(self, pending: list) -> None:
        """The engine's progress(block=True) over ``pending`` exchanges (in start order): every handshake,
        then every alltoall that this queued (sharded: the owners' sums and their allgather)."""
        for e in pending:
            self.wait(self.chan, f"hs.{e.key}")
            self.send(e)
        self.owner_steps(pending)

    def owner_steps(self, pending: list) -> None:
        """Every two-stage exchange of ``pending`` whose alltoall went out, in start order: the owners' work
        (:func:`_owner_seconds`) and their allgather."""
        for e in pending:
            if e.two_stage:
                a2a, ag = _TWO_STAGE[e.two_stage]
                self.wait(self.chan, f"{a2a}.{e.key}")
                self.work(_owner_seconds(self.c, e))
                self.submit(self.chan, e.allgather_kind, f"{ag}.{e.key}", pm.ring_allgather_time,
                            e.two_stage_bytes[1], e.ranks, e.link)

    # -- the node-aware exchange across nodes (exchange/hierarchical.py)
    def start_cross(self, q: int) -> None:             # hierarchical._start_cross
        p, x = self.plan, self.hx[q]
        self.wait(self.local, f"h.a2a.{q}")
        self.work(self.c.fp32_pass * p.G * x.shard)    # node sum: G-1 adds of the shard, then / G
        self.cross_queue.append(q)
        if not x.pieces:
            return
        self.work(self.c.prepare * x.shard)             # the cross engine's statistics of every piece
        if not x.shared:
            e = self.cross_payload(q)                   # per-rank scalers: no presence check of its own
            self.send(e)
            if e.two_stage:
                self.cross_owner.append(e)
        else:
            self.submit(self.chan, "allreduce_max@cross", f"hs.{q}.x{self.j}", pm.allreduce_time, x.handshake, p.M,
                        p.xlink)
            # its ordered start: every group before the previous one
            self.advance([self.cross_payload(r) for r in self.x_started[:-1]])
            self.x_started = self.x_started[-1:] + [q]

    def finish_cross(self, q: int) -> None:            # hierarchical._finish_cross
        p, x = self.plan, self.hx[q]
        if x.pieces:
            self.wait(self.chan, f"{_TWO_STAGE.get(x.transport, ('', 'ag'))[1]}.{q}.x{self.j}")
            self.work(_decode_rate(self.c, x.transport, p.M) * x.shard)
        self.submit(self.local, "allgather", f"h.ag.{q}", pm.ring_allgather_time, p.intra_bytes[q][1], p.G, p.intra)
        self.crossed.add(q)

    # -- backward: the hooks
    def hook(self, i: int) -> None:
        """Tensor i's gradient is ready: its share of backward, then what its hook sends."""
        s, p = self.step, self.plan
        self.main += s.bwd * s.sizes[i] / s.total
        if i in p.plain:               # kept at full precision: Horovod's fp32 allreduce (fuses with fp32 only)
            lat, bw = _split(pm.allreduce_time, 4 * s.sizes[i], s.workers, s.link)
            self.chan.submit(self.main, "allreduce_fp32", ("ar", i), lat, bw)
        g = p.last_member.get(i)
        if g is None:
            return
        if p.kinds[g] == pm.TERNGRAD_HIERARCHICAL:
            self.hook_node_aware(g)
        else:
            self.hook_flat(g)

    def hook_node_aware(self, g: int) -> None:         # hierarchical.start_group, in the hook
        p = self.plan
        if self.step.joins and not self.h_presence_sent:   # its own presence check, at the step's first such group
            self.h_presence_sent = True
            self.presence(g)
        if len(p.groups[g].members) > 1:
            self.work(self.c.fp32_pass * p.numel[g])   # the members laid end to end
        self.submit(self.local, "alltoall", f"h.a2a.{g}", pm.alltoall_time, p.intra_bytes[g][0], p.G, p.intra, p.G)
        self.live += 1
        for q in self.a2a_queue:       # ordered: one group of slack, earlier groups go on across nodes
            if q != self.previous:
                self.start_cross(q)
        self.a2a_queue = [q for q in self.a2a_queue if q == self.previous] + [g]
        self.previous = g

    def hook_flat(self, g: int) -> None:               # engine.start_group, in the hook
        p = self.plan
        self.work(self.c.prepare * p.numel[g])        # the statistics of every member
        if not p.cfg.scaler_shared_for(transport_of(p.kinds[g])):   # per-rank ("auto": its allgather groups)
            if self.step.joins and not self.presence_sent:   # the presence check goes out with the first such group
                self.presence_sent = True
                self.presence(g)
            e = self.flat_payload(g)                   # payloads leave from the hook, with each rank's own scalers
            self.send(e)
            if e.two_stage:
                self.flat_owner.append(e)
        else:
            self.submit(self.chan, "allreduce_max", f"hs.{g}", pm.allreduce_time, p.handshake[g], self.step.workers,
                        self.step.link)
            # ordered start: every group before the previous one, waiting
            self.advance([self.flat_payload(q) for q in self.started[:-1]])
            self.started = self.started[-1:] + [g]

    # -- the optimizer's synchronize: tensors in hook order; the first flat TernGrad finish advances every flat
    # group, a node-aware finish every node-aware one (each engine its own queues)
    def finish(self, i: int) -> None:
        p = self.plan
        if i in p.plain:
            self.wait(self.chan, ("ar", i))
            return
        g = p.group_of[i]
        if p.kinds[g] == pm.TERNGRAD_HIERARCHICAL:
            self.finish_node_aware(i, g)
        else:
            self.finish_flat(i, g)

    def finish_node_aware(self, i: int, g: int) -> None:   # hierarchical.finish
        if g not in self.crossed:
            for q in self.a2a_queue:
                self.start_cross(q)
            self.a2a_queue = []
            self.advance([self.cross_payload(q) for q in self.x_started])
            self.x_started = []
            self.owner_steps(self.cross_owner)
            self.cross_owner = []
            at = self.cross_queue.index(g)        # its intra-node allgather and every earlier group's
            for q in self.cross_queue[:at + 1]:
                self.finish_cross(q)
            self.cross_queue = self.cross_queue[at + 1:]
        if g not in self.gathered:
            self.wait(self.local, f"h.ag.{g}")
            self.gathered.add(g)
        self.work(self.c.fp32_pass * self.step.sizes[i])   # the member's values out of the gathered shards
        self.unfinished[g] -= 1
        if self.unfinished[g] == 0:
            self.live -= 1
            if self.live == 0 and self.step.joins:          # the end-of-step sync (Horovod frontend)
                self.submit(self.chan, "allreduce_i32", f"h.done.{g}", pm.allreduce_time, 4, self.step.workers,
                            self.step.link)
                self.wait(self.chan, f"h.done.{g}")

    def finish_flat(self, i: int, g: int) -> None:         # engine.finish
        if self.started:
            self.advance([self.flat_payload(q) for q in self.started])
            self.started = []
        if self.flat_owner:
            self.owner_steps(self.flat_owner)
            self.flat_owner = []
        transport = transport_of(self.plan.kinds[g])
        self.wait(self.chan, f"{_TWO_STAGE.get(transport, ('', 'ag'))[1]}.{g}")
        self.work(_decode_rate(self.c, transport, self.step.workers) * self.step.sizes[i])

    def run(self) -> Timeline:
        s = self.step
        for i in s.order:
            self.hook(i)
        backward_end = self.main
        for i in s.order:
            self.finish(i)
        busy = sum(op[2] + op[3] for op in self.chan.ops)
        intra_busy = sum(op[2] + op[3] for op in self.local.ops)
        return Timeline(s.method, s.workers, self.main, s.compute_s, backward_end, busy, self.codec_s,
                        self.chan.rounds() + self.local.rounds(), len(self.issued), tuple(self.issued), intra_busy,
                        self.j)


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
    step = _Step(method, sizes, list(range(len(sizes)))[::-1], sum(sizes) or 1, compute_s * (1 - backward_fraction),
                 compute_s * backward_fraction, compute_s, N, network, network.link_for(N),
                 codec or CodecRates(0, 0, 0, 0, 0, 0, 0, 0), cycle_s, joins)
    if N <= 1:
        return Timeline(method, N, compute_s, compute_s, compute_s, 0.0, 0.0, 0)
    if method in (pm.FP32, pm.FP16):
        return _full_precision_step(step, fusion_bytes)
    if method not in pm.TERNGRAD_METHODS:
        raise ValueError(f"method must be one of {(pm.FP32, pm.FP16) + pm.TERNGRAD_METHODS}, got {method!r}")
    plan = _plan_groups(step, config, packing, fusion_bytes, fusion_numel, names, auto_network, hierarchical)
    if not plan.hier:
        return _Schedule(step, plan, None).run()
    if local_rank is not None and not 0 <= int(local_rank) < plan.G:
        raise ValueError(f"local_rank must be in [0, {plan.G}), got {local_rank!r}")
    ranks = range(plan.G) if local_rank is None else [int(local_rank)]
    return max((_Schedule(step, plan, j).run() for j in ranks), key=lambda t: t.step_s)    # ties: the lowest local rank


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


__all__ = ["CodecRates", "HOROVOD_CYCLE_TIME_S", "Timeline", "method_of", "negotiation_s",
           "scheduled_scaling", "timeline_step"]
