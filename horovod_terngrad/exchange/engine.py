"""The exchange engine: ternarize, exchange and average tensors over a ``Collectives`` (see collectives.py).

One gradient's path, for a group of one tensor or several fused ones (shared scaler, the default):

1. ``start_group`` (from the backward hook; never waits for the network): per member one pass of
   statistics (``backends``) gives the clip threshold c·σ and the local scalers; the group's handshake
   vector (handshake.py) goes out as one asynchronous allreduce-max.  Groups whose handshakes are back
   are advanced right away (step 2).
2. When a handshake is back (``progress``): every member is ternarized with the agreed scalers and
   packed; the payloads travel by the group's transport, which the engine's plan names per group
   (``policy.ExchangePlan``, made once by the plan step, ``plan_exchange``, before the first exchange): ``allgather.py``
   (every rank gets every payload), ``sharded.py`` (alltoall to shard owners, owners' sums by allgather),
   ``reternarized.py`` and ``requantized.py`` (alltoall to shard owners, who encode their shard's sum again,
   then an allgather of those), or ``joined.py`` (while a rank is in ``hvd.join()``).
3. ``finish`` (from the optimizer's synchronize): first every outstanding handshake, then every
   outstanding alltoall, is advanced (so no group waits behind another), then this member's result is
   waited for and decoded.

With per-rank scalers (``shared_scaler=False``, the default of the allgather exchange) there is no
handshake per group: payloads leave from ``start_group`` and their headers carry each rank's scalers and
NaN flag.  Only the first group of a step asks, by one allreduce-sum of a 1 per rank, whether every rank
takes part (``Presence``): a rank in ``hvd.join()`` adds 0, and Horovod refuses allgathers while a rank has
joined (and its joined rank's background loop dies of the refusal, so trying first is not an option).
In such a step the groups take the shared-scaler handshake and the join transport instead.

Fusing changes how many collectives run, never a bit of any result: each member keeps its statistics,
scaler, random stream and payload.  Collectives are named ``terngrad.{hs,ag,a2a,sg,join}.<group>`` after
the group name the caller gives (every rank gives the same).

While some rank is in ``hvd.join()`` (seen in the handshake), the group travels by allreduce-sum instead
(joined.py): joined ranks count as zero gradients, as in Horovod's own average.  A failed collective
raises the collectives' own error class (on Horovod, a ``HorovodInternalError``, which elastic training
catches), with TernGrad's detail in the message.

Errors (NaN/Inf, ranks that disagree) are decided from data every rank has, so every rank raises (or
zeroes) together and no collective is left waiting on a rank that gave up.
"""
from __future__ import annotations

import logging
import time

import torch

from .. import backends, codec
from ..config import TernGradConfig
from ..errors import NonFiniteGradientError, RankMismatchError, TernGradError
from . import allgather, handshake, joined, link, policy, requantized, reternarized, sharded
from .collectives import CollectiveError, Collectives
from .stats import ExchangeStats, Inspection

log = logging.getLogger("horovod_terngrad")
_stated: set = set()        # the plan lines rank 0 said in this process

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TRANSPORTS = {"allgather": allgather, "sharded": sharded, "reternarized": reternarized, "requantized": requantized,
              "joined": joined}
SHARDED_FIRST_STAGE = ("reternarized", "requantized")     # ternarized per shard, shards to their owners


def check_gradient(tensor: torch.Tensor, name: str) -> None:
    """Reject what cannot be ternarized, naming the tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"TernGrad: '{name}' is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.is_sparse:
        raise TypeError(f"TernGrad: gradient '{name}' is sparse; use sparse_as_dense=True")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(f"TernGrad: gradient '{name}' has dtype {tensor.dtype}; ternary compression "
                        "needs a floating-point tensor (float16, bfloat16, float32 or float64)")


def say_plan(plan: policy.ExchangePlan, rank: int) -> None:
    """Rank 0 says a settled plan in one line (``policy.ExchangePlan.statement``), once per process and line (an engine
    made again for a new Horovod world with the same plan says nothing new): at WARNING level where it rests on a
    measurement, where ternarizing does not pay, or where the node-aware exchange cannot run where it would matter;
    else at INFO."""
    if rank != 0 or not plan.settled:
        return
    line = plan.statement()
    if line not in _stated:
        _stated.add(line)
        log.log(logging.WARNING if plan.loud else logging.INFO, line)


def settle_full_precision(out: torch.Tensor, name: str, config: TernGradConfig, stats: ExchangeStats,
                          warned: set) -> torch.Tensor:
    """Apply ``config.on_nonfinite`` to a tensor that travelled at full precision (under ``min_numel``, by
    ``exclude``, with compression off or not paying): ``out`` is the reduced result, which the allreduce gives
    every rank byte for byte, so a NaN/Inf on any rank is seen on every rank and every rank decides alike with
    no further collective.  "propagate": ``out`` as it is (the allreduce propagated the NaN/Inf already; no
    pass, no synchronization).  Else raises ``NonFiniteGradientError``, or zeroes ``out`` in place (counted,
    warned once per tensor); that costs one pass over the result (and, on a GPU, one synchronization)."""
    if config.on_nonfinite == "propagate" or out.numel() == 0 or bool(torch.isfinite(out).all()):
        return out
    msg = (f"TernGrad: gradient '{name}' (sent at full precision) is NaN/Inf after the allreduce: at least one "
           "rank's gradient held NaN or Inf")
    if config.on_nonfinite == "raise":
        raise NonFiniteGradientError(msg)
    stats.nonfinite_zeroed += 1
    if name not in warned:
        warned.add(name)
        log.warning("%s; its averaged gradient is set to zero on every rank this step (on_nonfinite='zero'; "
                    "warned once per tensor)", msg)
    return out.zero_()


class Ticket:
    """One tensor in flight: what ``start`` fixed about it, then how its exchange went."""

    __slots__ = ("engine", "group", "name", "shape", "dtype", "source", "_g32", "threshold", "key", "nb", "average",
                 "in_place", "shared", "slot", "payload_bytes", "error", "zero", "poisoned", "prep", "finished",
                 "want_noise", "noise", "noise_out", "route", "step", "bucket", "squares", "fmt")

    def __init__(self, engine, name, shape, dtype, flat, threshold, key, nb, average, in_place, step=0, bucket=0):
        self.engine, self.group = engine, None
        self.step = step           # the step word of its random streams
        self.bucket = bucket       # the bucket size it is ternarized with (the re-ternarized exchange: per shard)
        self.name, self.shape, self.dtype = name, shape, dtype
        # the flat gradient as the backend reads it: fp32, or bf16 where the backend reads bf16 (BF16_INPUT)
        self.source = flat
        self._g32 = flat if flat.dtype == torch.float32 else None
        self.threshold, self.key, self.nb = threshold, key, nb
        self.average = average
        self.in_place = in_place   # the average may be written into the input's memory (fp32 contiguous)
        self.shared = None         # the agreed scalers (shared scaler only)
        self.slot = None           # position among the group's sent members; None: nothing sent
        self.payload_bytes = 0
        self.error = None          # raised by finish
        self.zero = False          # the result is zero (agreed empty, or zeroed NaN/Inf)
        self.poisoned = False      # the result is NaN on every rank (NaN/Inf somewhere, on_nonfinite='propagate')
        self.prep = None           # the statistics (codec.Prepared): scalers, NaN flag, for the handshake
        self.finished = False      # finish() has returned its average or raised
        self.want_noise = False    # the caller asks for the ternary noise estimate (allgather.noise_estimate)
        self.noise = None          # ... and gets it here, when the transport has every rank's payload
        self.noise_out = None      # where the transport writes it (fp32, the tensor's size); None: a fresh tensor
        self.route = None          # precision.Route: what the optimizer's ledger decided and wants (precision.py)
        self.squares = False       # its payloads carry the sender's squares (codec/squares.py), decided at the send
        self.fmt = None            # its first-stage payload's wire format (config.first_stage_format), at the encode

    @property
    def numel(self) -> int:
        """The gradient's element count (read from ``source``: asking ``g32`` for it would convert a bf16 gradient)."""
        return self.source.numel()

    @property
    def g32(self) -> torch.Tensor:
        """The flat fp32 gradient; from a bf16 ``source``, converted when a path first asks for it (the default
        path, encode and decode, never does)."""
        if self._g32 is None:
            self._g32 = self.source.to(torch.float32)
        return self._g32


def follow_routes(tickets: list, routes: list | None) -> None:
    """Arm each ticket with its ``precision.Route`` (None: none), before anything can move it on."""
    if routes is None:
        return
    if len(routes) != len(tickets):
        raise TernGradError(f"TernGrad: {len(routes)} precision routes for {len(tickets)} tensors")
    for tk, route in zip(tickets, routes):
        if route is not None:
            route.arm(tk)


class Presence:
    """Per-rank scalers: whether every rank takes part in this step, asked once per step (the first group
    started after a ``finish``) by an allreduce-sum of a 1 from each rank; ranks in ``hvd.join()`` add 0."""

    __slots__ = ("handle", "active", "error")

    def __init__(self, handle):
        self.handle, self.active, self.error = handle, None, None


class Group:
    """The tensors that share one handshake and one exchange (one tensor, or several fused), and the
    state of their collectives."""

    __slots__ = ("name", "members", "transport", "bucket_size", "presence", "hs", "a2a", "a2a_own", "ag", "sent",
                 "bytes_sent", "gathered", "walked", "gather_error", "unfinished")

    def __init__(self, name: str, members: list, transport: str, bucket_size: int = 0):
        self.name, self.members, self.transport = name, members, transport
        self.bucket_size = bucket_size   # the configured buckets of its exchange (TernGradConfig.bucket_size)
        self.presence = self.hs = self.a2a = self.ag = None
        self.a2a_own = 0                 # sharded: bytes of the alltoall addressed to this rank itself
        self.sent: list = []             # members whose payloads travel, in payload order
        self.bytes_sent = 0
        self.gathered = None
        self.walked = None               # (headers, offsets) of the gathered payloads (re-ternarized: per member)
        self.gather_error = None
        self.unfinished = len(members)   # members not finished yet; at 0 the group lets go of them

    @property
    def fused(self) -> bool:
        return len(self.members) > 1


class Engine:
    """Ternarize, exchange and average tensors over ``collectives`` (see the module docstring).

    ``steps`` counts, per tensor name, the exchanges started: the ``step`` word of each tensor's random
    stream key.  Pass a shared dict (and ``stats`` / ``inspection``) to keep them in a state object.

    ``ordered`` (the default): the collectives this engine issues, and their order, are a pure function
    of the calls made to it.  Starting a group first issues its own first collective, then waits for and
    advances every group started before the previous one (one group of slack: their handshakes are
    long back).  Why: Horovod names an unnamed op after a rank-local handle counter
    (``allreduce.noname.<handle>``), so if one rank issued a payload allgather between two calls that
    another rank issued later (as polling for finished handshakes does), a user's unnamed
    ``hvd.allreduce`` (or TernGrad's own placeholder of an unnamed ``hvd.grouped_allreduce``) got
    different names on the ranks and hung.  ``ordered=False`` polls instead (advance whatever is back):
    for a driver that plays every rank from one thread (the simulator), where waiting would deadlock."""

    def __init__(self, collectives: Collectives, config: TernGradConfig | None = None,
                 stats: ExchangeStats | None = None, inspection: Inspection | None = None,
                 steps: dict | None = None, ordered: bool = True, joins: bool | None = None,
                 stream_rank: int | None = None):
        self.coll = collectives
        self.config = config or TernGradConfig()
        self.stats = stats if stats is not None else ExchangeStats()
        self.inspection = inspection if inspection is not None else Inspection()
        self.steps: dict[str, int] = steps if steps is not None else {}
        self._awaiting_presence: list[Group] = []     # per-rank groups (ordered=False only)
        self._awaiting_handshake: list[Group] = []
        self._awaiting_alltoall: list[Group] = []
        self._presence: Presence | None = None        # this step's; a finish ends the step
        # whether a rank may sit in a join (Horovod, ThreadWorld); torch.distributed has no such state.  The
        # hierarchical exchange's cross-node engine passes False: it asked the whole world already.
        self.joins = getattr(collectives, "joins", True) if joins is None else joins
        # the rank word of the random streams' key: this group's rank, or (cross-node engine of the
        # hierarchical exchange) the global rank, so every rank of the job draws its own streams
        self.stream_rank = stream_rank
        self._warned_nonfinite: set = set()
        self.ordered = ordered
        self._previous: Group | None = None     # the group started last (ordered: left in flight)
        # what it runs (policy.ExchangePlan): until the plan step (plan_exchange), the configured network's plan
        self.plan = policy.exchange_plan(self.config, collectives.size)
        self.planned = False        # the plan step made a settled plan
        # why the node-aware exchange cannot run over this engine's ranks, and whether that is quiet (one node, or one
        # rank per node), where a frontend found it so (frontends/hierarchy.py): its plan says so
        self.node_aware_off: tuple = ()
        # the caller guarantees every rank sends the same members, sizes and settings (checked by the caller
        # once): the allgather transport then decodes without reading headers on the host (no GPU sync)
        self.layout_known = False
        # the caller reads the NaN/Inf outcome itself from the results (the node-aware exchange's status words):
        # on an accelerator a flagged member comes back NaN-filled on the device even under on_nonfinite="raise",
        # instead of its flags being read on the host once per member (the re-ternarized and requantized
        # transports; the allgather's walk reads headers on the host anyway)
        self.nonfinite_on_device = False

    @property
    def link(self) -> "link.LinkDecision | None":
        """The link ``exchange="auto"`` measured and agreed in the plan step (None: not measured)."""
        return self.plan.link

    def plan_exchange(self, device: torch.device) -> policy.ExchangePlan:
        """The plan step: measure what the settings price (``exchange="auto"``: the link, exchange/link.py), make the
        plan every later exchange reads (``policy.ExchangePlan``: per group its transport; whether ternarizing
        pays at all), and say it on rank 0 in one line.  A measurement is collective, so every rank of the engine
        calls this at the same point before its first exchange (the frontends: at their first tensor to ternarize).
        Later calls return the plan made; a plan made while a rank was in ``hvd.join()`` (``settled`` False: nothing
        could be measured) is made again by the next call.  An engine whose plan step never runs (a driver of its
        own, the simulator) exchanges on the configured network's plan."""
        if not self.planned:
            self.plan = self.measure_plan(device)
            self.planned = self.plan.settled
            say_plan(self.plan, self.coll.rank)
        return self.plan

    def measure_plan(self, device: torch.device) -> policy.ExchangePlan:
        """The plan on what this engine measures (the plan step's work, without saying it): collectives every rank
        of the engine issues alike."""
        decision = None
        if policy.measures_link(self.config):
            try:
                decision = link.measure(self.coll, device, self.config.packing)
            except CollectiveError as e:
                raise e.detailed("TernGrad: measuring the link for exchange='auto' failed")
        return policy.exchange_plan(self.config, self.coll.size, decision,
                                    settled=decision is not None or not policy.measures_link(self.config),
                                    off=self.node_aware_off)

    # -- public -------------------------------------------------------------------------------
    def start(self, tensor: torch.Tensor, name: str, average: bool = True, in_place: bool = False,
              route=None) -> Ticket:
        """Begin averaging ``tensor``.  With ``in_place`` the result may be written into ``tensor``
        itself (the Horovod frontend allows it: the gradient is replaced by the result anyway), which
        saves allocating and page-faulting a new buffer per step.  ``route``: what ``precision.route``
        decided for it (the ticket then asks for the noise estimate the optimizer's ledger wants)."""
        return self.start_group([(tensor, name)], name, average, in_place, routes=[route])[0]

    def start_group(self, items: list, group: str, average: bool = True, in_place: bool = False,
                    transport: str | None = None, routes: list | None = None, want_noise: list | None = None) -> list:
        """Begin averaging several tensors ``[(tensor, name), ...]`` with one handshake and one exchange
        named after ``group`` (tensor fusion; every rank must form the same groups, in the same member
        order).  Results are bit-identical to starting each tensor alone.  The transport is the one the
        engine's plan names for the whole group (``transport``: a caller that decided already, the hierarchical
        exchange).  ``routes``: one ``precision.Route`` (or None) per item; ``want_noise``: or, without a route,
        whether each item asks for the noise estimate (the node-aware exchange's pieces).  Returns one ticket per
        item, each finished with ``finish``."""
        cfg = self.config
        t0 = time.perf_counter()
        tickets = []
        device = items[0][0].device if items else None
        backend = backends.for_device(device) if items else None
        transport = transport or (self.plan.transport([t.numel() for t, _ in items]) if items else cfg.exchange)
        buckets = cfg.bucket_size
        for tensor, name in items:
            check_gradient(tensor, name)
            step = self.steps.get(name, 0)
            self.steps[name] = step + 1
            flat = tensor.detach().reshape(-1)
            if not (flat.dtype == torch.bfloat16 and backends.has_capability(backend, backends.BF16_INPUT)):
                flat = flat.to(torch.float32)
            flat = flat.contiguous()
            if flat.device != device:
                raise TernGradError(f"TernGrad: fused group '{group}' mixes devices ({flat.device} for '{name}')")
            bucket = (reternarized.encode_bucket(self, flat.numel(), buckets) if transport in SHARDED_FIRST_STAGE
                      else buckets)
            prep = backend.prepare(flat, bucket, cfg.clip_factor)
            tk = Ticket(self, name, tensor.shape, tensor.dtype, flat, prep.threshold,
                        codec.stream_key(cfg.seed, step, codec.tensor_id(name),
                                         self.coll.rank if self.stream_rank is None else self.stream_rank),
                        prep.scalers.numel(),
                        average, in_place and flat.data_ptr() == tensor.data_ptr() and tensor.dtype == torch.float32,
                        step, bucket)
            tk.prep = prep
            tickets.append(tk)
        follow_routes(tickets, routes)
        for tk, wanted in zip(tickets, want_noise or ()):
            tk.want_noise = bool(wanted)
        grp = Group(group, tickets, transport, buckets)
        for tk in tickets:
            tk.group = grp
        if not tickets:
            return tickets
        self.stats.codec_s += time.perf_counter() - t0
        if cfg.scaler_shared_for(grp.transport):
            self._start_with_handshake(grp)
            return tickets
        if not self.joins:            # no rank can be in a join: payloads leave at once
            self._send_per_rank(grp)
            return tickets
        if self._presence is None:
            # a host tensor whatever the gradients' device: the count is read on the host, and reading a device
            # tensor there would make the host wait for the GPU's queue (Horovod reduces host tensors on its own)
            self._presence = Presence(self.coll.allreduce_sum_async(
                torch.ones(1, dtype=torch.int32), f"terngrad.presence.{grp.name}"))
            self.stats.collectives += 1
            self.stats.handshake_bytes_sent += 4
        grp.presence = self._presence
        if self.ordered:
            self._after_presence(grp)     # waits only in the step's first group
        else:
            self._awaiting_presence.append(grp)
        return tickets

    def finish(self, tk: Ticket) -> torch.Tensor:
        """Wait for a ticket's exchange and return the average (or sum) in the tensor's shape and dtype."""
        self._presence = None     # the next group starts another step, which a rank may have left by join
        try:
            self.progress(block=True)
            if tk.error is not None:
                raise tk.error
            out = self._receive(tk)
        finally:
            self._release(tk)
        if out is None:   # agreed empty, zeroed by on_nonfinite='zero', or NaN by 'propagate'
            out = torch.full((tk.source.numel(),), float("nan") if tk.poisoned else 0.0, dtype=torch.float32,
                             device=tk.source.device)
        self.inspection.record_average(tk.name, out)
        return out.view(tk.shape).to(tk.dtype)

    @staticmethod
    def _release(tk: Ticket) -> None:
        """Once every member of a group is finished, the group drops its members and received bytes.  Why:
        tickets and their group point at each other, a cycle that only Python's cycle collector frees, so
        every gradient a ticket holds (``g32``, in place: the gradient's own memory) and the gathered
        payloads outlived the step until a collection ran; on ResNet-50 that was ~100 MB of fresh memory,
        about 30,000 page faults, in every backward pass of the next step."""
        grp = tk.group
        if tk.finished or grp is None:
            return
        tk.finished = True
        grp.unfinished -= 1
        if grp.unfinished == 0:
            grp.members, grp.sent = [], []
            grp.gathered = grp.walked = None

    def allreduce(self, tensor: torch.Tensor, name: str, average: bool = True) -> torch.Tensor:
        return self.finish(self.start(tensor, name, average))

    def progress(self, block: bool, keep: "Group | None" = None) -> None:
        """Advance the groups whose handshake is back (all, if ``block``: waiting for them) into their
        exchange, then likewise the sharded groups whose alltoall is back, in start order; ``keep`` stays
        in flight.  ``finish`` calls it; a driver that plays several ranks from one thread calls
        ``progress(block=False)`` on every rank until nothing moves, then finishes (see
        modelling/simulate.py)."""
        self._awaiting_presence = self._advance(self._awaiting_presence, lambda g: g.presence.handle,
                                                self._after_presence, block, keep)
        self._awaiting_handshake = self._advance(self._awaiting_handshake, lambda g: g.hs, self._after_handshake,
                                                 block, keep)
        # (the first stage may have queued new alltoalls; they are advanced here too)
        self._awaiting_alltoall = self._advance(self._awaiting_alltoall, lambda g: g.a2a,
                                                lambda g: TRANSPORTS[g.transport].after_alltoall(self, g), block, keep)

    def settled(self, tickets: list) -> bool:
        """Whether ``finish`` of these tickets would not wait on the network: each one failed, sends nothing,
        or its group's payload collective has completed (for a driver that polls, see ``ordered``)."""
        for tk in tickets:
            grp = tk.group
            if tk.error is not None or tk.zero or tk.poisoned or grp.gathered is not None or grp.gather_error is not None:
                continue
            if grp.ag is None or not self.coll.poll(grp.ag):
                return False
        return True

    def pending(self) -> tuple:
        """(groups waiting for their presence check or handshake, sharded groups waiting for their alltoall)."""
        return len(self._awaiting_presence) + len(self._awaiting_handshake), len(self._awaiting_alltoall)

    def reset(self) -> None:
        """Forget every group in flight (after a failed step, or when the world changes); keeps
        ``steps``, ``stats`` and ``inspection``, which belong to whoever passed them in."""
        self._awaiting_presence, self._awaiting_handshake, self._awaiting_alltoall = [], [], []
        self._previous = self._presence = None

    def _receive(self, tk: Ticket):
        """The member's result from its transport, or None when it sent nothing or is zeroed."""
        if tk.slot is None or tk.zero or tk.poisoned:
            return None
        return TRANSPORTS[tk.group.transport].receive(self, tk)

    def _start_with_handshake(self, grp: Group, advance: bool = True) -> None:
        """Send the group's handshake (the agreed scalers, checks, joined ranks), then (``advance``) move
        earlier groups on: ordered, every one started before the previous one, waiting (their handshakes
        are long back); polling, those whose handshakes are back."""
        t0 = time.perf_counter()
        hs = handshake.build([tk.prep for tk in grp.members], grp.members, self.coll.rank, self.coll.size)
        self.stats.codec_s += time.perf_counter() - t0
        self._send_handshake(grp, hs)
        if advance:
            self.progress(block=self.ordered, keep=self._previous if self.ordered else None)
        self._awaiting_handshake.append(grp)
        self._previous = grp

    def _after_presence(self, grp: Group) -> None:
        """Per-rank scalers: once the step's presence is known, encode and send the group's payloads; in a
        step where a rank is in hvd.join(), go by the shared-scaler handshake and the join transport
        instead (the scaler is then the max over the active ranks; the random streams are the same)."""
        p = grp.presence
        if p.active is None and p.error is None:
            t0 = time.perf_counter()
            try:
                p.active = int(self.coll.synchronize(p.handle)[0])
            except CollectiveError as e:    # keeps the collectives' error class (Horovod's, for elastic)
                p.error = e
            finally:
                self.stats.handshake_wait_s += time.perf_counter() - t0
        if p.error is not None:
            for tk in grp.members:
                tk.error = p.error.detailed(f"TernGrad: the presence check before gradient '{tk.name}' failed")
            return
        if p.active != self.coll.size:      # (polling: this runs inside progress, which must not recurse)
            self._start_with_handshake(grp, advance=self.ordered)
            return
        self._send_per_rank(grp)

    def _send_per_rank(self, grp: Group) -> None:
        """Encode every member with its own scalers (NaN flag in the header) and allgather the payloads."""
        t0 = time.perf_counter()
        cfg, sends = self.config, []
        backend = backends.for_device(grp.members[0].source.device)
        for tk in grp.members:
            prep = tk.prep
            on_host = prep.nonfinite.device.type == "cpu"
            payload = self._encode(backend, tk, prep.scalers, flags=int(bool(prep.nonfinite)) if on_host else 0)
            if not on_host:          # the flag byte, written on the device (no host synchronization)
                payload[3:4] = prep.nonfinite.to(torch.uint8).reshape(1)
            payload = self._with_squares(tk, grp, payload)
            self._record(tk, payload, prep.scalers)
            sends.append((tk, payload))
        self.stats.codec_s += time.perf_counter() - t0
        TRANSPORTS[grp.transport].send(self, grp, sends)

    def _send_handshake(self, grp: Group, hs: torch.Tensor) -> None:
        grp.hs = self.coll.allreduce_max_async(hs, f"terngrad.hs.{grp.name}")
        self.stats.collectives += 1
        self.stats.handshake_bytes_sent += hs.numel() * hs.element_size()

    # -- used by the transports -------------------------------------------------------------------
    def queue_alltoall(self, grp: Group) -> None:
        self._awaiting_alltoall.append(grp)

    def nonfinite(self, tk: Ticket, msg: str) -> None:
        """A member held NaN/Inf on some rank (every rank learns it from the same bytes: the handshake, the
        payload headers' flags): its average is NaN on every rank, or every rank raises, or zeroes it
        (config.on_nonfinite).  Decided from host values the exchange reads anyway: no synchronization added."""
        policy = self.config.on_nonfinite
        if policy == "propagate":
            tk.poisoned = True
            self.stats.nonfinite_propagated += 1
        elif policy == "raise":
            tk.error = NonFiniteGradientError(msg)
        else:
            tk.zero = True
            self.stats.nonfinite_zeroed += 1
            if tk.name not in self._warned_nonfinite:
                self._warned_nonfinite.add(tk.name)
                log.warning("%s; its averaged gradient is set to zero on every rank this step "
                            "(on_nonfinite='zero'; warned once per tensor)", msg)

    # -- internals ----------------------------------------------------------------------------
    def _advance(self, queue: list, handle, step, block: bool, keep: "Group | None" = None) -> list:
        """Run ``step`` on the groups but ``keep`` whose collective ``handle(group)`` completed (all, if
        block); return the rest."""
        waiting = []
        for grp in queue:
            if grp is not keep and (block or self.coll.poll(handle(grp))):
                step(grp)
            else:
                waiting.append(grp)
        return waiting

    def _after_handshake(self, grp: Group) -> None:
        t0 = time.perf_counter()
        try:
            values = self.coll.synchronize(grp.hs)
        except CollectiveError as e:    # keeps the collectives' error class (Horovod's, for elastic)
            # Horovod (and ThreadWorld) say "Mismatched ..." when ranks handed different shapes
            mismatch = "Mismatched" in str(e)
            for tk in grp.members:
                tk.error = e.detailed(
                    (f"TernGrad: ranks disagree on gradient '{tk.name}'" if mismatch else
                     f"TernGrad: the handshake of gradient '{tk.name}' failed")
                    + f" (shape {tuple(tk.shape)}, {tk.numel} elements on rank {self.coll.rank}"
                    + (f", fused in group '{grp.name}'" if grp.fused else "") + ")",
                    RankMismatchError if mismatch else None)
            return
        finally:
            self.stats.handshake_wait_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        verdict = handshake.read(values.tolist(), [tk.nb for tk in grp.members])
        if verdict.mismatch is not None:
            for tk in grp.members:
                where = (f"the gradients fused in group '{grp.name}' ({verdict.mismatch}), among them '{tk.name}'"
                         if grp.fused else f"gradient '{tk.name}': {verdict.mismatch}")
                tk.error = RankMismatchError(f"TernGrad: ranks disagree on {where} (this rank {self.coll.rank}: "
                                             f"shape {tuple(tk.shape)}, dtype {tk.dtype})")
            return
        if verdict.joined:     # some rank is in hvd.join(): only allreduces work until all have joined
            grp.transport = "joined"
        sends = []
        for tk, member in zip(grp.members, verdict.members):
            payload = self._encode_agreed(tk, member)
            if payload is not None:
                sends.append((tk, payload))
        self.stats.codec_s += time.perf_counter() - t0
        if sends:
            TRANSPORTS[grp.transport].send(self, grp, sends)

    def _encode_agreed(self, tk: Ticket, member: handshake.MemberVerdict) -> torch.Tensor | None:
        """One member's payload, ternarized with the agreed scalers, or None if it sends nothing."""
        if member.first_bad >= 0:
            self.nonfinite(tk, NonFiniteGradientError.describe(tk.name, tk.shape, member.first_bad, member.last_bad))
            return None
        if tk.source.numel() == 0:
            tk.zero = True   # agreed empty: nothing to send, the result is the empty tensor
            return None
        tk.shared = torch.tensor(member.scalers, dtype=torch.float32, device=tk.source.device)
        payload = self._encode(backends.for_device(tk.source.device), tk, tk.shared)
        payload = self._with_squares(tk, tk.group, payload)
        self._record(tk, payload, tk.shared)
        return payload

    def _encode(self, backend, tk: Ticket, scalers: torch.Tensor, flags: int = 0) -> torch.Tensor:
        """One member's first-stage payload with ``scalers``: the ternary code, or the four-level code where the
        config and the group's transport take it (``config.first_stage_format``), its dithers stratified over this
        engine's ranks (codec/levels.py: every rank of the averaging group draws the same strata stream)."""
        cfg = self.config
        tk.fmt = cfg.first_stage_format(tk.group.transport)
        if tk.fmt != codec.sizes.FOUR_LEVEL:
            return backend.encode(tk.source, tk.threshold, scalers, tk.bucket, tk.key, cfg.packing, flags=flags,
                                  shape=tk.shape)
        strata = codec.levels.strata_key(cfg.seed, tk.step, codec.tensor_id(tk.name))
        return backend.encode_levels(tk.source, tk.threshold, scalers, tk.bucket, tk.key, strata, self.coll.rank,
                                     self.coll.size, flags=flags, shape=tk.shape)

    @staticmethod
    def _with_squares(tk: Ticket, grp: Group, payload: torch.Tensor) -> torch.Tensor:
        """The allgather transport's payload of a member whose optimizer asked for the noise estimate carries the
        sender's squares (codec/squares.py: the estimate's minibatch share is taken out with them).  The
        two-stage transports attach them per shard (reternarized.send)."""
        tk.squares = tk.want_noise and grp.transport == "allgather"
        if not tk.squares:
            return payload
        return codec.squares.attach(payload, backends.clipped_square_sums(tk.source, tk.threshold,
                                                                          [(0, tk.source.numel())]))

    def _record(self, tk: Ticket, payload: torch.Tensor, scalers: torch.Tensor) -> None:
        self.stats.tensors += 1
        self.stats.elements += tk.source.numel()
        if self.inspection.wants(tk.name):
            self.inspection.record(tk.name, tk.g32, tk.threshold, payload, scalers, tk.fmt, tk.bucket)
