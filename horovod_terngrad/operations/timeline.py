"""Scheduled step-time model: when each collective runs during a step, as Horovod and this library run it.

``perfmodel.predict_step`` adds compute, communication and codec times (with an optional overlap
fraction).  That over-charges real steps in two ways that the emulated-cluster measurements showed
(docs/cluster.md): Horovod starts a gradient's collective while backward is still running, and
collectives submitted while the network is busy are fused into one round, so latency is paid per round,
not per buffer.  This module simulates one step on one worker instead, with two resources:

* the **main thread** (a CPU core): forward; backward, one tensor after the other in reverse layer order,
  each taking a share of the backward time proportional to its size; the work the compressor does on
  it: TernGrad's statistics in the backward hook, encoding once a group's handshake is back (at the next
  hook, or in the optimizer's synchronize), owners' sums (sharded), decoding in synchronize; fp16's casts.
* the **channel** (Horovod's background thread and the link): one collective at a time, in submission
  order.  A collective starts ``cycle_s`` after its submission, or when the channel frees up, whichever
  is later.  An allreduce or allgather submitted before the last queued one of its kind has started
  joins it (Horovod's tensor fusion): one latency term for the round, the bandwidth terms added.  (Only
  the last queued round is joined, and alltoalls never fuse, as in Horovod.)

Collective times are exchange/cost.py's alpha-beta formulas (ring allreduce, ring allgather, pairwise
alltoall; with the network's calibrated efficiencies), on the bytes codec/sizes.py gives: a group's
handshake (``handshake_size``), its payloads (``payload_size``), and for the sharded exchange every
member's shard on its own (``exchange.cost.sharded_bytes``: the slowest rank's bytes to each peer and
sums).  Step time = when the main thread has decoded the last gradient (TernGrad) or the last allreduce
is back and cast (fp32/fp16).

Gradient buffers: Horovod's fusion threshold for fp32/fp16 (buffers formed from the tensors ready when
the channel frees up); for TernGrad the groups and exchanges of ``perfmodel.plan_buffers`` (the
frontend's ``exchange.fusion`` cut with a TernGradConfig, each group's exchange as the engine picks it);
tensors the config keeps at full precision go through Horovod's fp32 allreduce as they become ready.

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
    """(latency part, bandwidth part) of a perfmodel collective time."""
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


def timeline_step(tensor_sizes: Sequence[int], compute_s: float, workers: int, network: pm.Network,
                  method: str = pm.FP32, *, codec: CodecRates | None = None, backward_fraction: float = 2 / 3,
                  packing: str | None = None, fusion_bytes: int = pm.HOROVOD_FUSION_BYTES,
                  fusion_numel: int | None = None, cycle_s: float = 0.0, config: pm.TernGradConfig | None = None,
                  names: Sequence[str] | None = None) -> Timeline:
    """Simulate one step (see the module docstring).  ``tensor_sizes`` (and ``names``) in layer (forward)
    order; ``packing``, ``fusion_numel``, ``config`` and ``names`` cut TernGrad's groups as
    ``perfmodel.exchange_plan`` does."""
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
            lat, bw = _split(pm.ring_allreduce_time, nbytes, N, link)
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

    if method not in (pm.TERNGRAD_ALLGATHER, pm.TERNGRAD_SHARDED, pm.TERNGRAD_BEST):
        raise ValueError(f"method must be one of {pm.METHODS}, got {method!r}")
    # the groups as the frontend cuts them (exchange.fusion), each with the engine's exchange; members in
    # backward order; every size from codec/sizes.py and exchange/cost.py
    cfg = pm.terngrad_config(config, packing)
    plan = pm.plan_buffers(method, sizes, N, network, cfg.packing, fusion_bytes, fusion_numel, config=cfg, names=names)
    groups = [b for b in plan if b.exchange in pm.TERNGRAD_EXCHANGES]
    plain = {i for b in plan if b.exchange not in pm.TERNGRAD_EXCHANGES for i in b.members}   # kept at fp32
    members = [list(b.members) for b in groups]
    group_of_last = {m[-1]: g for g, m in enumerate(members)}
    kinds = [b.exchange for b in groups]
    numel = [sum(b.sizes) for b in groups]
    encoded = [False] * len(groups)
    summed = [kind != pm.TERNGRAD_SHARDED for kind in kinds]
    handshake = [wire.handshake_size([wire.num_buckets(n, cfg.bucket_size) for n in b.sizes]) for b in groups]
    payload = [sum(wire.payload_size(n, cfg.packing, cfg.bucket_size) for n in b.sizes) for b in groups]
    # sharded: every member sharded on its own; (bytes to each peer, bytes of sums per owner), slowest rank
    shard = [pm.sharded_bytes(b.sizes, N, cfg.packing) if k == pm.TERNGRAD_SHARDED else (0, 0)
             for b, k in zip(groups, kinds)]

    def work(seconds: float) -> None:
        nonlocal main, codec_s
        main += seconds
        codec_s += seconds

    def encode_and_send(g: int) -> None:
        nonlocal main
        main = max(main, chan.finish_time(("hs", g)))
        work(c.encode * numel[g])
        encoded[g] = True
        if kinds[g] == pm.TERNGRAD_SHARDED:
            G = network.ranks_per_node if link is network else N
            lat, bw = _split(pm.alltoall_time, shard[g][0], N, link, G)
            chan.submit(main, "alltoall", ("a2a", g), lat, bw)
        else:
            lat, bw = _split(pm.ring_allgather_time, payload[g], N, link)
            chan.submit(main, "allgather", ("ag", g), lat, bw)

    def sum_and_send(g: int) -> None:             # sharded owner step: add the N chunks, allgather the sums
        nonlocal main
        main = max(main, chan.finish_time(("a2a", g)))
        work(c.owner_sum * numel[g])
        summed[g] = True
        lat, bw = _split(pm.ring_allgather_time, shard[g][1], N, link)
        chan.submit(main, "allgather", ("ag", g), lat, bw)

    def progress(block: bool) -> None:
        """The library's _progress: finished (all, if block) handshakes -> payloads, in start order; then
        finished (all) alltoalls -> owners' sums."""
        for g in range(len(groups)):
            if not encoded[g] and ("hs", g) in chan.done and (block or chan.finish_time(("hs", g)) <= main):
                encode_and_send(g)
        for g in range(len(groups)):
            if not summed[g] and ("a2a", g) in chan.done and (block or chan.finish_time(("a2a", g)) <= main):
                sum_and_send(g)

    for i in order:
        main += bwd * sizes[i] / total
        if i in plain:                   # kept at full precision: Horovod's fp32 allreduce (fuses with fp32 only)
            lat, bw = _split(pm.ring_allreduce_time, 4 * sizes[i], N, link)
            chan.submit(main, "allreduce_fp32", ("ar", i), lat, bw)
        g = group_of_last.get(i)
        if g is not None:                # the group is complete: statistics, handshake, then progress
            work(c.prepare * numel[g])
            lat, bw = _split(pm.ring_allreduce_time, handshake[g], N, link)
            chan.submit(main, "allreduce", ("hs", g), lat, bw)
            progress(block=False)
    backward_end = main
    progress(block=True)                 # synchronize: every outstanding handshake, then every alltoall
    for i in plain:
        main = max(main, chan.finish_time(("ar", i)))
    for g in range(len(groups)):
        main = max(main, chan.finish_time(("ag", g)))
        if kinds[g] == pm.TERNGRAD_SHARDED:
            work(c.decode_sums * numel[g])
        else:
            work((c.decode_base + c.decode_per_payload * N) * numel[g])
    busy = sum(op[2] + op[3] for op in chan.ops)
    return Timeline(method, N, main, compute_s, backward_end, busy, codec_s, chan.rounds())


__all__ = ["CodecRates", "Timeline", "measure_codec_rates", "timeline_step"]
