"""The hierarchical transport: full precision inside a node, TernGrad across nodes.

For M nodes of G ranks each (topology.py says which ranks share a node), one fused group of members
n_1..n_k is averaged in three stages, every local rank using the network at once:

1. **Intra-node reduce-scatter**, by one fp32 alltoall on the node's ranks (``terngrad.h.a2a.<group>``): the
   members laid end to end are cut into G near-equal shards (``topology.shard_plan``), local rank j
   receives shard j from every local rank and adds them in local-rank order (then / G when averaging:
   the node mean).  An alltoall rather than a library reduce-scatter, so the order of the additions is
   ours, identical on every node and checkable bit for bit.
2. **TernGrad across nodes** on that shard, among local rank j of every node (the cross group), by the
   ordinary engine (engine.py) on the cross group's collectives: each piece of a member inside the shard
   is a tensor of its own (``topology.piece_name``: its own layer-wise scaler, its own random stream and
   step counter, keyed by the global rank), by the transport policy.py plans across nodes
   (``policy.cross_transport``: on the cross group's size, and for "auto" on a G-th of the node's link).
3. **Intra-node allgather** of every local rank's averaged shard in fp32 (``terngrad.h.ag.<group>``),
   followed by one status word per piece (ok, NaN/Inf, ranks disagree), so every local rank learns what
   its peers' cross exchanges found: every rank of the job propagates (NaN), raises or zeroes the same
   members (``on_nonfinite``), whether the NaN/Inf arrived inside a node or across nodes.

Result: unbiased, E[out] = mean_r clip(g_r) up to clipping, which now applies to the node means.  Each
element is ternarized once per node (of the node mean) instead of once per rank: the ternary variance
s·|x| - x² is paid M times, not N times, and divided by M² instead of N², so the variance of the average
grows by up to G (exactly G for ranks of a node with equal gradients and equal scalers); less where the
ranks' gradients differ (|mean| < mean |g|) and because each piece's scaler is the max over the piece only
(examples/study_node_variance.py measures it: docs/study/node_variance).  Bytes crossing a node's link per step: G·(M-1)·P(n/G) for the allgather
exchange, against G·(N-1)·P(n/N·...) flat, i.e. about (M-1)/(N-1) of the flat exchange's.

Which groups go node-aware is policy.py's (``policy.node_plan``, read from the engine's plan, made once by the
plan step ``plan_exchange``: the links measured where ``hierarchical="auto"`` prices them); the bf16 intra-node wire and the buffers
reused between steps are node_wire.py's; which ranks share a node, topology.py's.

Joins (Horovod's ``hvd.join()``): the first group of a step asks the whole world, as the per-rank
engine does, whether every rank takes part (4-byte allreduce-sum); in a step where one does not, the
groups go by the flat engine (its join transport), because Horovod refuses alltoall and allgather then.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from ..codec.packing import device_constant
from ..errors import NonFiniteGradientError, RankMismatchError, TernGradError
from . import allgather, cost, link, network_env, policy, topology
from .collectives import CollectiveError, Collectives
from .engine import Engine, Ticket, check_gradient, follow_routes, say_plan
from .node_wire import BufferPool, node_sum, wire_values

log = logging.getLogger("horovod_terngrad")

STATUS_OK, STATUS_NONFINITE, STATUS_MISMATCH, STATUS_FAILED = 0.0, 1.0, 2.0, 3.0
# added to a piece's status when its cross exchange gave no noise estimate (a transport without one, e.g. the
# sharded or the join transport): the members it belongs to then hand the optimizer none, on every local rank
STATUS_NO_NOISE = 16.0


class HierarchicalTicket(Ticket):
    """One member of a hierarchical group (``engine`` is the hierarchical exchange)."""

    __slots__ = ("hgroup", "index")


class HierarchicalGroup:
    """One fused group on its way through the three stages."""

    __slots__ = ("name", "members", "plan", "average", "a2a", "pieces", "node_mean", "ag", "gathered",
                 "error", "unfinished", "cross_started", "local_mismatch", "device", "outbox", "sent", "noisy",
                 "statuses", "wires")

    def __init__(self, name, members, plan, average):
        self.name, self.members, self.plan, self.average = name, members, plan, average
        self.a2a = self.ag = self.gathered = self.error = self.node_mean = self.outbox = self.sent = None
        self.statuses = None            # every local rank's status words, read on the host once per group
        self.wires: dict = {}           # intra_node_dtype="bfloat16": the bf16 send buffers, to reuse next step
        self.pieces: list = []          # this rank's cross tickets, in plan order
        self.unfinished = len(members)
        self.cross_started = False
        self.local_mismatch = False     # this node's ranks disagreed on the group's size
        self.noisy = False              # a member asked for the noise estimate: the allgather carries it
        self.device = members[0].g32.device if members else None


class HierarchicalEngine:
    """The engine's interface (plan_exchange/start/start_group/finish/progress/pending/reset) over a node-aware
    plan.  ``flat`` is the ordinary engine on the whole world (it takes the groups of steps with a joined rank, and
    those ``hierarchical="auto"`` finds cheaper flat); ``local`` and ``cross`` are the collectives of this rank's
    node and of its cross group; ``over``: what carries them, in words (the plan's line says it)."""

    def __init__(self, flat: Engine, local: Collectives, cross: Collectives, topo: topology.Topology,
                 end_of_step_sync: bool = False, over: str = ""):
        self.flat = flat
        self.config = flat.config
        self.coll = flat.coll
        self.local, self.cross, self.topology = local, cross, topo
        self.G, self.M = topo.ranks_per_node, topo.num_nodes
        if local.size != self.G or cross.size != self.M:
            raise TernGradError(f"TernGrad: hierarchical exchange: local group of {local.size} and cross group "
                                f"of {cross.size} ranks do not fit {topo.describe()}")
        # the cross engine asks no presence of its own (this engine asked the world) and keys the random
        # streams by the global rank; it decides NaN/Inf per piece, this engine applies the policy per member
        self.cross_engine = Engine(cross, self.config.replace(on_nonfinite="raise"), flat.stats, flat.inspection,
                                     flat.steps, ordered=flat.ordered, joins=False, stream_rank=flat.coll.rank)
        # on a GPU a flagged piece comes back NaN-filled and _finish_cross tells it from the result on the device
        self.cross_engine.nonfinite_on_device = True
        self.stats, self.inspection, self.steps = flat.stats, flat.inspection, flat.steps
        self.ordered = flat.ordered
        self.joins = flat.joins
        self._a2a_queue: list = []        # groups whose intra-node alltoall is out
        self._cross_queue: list = []      # groups in their cross-node exchange
        self._previous = None
        self._buffers = BufferPool()      # each group's last step's send buffers, to reuse
        self._presence = None             # this step's: whether every rank takes part
        # Horovod: a rank that returns from its step's last intra-node allgather and shuts Horovod down
        # (hvd.shutdown(), or at exit) aborts the other nodes' intra-node ops still in flight.  With
        # ``end_of_step_sync`` the finish that completes the last group in flight waits for a 4-byte
        # allreduce of the whole world, which no rank completes before every rank got there.
        self.end_of_step_sync = end_of_step_sync
        # Group collectives carried by world collectives (world_groups.py): every cross group must post the
        # same collectives under the same names, so the cross exchange is the per-rank allgather (one
        # allgather per group, whatever the data: no handshake verdict can make one cross group skip a
        # payload another sends), its groups are named without the local rank, and a group with fewer
        # elements than G (some local rank would own no piece, and post nothing) goes flat.
        self.spans_world = bool(getattr(local, "spans_world", False) or getattr(cross, "spans_world", False))
        if self.spans_world and not policy.world_groups_fit(self.config):
            raise TernGradError("TernGrad: the node-aware exchange over world collectives needs per-rank scalers "
                                "and the allgather exchange across nodes (shared_scaler=True or "
                                "exchange='sharded' need process sets)")
        self._live = 0                    # hierarchical groups of this step not finished by every member
        self._step_open = False           # a group started since the last finish
        self.over = over
        # what it runs (policy.ExchangePlan): until the plan step (plan_exchange), priced on the configured links
        self.plan = self._node_plan(flat.plan, None)
        self.planned = False

    # -- what the frontends call ------------------------------------------------------------------
    @property
    def link(self):
        return self.flat.link

    def start(self, tensor, name, average=True, in_place=False, route=None):
        return self.start_group([(tensor, name)], name, average, in_place, routes=[route])[0]

    def allreduce(self, tensor, name, average=True):
        return self.finish(self.start(tensor, name, average))

    def measures_links(self) -> bool:
        """Whether ``hierarchical="auto"`` prices measured links rather than the configured ones: unless a rate was
        given (HOROVOD_TERNGRAD_GBPS: the user's, or terngrad-launch's --gbps or its profile's where the user gave
        none) or HOROVOD_TERNGRAD_MEASURE_LINKS=0.  Why: a job started with plain torchrun, mpirun or srun on
        InfiniBand was priced as 1 Gbit/s Ethernet.  Not for a driver that plays every rank from one thread
        (``ordered=False``, the simulator): a probe waits for every rank, and there is no link to measure."""
        return (policy.measures_node_links(self.config) and self.ordered and link.user_rate_Bps() is None
                and os.environ.get("HOROVOD_TERNGRAD_MEASURE_LINKS", "1") != "0")

    def plan_exchange(self, device) -> policy.ExchangePlan:
        """The plan step (``Engine.plan_exchange``): the flat engine's measurement (``exchange="auto"``), then, where
        ``measures_links``, the links across and inside nodes (exchange/link.py's ``measure_links``), agreed; the
        plan of which groups go node-aware on them (``policy.node_plan`` per group), said on rank 0 in one line.
        Every rank of the world calls it at the same point, before the first exchange; a plan made while a rank was
        in ``hvd.join()`` is made again by the next call."""
        if not self.planned:
            self.flat.plan = flat = self.flat.measure_plan(device)
            measured = None
            if self.measures_links():
                try:
                    measured = link.measure_links(self.coll, self.local, device, name="terngrad.link")
                except CollectiveError as e:
                    raise e.detailed("TernGrad: measuring the links for hierarchical='auto' failed")
            self.plan = self._node_plan(flat, measured, settled=measured is not None or not self.measures_links())
            self.planned = self.flat.planned = self.plan.settled
            say_plan(self.plan, self.coll.rank)
        return self.plan

    def _node_plan(self, flat: policy.ExchangePlan, measured: "link.MeasuredLinks | None",
                   settled: bool = True) -> policy.ExchangePlan:
        """The plan over ``flat``'s, priced on the ``measured`` links (None: the configured ones), with the 4-byte
        world allreduces this engine adds to a step (presence check, end-of-step sync) charged to each group."""
        configured = network_env.configured_network(self.G)
        return policy.node_exchange_plan(
            flat, self.M, self.G, self.topology.describe(),
            measured.network(configured) if measured is not None else configured,
            links=measured.describe() if measured is not None else "", settled=settled, spans_world=self.spans_world,
            step_allreduces=int(bool(self.joins)) + int(self.end_of_step_sync), over=self.over)

    def start_group(self, items: list, group: str, average: bool = True, in_place: bool = False,
                    routes: list | None = None) -> list:
        if not items:
            return []
        for tensor, name in items:
            check_gradient(tensor, name)
        numels = [t.numel() for t, _ in items]
        if not self.plan.group(numels).hierarchical or not self._all_present(items[0][0].device, group):
            tickets = self.flat.start_group(items, group, average, in_place, routes=routes)
            for tk in tickets:      # finished through this engine, so that it sees the step end
                tk.engine = self
            return tickets
        t0 = time.perf_counter()
        device = items[0][0].device
        tickets = []
        for tensor, name in items:
            g32 = tensor.detach().reshape(-1).to(torch.float32).contiguous()
            if g32.device != device:
                raise TernGradError(f"TernGrad: fused group '{group}' mixes devices ({g32.device} for '{name}')")
            tk = HierarchicalTicket(self, name, tensor.shape, tensor.dtype, g32, None, None, 0, average,
                                    in_place and g32.data_ptr() == tensor.data_ptr() and tensor.dtype == torch.float32)
            tk.index = len(tickets)
            tickets.append(tk)
        follow_routes(tickets, routes)
        plan = topology.shard_plan(numels, self.G)
        # Every rank counts the steps of every piece, also those other local ranks own (the cross engine
        # counts this rank's own when it starts them): a piece's stream then depends on how often the piece
        # was exchanged, never on which local rank happened to own it (DDP rebuilds its buckets, so a
        # member's pieces can move between local ranks).
        for j, pieces in enumerate(plan):
            if j != self.local.rank:
                for p in pieces:
                    name = topology.piece_name(items[p.member][1], p, numels[p.member])
                    self.steps[name] = self.steps.get(name, 0) + 1
        grp = HierarchicalGroup(group, tickets, plan, average)
        for tk in tickets:
            tk.hgroup = grp
        buf = tickets[0].g32 if len(tickets) == 1 else torch.cat([tk.g32 for tk in tickets])
        splits = [hi - lo for lo, hi in topology.shard_bounds(sum(numels), self.G)]
        own = splits[self.local.rank]
        width = self.config.intra_node_width
        self.stats.intra_node_bytes_sent += width * (buf.numel() - own)
        if width == 2:       # intra_node_dtype="bfloat16": rounded to nearest, sent as its bytes
            buf = self._buffers.wire(grp.wires, grp.name, "a2a", buf)
            splits, own = [2 * s for s in splits], 2 * own
        name = f"terngrad.h.a2a.{group}"
        if getattr(self.local, "takes_sizes", False):   # every local rank sends this rank its shard: same size
            grp.a2a = self.local.alltoall_async(buf, splits, name, received=[own] * self.G)
        else:
            grp.a2a = self.local.alltoall_async(buf, splits, name)
        self.stats.collectives += 1
        self.stats.codec_s += time.perf_counter() - t0
        if not self._step_open:           # a new step: groups an exception abandoned do not count
            self._step_open, self._live = True, 0
        self._live += 1
        if self.ordered:      # one group of slack, as the flat engine: earlier groups go on across nodes
            self._advance_a2a(block=True, keep=self._previous)
        self._a2a_queue.append(grp)
        self._previous = grp
        return tickets

    def finish(self, tk: Ticket) -> torch.Tensor:
        if not isinstance(tk, HierarchicalTicket):
            self._presence, self._step_open = None, False
            return self.flat.finish(tk)
        self._presence = None          # the next group starts another step
        self._step_open = False
        grp = tk.hgroup
        try:
            self.progress(block=True)
            if grp.ag is None and grp.error is None:
                # this group's intra-node allgather and those of every group started before it, issued
                # together (one Horovod cycle, not one round trip each); later groups stay in flight
                at = self._cross_queue.index(grp) if grp in self._cross_queue else -1
                for earlier in self._cross_queue[:at + 1]:
                    if earlier.ag is None and earlier.error is None:
                        self._finish_cross(earlier)
                self._cross_queue = self._cross_queue[at + 1:]
                if grp.ag is None:        # (not in the queue: its cross exchange never started)
                    self._finish_cross(grp)
            out = self._member_result(tk)
        finally:
            grp.unfinished -= 1
            if grp.unfinished == 0:
                if grp.gathered is not None and grp.sent is not None:
                    # its allgather is complete: the buffer serves this group again next step (a fresh
                    # buffer of tens of MB costs its page faults every step, on the cores that compute)
                    # (so do the bf16 send buffers: both collectives that read them are complete)
                    self._buffers.keep(grp.name, grp.sent, grp.wires)
                grp.members, grp.gathered, grp.node_mean, grp.pieces, grp.sent = [], None, None, [], None
                grp.wires = {}
                grp.statuses = None
                self._live -= 1
                if self._live == 0 and self.end_of_step_sync:
                    self._step_done(grp)
        self.inspection.record_average(tk.name, out)
        return out.view(tk.shape).to(tk.dtype)

    def progress(self, block: bool, keep=None) -> None:
        """Move groups on: intra-node alltoalls that are back into their cross-node exchange, the cross
        engine's own stages, and (``block=False``, a driver that plays every rank from one thread) groups
        whose cross exchange is complete into their intra-node allgather."""
        self._advance_a2a(block, keep)
        self.cross_engine.progress(block=block)
        if not block:
            self.flat.progress(block=False)
            waiting = []
            for grp in self._cross_queue:
                # (finishing a piece runs the cross engine's blocking progress: only once it has nothing
                # left that another rank must still post)
                if (grp.ag is None and self.cross_engine.pending() == (0, 0)
                        and (grp.error is not None or self.cross_engine.settled(grp.pieces))):
                    self._finish_cross(grp)
                else:
                    waiting.append(grp)
            self._cross_queue = waiting

    def pending(self) -> tuple:
        a, b = self.cross_engine.pending()
        f1, f2 = self.flat.pending()
        return (len(self._a2a_queue) + a + f1, b + f2 + sum(g.ag is None for g in self._cross_queue))

    def reset(self) -> None:
        self.flat.reset()
        self.cross_engine.reset()
        self._a2a_queue, self._cross_queue = [], []
        self._previous = self._presence = None
        self._buffers.clear()

    # -- stages -----------------------------------------------------------------------------------
    def _step_done(self, grp: HierarchicalGroup) -> None:
        """The world's 4-byte allreduce after a step's last group (see ``end_of_step_sync``); every rank
        finishes the same last group (finish order is the frontend's, the same on every rank)."""
        # a host tensor: waiting on a device one would make the host wait for the GPU's queue as well
        handle = self.coll.allreduce_sum_async(torch.zeros(1, dtype=torch.int32), f"terngrad.h.done.{grp.name}")
        self.stats.collectives += 1
        self.stats.handshake_bytes_sent += 4
        try:
            self.coll.synchronize(handle)
        except CollectiveError as e:
            raise e.detailed(f"TernGrad: the end-of-step check after group '{grp.name}' failed")

    def _all_present(self, device, group: str) -> bool:
        """Whether every rank takes part in this step (asked once per step, at its first group)."""
        if not self.joins:
            return True
        if self._presence is None:
            handle = self.coll.allreduce_sum_async(torch.ones(1, dtype=torch.int32),     # on the host: read there
                                                   f"terngrad.presence.{group}")
            self.stats.collectives += 1
            self.stats.handshake_bytes_sent += 4
            try:
                active = int(self.coll.synchronize(handle)[0])
            except CollectiveError as e:
                raise e.detailed(f"TernGrad: the presence check before group '{group}' failed")
            self._presence = active == self.coll.size
        return self._presence

    def _advance_a2a(self, block: bool, keep=None) -> None:
        waiting = []
        for grp in self._a2a_queue:
            if grp is not keep and (block or self.local.poll(grp.a2a)):
                self._start_cross(grp)
                self._cross_queue.append(grp)
            else:
                waiting.append(grp)
        self._a2a_queue = waiting

    def _start_cross(self, grp: HierarchicalGroup) -> None:
        """Node sum of this rank's shard (local-rank order), then its pieces' exchange across nodes."""
        j = self.local.rank
        pieces = grp.plan[j]
        shard = sum(p.numel for p in pieces)
        t0 = time.perf_counter()
        try:
            received = self.local.synchronize(grp.a2a)
        except CollectiveError as e:
            grp.error = e.detailed(f"TernGrad: the intra-node exchange of group '{grp.name}' failed")
            return
        finally:
            self.stats.gather_wait_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.config.intra_node_width == 2:
            received = wire_values(received)
        self.stats.intra_node_bytes_received += self.config.intra_node_width * (received.numel() - shard)
        # Adam's noise estimate (horovod_terngrad.optim) comes from the cross exchange of the node means, the
        # only ternary rounding on this path; the intra-node allgather carries it beside the shard.  Every rank
        # of the job runs the same optimizer, so every local rank decides alike (a disagreement shows as sizes).
        grp.noisy = any(tk.want_noise for tk in grp.members)
        extra = shard if grp.noisy else 0
        if received.numel() != self.G * shard:
            # Ranks of this node disagree on the group's size.  The cross exchange still runs (its peers on
            # other nodes wait for it), on NaN values, so that every node hears of it; every rank of this
            # node reports the mismatch through the statuses of the intra-node allgather.
            grp.local_mismatch = True
            grp.outbox = torch.full((shard + extra + len(pieces),), float("nan"), dtype=torch.float32,
                                    device=received.device)
            node = grp.outbox[:shard]
        else:
            # the node sum goes straight into the buffer the intra-node allgather sends (the shard, then one
            # status word per piece): no copy of the shard later
            grp.outbox = self._buffers.outbox(grp.name, shard + extra + len(pieces), received.device)
            node = grp.outbox[:shard]
            node_sum(received.view(self.G, shard), node, grp.average)
        grp.node_mean = node
        items, at = [], 0
        for p in pieces:
            member = grp.members[p.member]
            items.append((node[at:at + p.numel], topology.piece_name(member.name, p, member.numel)))
            at += p.numel
        transport = self.plan.cross_transport([p.numel for p in pieces])
        self.stats.codec_s += time.perf_counter() - t0
        tag = "x" if self.spans_world else f"x{j}"
        # asked before the payloads leave: they carry the senders' squares where the estimate is wanted
        grp.pieces = self.cross_engine.start_group(
            items, f"{grp.name}.{tag}", grp.average, in_place=True, transport=transport,
            want_noise=[grp.members[p.member].want_noise for p in pieces]) if items else []
        at = shard
        for ptk, p in zip(grp.pieces, pieces):
            if grp.noisy and ptk.want_noise:     # the estimate straight into its place in the allgather's buffer
                ptk.noise_out = grp.outbox[at:at + p.numel]
            at += p.numel
        grp.cross_started = True

    def _finish_cross(self, grp: HierarchicalGroup) -> None:
        """This rank's averaged shard (and a status per piece) to every rank of the node."""
        j = self.local.rank
        pieces = grp.plan[j]
        status = [STATUS_OK] * len(pieces)
        shard = sum(p.numel for p in pieces)
        on_device = False
        finished = []                # pieces whose exchange completed: on a GPU their NaN/Inf is told there
        if grp.error is not None or not grp.cross_started:
            status = [STATUS_FAILED] * len(pieces)
            grp.outbox = torch.zeros(shard * (2 if grp.noisy else 1) + len(pieces), dtype=torch.float32,
                                     device=grp.members[0].g32.device)
        else:
            on_device = allgather.on_device(grp.outbox)
            at = shard
            for i, ptk in enumerate(grp.pieces):
                try:
                    out = self.cross_engine.finish(ptk)
                    if out.data_ptr() != ptk.g32.data_ptr():
                        ptk.g32.copy_(out.reshape(-1))
                    if grp.noisy:
                        if ptk.noise is not None:
                            if ptk.noise.data_ptr() != grp.outbox[at:].data_ptr():      # (else written there)
                                grp.outbox[at:at + ptk.numel] = ptk.noise.reshape(-1)
                        elif ptk.want_noise:
                            status[i] += STATUS_NO_NOISE
                    finished.append(i)
                except NonFiniteGradientError:
                    status[i] = STATUS_NONFINITE
                except RankMismatchError:
                    status[i] = STATUS_MISMATCH
                except CollectiveError as e:
                    status[i] = STATUS_FAILED
                    grp.error = grp.error or e
                finally:
                    at += ptk.numel        # the next piece's noise goes to its own place, whatever this one did
            if grp.local_mismatch:
                status, finished = [STATUS_MISMATCH] * len(pieces), []
        data, grp.outbox = grp.outbox, None
        grp.sent = data
        tail = data.numel() - len(pieces)
        if on_device:
            # no host read per piece: the statuses known here come as a cached device constant (all ok, step after
            # step), and a piece the cross exchange flagged NaN/Inf (NaN-filled there: nonfinite_on_device) adds
            # STATUS_NONFINITE from its first element, on the device
            data[tail:] = device_constant(status, torch.float32, data.device)
            told = [i for i in finished if grp.pieces[i].numel > 0]
            if told:
                firsts = torch.stack([grp.pieces[i].g32.reshape(-1)[0] for i in told])
                data.index_add_(0, device_constant([tail + i for i in told], torch.int64, data.device),
                                torch.isnan(firsts).to(torch.float32) * STATUS_NONFINITE)
        else:
            data[tail:] = torch.tensor(status, dtype=torch.float32)
        sizes = [sum(p.numel for p in grp.plan[r]) * (2 if grp.noisy else 1) + len(grp.plan[r]) for r in range(self.G)]
        name = f"terngrad.h.ag.{grp.name}"
        width = self.config.intra_node_width
        self.stats.intra_node_bytes_sent += width * data.numel()
        if width == 2:       # the averaged shard, its noise estimate and the status words (small integers: exact)
            data, sizes = self._buffers.wire(grp.wires, grp.name, "ag", data), [2 * s for s in sizes]
        if getattr(self.local, "takes_sizes", False):
            grp.ag = self.local.allgather_async(data, name, sizes=sizes)
        else:
            grp.ag = self.local.allgather_async(data, name)
        self.stats.collectives += 1

    def _read_statuses(self, grp: HierarchicalGroup) -> list:
        """Every local rank's status words of ``grp``, in plan order, read on the host in one go: on a GPU one
        device-to-host read per group (what they say, a peer's failure or disagreement, must raise on every rank
        of the node), not one per piece and member."""
        idx, at = [], 0
        for r in range(self.G):
            pieces = grp.plan[r]
            values = sum(p.numel for p in pieces) * (2 if grp.noisy else 1)
            idx += range(at + values, at + values + len(pieces))
            at += values + len(pieces)
        if at != grp.gathered.numel():
            raise RankMismatchError(f"TernGrad: ranks of this node disagree on group '{grp.name}': gathered "
                                    f"{grp.gathered.numel()} values, expected {at}")
        if not idx:
            return []
        return grp.gathered[device_constant(idx, torch.int64, grp.gathered.device)].tolist()

    def _member_result(self, tk: HierarchicalTicket) -> torch.Tensor:
        grp = tk.hgroup
        if grp.ag is None and isinstance(grp.error, CollectiveError):
            # its intra-node alltoall failed (a rank is gone): nothing was issued after it
            raise grp.error.detailed(f"TernGrad: exchange of gradient '{tk.name}' failed")
        if grp.gathered is None:
            t0 = time.perf_counter()
            try:
                grp.gathered = self.local.synchronize(grp.ag)
            except CollectiveError as e:
                raise e.detailed(f"TernGrad: the intra-node exchange of gradient '{tk.name}' (group "
                                 f"'{grp.name}') failed") from None
            finally:
                self.stats.gather_wait_s += time.perf_counter() - t0
            if self.config.intra_node_width == 2:
                # kept as bf16: each value is widened once, as it is written into its member's result
                grp.gathered = wire_values(grp.gathered)
            self.stats.intra_node_bytes_received += grp.gathered.numel() * self.config.intra_node_width
        if grp.error is not None and isinstance(grp.error, CollectiveError):
            raise grp.error.detailed(f"TernGrad: exchange of gradient '{tk.name}' failed")
        # walk the G blocks: [shard values | their noise estimate, if carried | one status per piece], local-rank
        # order
        out = tk.g32 if tk.in_place else torch.empty_like(tk.g32)
        noise = None
        if grp.noisy and tk.want_noise:     # on the CPU the ledger's buffer of the parameter (precision.Route.arm)
            noise = tk.noise_out
            if noise is None:
                noise = torch.empty_like(tk.g32)
        if grp.statuses is None:
            grp.statuses = self._read_statuses(grp)
        bad, at, noise_missing, k = set(), 0, False, 0
        for r in range(self.G):
            pieces = grp.plan[r]
            shard = sum(p.numel for p in pieces)
            values = grp.gathered[at:at + shard]
            extra = shard if grp.noisy else 0
            off = 0
            for i, p in enumerate(pieces):
                code = grp.statuses[k + i]
                if p.member == tk.index:
                    if code >= STATUS_NO_NOISE:
                        code -= STATUS_NO_NOISE
                        noise_missing = True
                    if code != STATUS_OK:
                        bad.add(code)
                    out[p.start:p.stop] = values[off:off + p.numel]
                    if noise is not None:
                        noise[p.start:p.stop] = grp.gathered[at + shard + off:at + shard + off + p.numel]
                off += p.numel
            at += shard + extra + len(pieces)
            k += len(pieces)
        if at != grp.gathered.numel():
            raise RankMismatchError(f"TernGrad: ranks of this node disagree on group '{grp.name}': gathered "
                                    f"{grp.gathered.numel()} values, expected {at}")
        if STATUS_FAILED in bad:
            raise TernGradError(f"TernGrad: the exchange of gradient '{tk.name}' failed on a rank of this node")
        if STATUS_MISMATCH in bad:
            raise RankMismatchError(f"TernGrad: ranks disagree on gradient '{tk.name}' (shape {tuple(tk.shape)} "
                                    f"on rank {self.coll.rank}): the nodes' shards differ")
        if STATUS_NONFINITE in bad:
            msg = (f"TernGrad: gradient '{tk.name}' (shape {tuple(tk.shape)}) holds NaN/Inf on some rank (seen in "
                   f"the node sums of the hierarchical exchange, which cannot tell the rank)")
            self.flat.nonfinite(tk, msg)
            if tk.error is not None:
                raise tk.error
            out.fill_(float("nan") if tk.poisoned else 0.0)
            noise = None
        tk.noise = None if noise_missing else noise
        return out
