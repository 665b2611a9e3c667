"""Scheduled step-time model: when each collective runs during a step, as Horovod and this library run it.

``perfmodel.predict_step`` adds compute, communication and codec times (with an optional overlap
fraction).  That over-charges real steps in two ways that the emulated-cluster measurements showed
(docs/cluster.md): Horovod starts a gradient's collective while backward is still running, and
collectives submitted while the network is busy are fused into one round, so latency is paid per round,
not per buffer.  This module simulates one step on one worker instead, with two resources:

* the **main thread** (a CPU core): forward; backward, one tensor after the other in reverse layer order,
  each taking a share of the backward time proportional to its size; the work the compressor does on
  it, in the order exchange/engine.py does it (below); fp16's casts.
* the **channel** (Horovod's background thread and the link): one collective at a time, in submission
  order.  A collective starts ``cycle_s`` after its submission, or when the channel frees up, whichever
  is later.  An allreduce or allgather submitted before the last queued one of its kind has started
  joins it (Horovod's tensor fusion): one latency term for the round, the bandwidth terms added.  (Only
  the last queued round is joined, alltoalls never fuse, and allreduces of different dtypes or ops
  (fp32 sums, the int32 presence check, fp64 handshake maxima) do not fuse, as in Horovod.)

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
* **synchronize** (the optimizer's, tensors in hook order): the first TernGrad tensor advances every group
  still in flight (all handshakes, then all alltoalls); each member then waits for its group's allgather
  and is decoded.  Tensors the config keeps at full precision (``min_numel``, ``exclude``) go through
  Horovod's fp32 allreduce as they become ready and are waited for in their turn.  (Horovod's allreduce
  of the empty tensor TernGrad's compress hands it is not charged.)

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
machine with :func:`measure_codec_rates`); None = free.  Cost: O(tensors) per prediction.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from ..codec import sizes as wire
from . import perfmodel as pm


@dataclass(frozen=True)
class CodecRates:
    """Seconds per element of each codec stage on one worker (one core).

    prepare: statistics, clip threshold and scaler, per gradient element (in the backward hook);
    encode: ternarize + pack, per element; decode_base + decode_per_payload·N: allgather decode of N
    payloads, per output element; owner_sum: per code an owner adds (sharded: N·n/N = n per step);
    decode_sums: per element of the gathered sums; cast: one fp32<->fp16 cast, per element.
    """

    prepare: float
    encode: float
    decode_base: float
    decode_per_payload: float
    owner_sum: float
    decode_sums: float
    cast: float

    def slowed(self, factor: float) -> "CodecRates":
        """Every stage ``factor`` times slower (ranks sharing a core)."""
        return CodecRates(*(factor * getattr(self, f) for f in self.__dataclass_fields__))


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
        return CodecRates(prepare, encode, max(0.0, dec[1] - per_payload), per_payload, owner, dsums, cast)
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
    channel_busy_s: float     # total time the channel spent in collectives
    codec_s: float            # codec work on the main thread
    rounds: int               # collective rounds after fusion
    collectives: int = 0      # TernGrad's own collectives (the engine's ``stats.collectives`` per step)
    issued: tuple = ()        # their names in the order the engine issues them (terngrad.<kind>.<group index>)


# the engine's ``exchange`` setting behind each TernGrad method of the performance model
TERNGRAD_METHODS = {pm.TERNGRAD_ALLGATHER: "allgather", pm.TERNGRAD_SHARDED: "sharded", pm.TERNGRAD_BEST: "auto"}


def method_of(config: pm.TernGradConfig) -> str:
    """The performance model's method for a TernGradConfig's ``exchange`` (the inverse of TERNGRAD_METHODS)."""
    return {v: k for k, v in TERNGRAD_METHODS.items()}[config.exchange]


def timeline_step(tensor_sizes: Sequence[int], compute_s: float, workers: int, network: pm.Network,
                  method: str = pm.FP32, *, codec: CodecRates | None = None, backward_fraction: float = 2 / 3,
                  packing: str | None = None, fusion_bytes: int = pm.HOROVOD_FUSION_BYTES,
                  fusion_numel: int | None = None, cycle_s: float = 0.0, config: pm.TernGradConfig | None = None,
                  names: Sequence[str] | None = None, joins: bool = True,
                  auto_network: pm.Network | None = None, hierarchical=None) -> Timeline:
    """Simulate one step (see the module docstring).  ``tensor_sizes`` (and ``names``) in layer (forward)
    order; ``packing``, ``fusion_numel``, ``config`` and ``names`` cut TernGrad's groups as
    ``perfmodel.exchange_plan`` does; ``config``'s scaler setting (``shared_scaler``) with the method's
    exchange decides between the per-rank and the shared-scaler schedule.  ``joins``: the collectives may
    have a rank in ``hvd.join()`` (Horovod), so per-rank scalers send the step's presence check; False for
    torch.distributed.  ``auto_network``: the network the engine's ``exchange="auto"`` decides with
    (``exchange.cost.configured_network()`` in the job's environment); default ``network``.

    Flat exchange only: where the plan (``hierarchical``, default ``config.hierarchical``, on the nodes of
    ``network.ranks_per_node``) sends a group node-aware, this raises NotImplementedError rather than
    schedule it as something else; ``perfmodel.predict_step`` charges that plan (additively).  What the
    schedule lacks for it: the intra-node alltoall and allgather on the intra-node link, the node sum, and
    the cross engine's own queue on a G-th of the node's link with each local rank's pieces."""
    if not 0.0 <= backward_fraction <= 1.0:
        raise ValueError("backward_fraction must be in [0, 1]")
    sizes = [int(s) for s in tensor_sizes]
    N = int(workers)
    total = sum(sizes) or 1
    link = network.link_for(N)
    fwd = compute_s * (1 - backward_fraction)
    bwd = compute_s * backward_fraction
    zero = CodecRates(0, 0, 0, 0, 0, 0, 0)
    c = codec or zero
    chan = _Channel(cycle_s)
    main = fwd
    codec_s = 0.0
    order = list(range(len(sizes)))[::-1]         # backward: last layer first
    ready = {}
    if N <= 1:
        return Timeline(method, N, compute_s, compute_s, compute_s, 0.0, 0.0, 0)

    if method in (pm.FP32, pm.FP16):
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
        raise ValueError(f"method must be one of {pm.METHODS}, got {method!r}")
    # the groups as the frontend cuts them (exchange.fusion), each with the engine's exchange; members in
    # backward order; every size from codec/sizes.py and exchange/cost.py
    cfg = pm.terngrad_config(config, packing)
    # the scaler the engine uses with this exchange (config.shares_scaler; a per-rank scaler with the
    # sharded exchange is refused there, as TernGradConfig refuses it)
    cfg = cfg.replace(exchange=TERNGRAD_METHODS[method])
    plan = pm.plan_buffers(method, sizes, N, auto_network or network, cfg.packing, fusion_bytes, fusion_numel,
                           config=cfg, names=names, hierarchical=hierarchical)
    if any(b.exchange == pm.TERNGRAD_HIERARCHICAL for b in plan):
        raise NotImplementedError("timeline_step schedules the flat exchange only: this plan sends groups "
                                  "node-aware (pass hierarchical=False for the flat schedule, or use "
                                  "perfmodel.predict_step)")
    groups = [b for b in plan if b.exchange in pm.TERNGRAD_EXCHANGES]
    plain = {i for b in plan if b.exchange not in pm.TERNGRAD_EXCHANGES for i in b.members}   # kept at fp32
    group_of = {i: g for g, b in enumerate(groups) for i in b.members}
    last_member = {b.members[-1]: g for g, b in enumerate(groups)}
    kinds = [b.exchange for b in groups]
    numel = [sum(b.sizes) for b in groups]
    handshake = [wire.handshake_size([wire.num_buckets(n, cfg.bucket_size) for n in b.sizes]) for b in groups]
    payload = [sum(wire.payload_size(n, cfg.packing, cfg.bucket_size) for n in b.sizes) for b in groups]
    # sharded: every member sharded on its own; (bytes to each peer, bytes of sums per owner), slowest rank
    shard = [pm.sharded_bytes(b.sizes, N, cfg.packing) if k == pm.TERNGRAD_SHARDED else (0, 0)
             for b, k in zip(groups, kinds)]
    issued = []                                   # TernGrad's collectives, in the order the engine issues them

    def work(seconds: float) -> None:
        nonlocal main, codec_s
        main += seconds
        codec_s += seconds

    def submit(kind: str, name: str, g, fn, nbytes: float, *extra) -> None:
        lat, bw = _split(fn, nbytes, N, link, *extra)
        chan.submit(main, kind, (name, g), lat, bw)
        issued.append(f"terngrad.{name}.{g}")

    def wait(name: str, g) -> None:
        nonlocal main
        main = max(main, chan.finish_time((name, g)))

    def encode_and_send(g: int) -> None:          # engine: _send_per_rank / _after_handshake
        work(c.encode * numel[g])
        if kinds[g] == pm.TERNGRAD_SHARDED:
            submit("alltoall", "a2a", g, pm.alltoall_time, shard[g][0],
                   network.ranks_per_node if link is network else N)
        else:
            submit("allgather", "ag", g, pm.ring_allgather_time, payload[g])

    def advance(pending: list) -> None:
        """The engine's progress(block=True) over ``pending`` groups (in start order): every handshake,
        then every alltoall that this queued (sharded: the owners' sums and their allgather)."""
        for g in pending:
            wait("hs", g)
            encode_and_send(g)
        for g in pending:
            if kinds[g] == pm.TERNGRAD_SHARDED:
                wait("a2a", g)
                work(c.owner_sum * numel[g])
                submit("allgather", "sg", g, pm.ring_allgather_time, shard[g][1])

    started = []                                  # shared scaler: groups whose handshake is out, not advanced
    presence_sent = False
    for i in order:
        main += bwd * sizes[i] / total
        if i in plain:                   # kept at full precision: Horovod's fp32 allreduce (fuses with fp32 only)
            lat, bw = _split(pm.allreduce_time, 4 * sizes[i], N, link)
            chan.submit(main, "allreduce_fp32", ("ar", i), lat, bw)
        g = last_member.get(i)
        if g is None:
            continue
        work(c.prepare * numel[g])       # start_group: the statistics of every member, in the hook
        if not cfg.scaler_shared_for(TERNGRAD_METHODS[kinds[g]]):   # per-rank ("auto": its allgather groups)
            if joins and not presence_sent:   # the presence check goes out with the step's first such group
                presence_sent = True
                submit("allreduce_i32", "presence", g, pm.allreduce_time, 4)
                wait("presence", g)
            encode_and_send(g)           # payloads leave from the hook, with each rank's own scalers
        else:
            submit("allreduce_max", "hs", g, pm.allreduce_time, handshake[g])
            advance(started[:-1])        # ordered start: every group before the previous one, waiting
            started = started[-1:] + [g]
    backward_end = main
    # the optimizer's synchronize: tensors in hook order; the first TernGrad finish advances every group
    for i in order:
        if i in plain:
            wait("ar", i)
            continue
        g = group_of[i]
        if started:
            advance(started)
            started = []
        wait("ag" if kinds[g] != pm.TERNGRAD_SHARDED else "sg", g)
        work((c.decode_sums if kinds[g] == pm.TERNGRAD_SHARDED else c.decode_base + c.decode_per_payload * N)
             * sizes[i])
    busy = sum(op[2] + op[3] for op in chan.ops)
    return Timeline(method, N, main, compute_s, backward_end, busy, codec_s, chan.rounds(), len(issued),
                    tuple(issued))


__all__ = ["CodecRates", "TERNGRAD_METHODS", "Timeline", "measure_codec_rates", "method_of", "timeline_step"]
