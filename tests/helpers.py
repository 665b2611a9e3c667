"""Independent recomputation of what the exchange must produce, from each rank's inputs.

It re-derives every rank's ternary vector with the reference codec and applies the decode formula of
the wire format (codec/packing.py) written out again here, so an error in either backend's decode
shows up as a mismatch.
"""
import contextlib

import torch

from horovod_terngrad import codec as C
from horovod_terngrad.config import TernGradConfig
from horovod_terngrad.exchange.topology import Topology, piece_name, shard_bounds, shard_plan


def expected_average(grads, name, step, cfg: TernGradConfig, average=True, ranks=None, world=None):
    """The average every rank must get, and each rank's ternary vector.  ``ranks``: the rank of each of
    ``grads`` (default 0..N-1); ``world``: ranks averaged over (default N; more when some joined: they count
    as zeros)."""
    N = len(grads)
    ranks = list(range(N)) if ranks is None else list(ranks)
    flat = [g.detach().reshape(-1).to(torch.float32) for g in grads]
    stats = [C.tensor_stats(g, cfg.bucket_size) for g in flat]
    thrs = [C.clip_threshold(st, cfg.clip_factor) for st in stats]
    local = [C.local_scalers(st, thr) for st, thr in zip(stats, thrs)]
    scalers = [torch.stack(local).amax(dim=0)] * N if cfg.shares_scaler else local
    tid = C.tensor_id(name)
    n = flat[0].numel()
    ternary = [C.ternarize(flat[r], thrs[r], scalers[r], cfg.bucket_size, C.stream_key(cfg.seed, step, tid, ranks[r]))
               for r in range(N)]

    def full(s):
        return s if s.numel() == 1 else s.repeat_interleave(cfg.bucket_size)[:n]

    divisor = float((world or N) if average else 1)
    if all(torch.equal(s, scalers[0]) for s in scalers):
        k = torch.stack([t.to(torch.int64) for t in ternary]).sum(0) if n else torch.zeros(0)
        out = (k.to(torch.float32) * full(scalers[0])) / divisor   # one rounding, then the division
    else:
        acc = torch.zeros(n, dtype=torch.float32)
        for r in range(N):                                        # fp32, in rank order
            acc = acc + ternary[r].to(torch.float32) * full(scalers[r])
        out = acc / divisor
    return out.view(grads[0].shape).to(grads[0].dtype), ternary


def run_hier(topo: Topology, fn, timeout=120.0, world_groups=False):
    """``fn(global_collectives, local, cross)`` on every rank of ``topo`` (threads, ``run_ranks``); (results,
    errors) by global rank, an exception a rank raised kept in its place instead of raised.  ``world_groups``:
    local and cross are carried by the world's collectives (exchange/world_groups.py) instead of subgroups of
    their own."""
    from horovod_terngrad.exchange.thread_collectives import hierarchical_collectives, run_ranks
    from horovod_terngrad.exchange.world_groups import WorldGroupCollectives
    sub = None if world_groups else hierarchical_collectives(topo)

    def body(c):
        try:
            groups = sub[c.rank] if sub else (WorldGroupCollectives(c, topo.local_ranks_of(c.rank)),
                                              WorldGroupCollectives(c, topo.cross_ranks_of(c.rank)))
            return fn(c, *groups), None
        except BaseException as e:  # noqa: BLE001 - returned in the rank's place
            return None, e

    results, errors = zip(*run_ranks(topo.size, body, timeout=timeout))
    return list(results), list(errors)


def expected_hierarchical(per_rank: list, names: list, topo: Topology, cfg: TernGradConfig, steps: dict, average=True,
                          noise=False):
    """The hierarchical average written out again: node sums in local-rank order (/ G), each local rank's
    pieces ternarized across nodes as the flat exchange does (helpers.expected_average, streams of the
    global rank), the shards put back together.  ``steps``: the step of each piece name (updated).  With
    ``noise`` (the re-ternarized and requantized cross exchanges), also the cross stage's noise estimate of each
    member, put together from its pieces as the average is: (averages, noises)."""
    G = topo.ranks_per_node
    if cfg.exchange == "default":     # what exchange="default" runs among the M nodes
        from horovod_terngrad.exchange.policy import setting_among
        cfg = cfg.replace(exchange=setting_among(cfg.exchange, topo.size // G))
    numels = [t.numel() for t in per_rank[0]]
    plan = shard_plan(numels, G)
    # intra_node_dtype="bfloat16": every rank's contribution, and the averaged shards, go through bf16's rounding
    wire = (lambda t: t.bfloat16().float()) if cfg.intra_node_dtype == "bfloat16" else (lambda t: t)
    flat = {r: wire(torch.cat([t.reshape(-1).float() for t in per_rank[r]])) for r in range(topo.size)}
    bounds = shard_bounds(sum(numels), G)
    outs = [torch.empty(n) for n in numels]
    noises = [torch.empty(n) for n in numels]
    starts = [sum(numels[:i]) for i in range(len(numels))]
    for j, pieces in enumerate(plan):
        lo, hi = bounds[j]
        node_vals = []
        cross = topo.cross_groups()[j]          # the cross group's rank order: ascending global rank
        for node in sorted(topo.nodes, key=lambda nd: cross.index(nd[j])):
            acc = flat[node[0]][lo:hi].clone()
            for r in node[1:]:
                acc = acc + flat[r][lo:hi]
            node_vals.append(acc / G if average else acc)
        for p in pieces:
            a = starts[p.member] + p.start - lo
            pname = piece_name(names[p.member], p, numels[p.member])
            step = steps.get(pname, 0)
            steps[pname] = step + 1
            segs = [v[a:a + p.numel] for v in node_vals]
            if cfg.exchange in ("reternarized", "requantized"):
                want, nu = expected_reternarized(segs, pname, step, cfg, average=average, ranks=list(cross), noise=True,
                                                 second="requant" if cfg.exchange == "requantized" else "ternary",
                                                 squares=noise and cfg.exchange == "requantized")
                noises[p.member][p.start:p.stop] = wire(nu)
            else:
                if noise:
                    raise NotImplementedError("the reference noise of the hierarchical exchange: re-ternarized and "
                                              "requantized cross exchanges only")
                want, _ = expected_average(segs, pname, step, cfg, average=average, ranks=list(cross))
            outs[p.member][p.start:p.stop] = wire(want)
    outs = [o.view(t.shape) for o, t in zip(outs, per_rank[0])]
    return (outs, noises) if noise else outs


def mlp(width=32, depth=4, seed=0):
    """The small model of the real-rank tests (Horovod workers and their DDP twins train the same one)."""
    import torch.nn as nn
    torch.manual_seed(seed)
    layers = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers += [nn.Linear(width, 4)]
    return nn.Sequential(*layers)


@contextlib.contextmanager
def link_codec_cost(codec_s_per_element: float):
    """exchange="auto" measures the link for real, then sees the codec cost this much per element (the
    decision on loopback depends on the machine): 0 = ternarizing pays, 1e-3 = it does not."""
    import dataclasses

    from horovod_terngrad.exchange import link
    measured = link.measure

    def forced(coll, device, packing, name="terngrad.link"):
        got = measured(coll, device, packing, name)
        return None if got is None else dataclasses.replace(got, codec_s_per_element=codec_s_per_element)

    link.measure = forced
    try:
        yield
    finally:
        link.measure = measured


def expected_exchange(grads, name, step, cfg: TernGradConfig, ranks=None):
    """The average every rank must get from the exchange ``cfg`` names among len(grads) ranks ("default": the one
    exchange/policy.default_transport picks for that many): the allgather reference, or the re-ternarized or
    requantized one."""
    from horovod_terngrad.exchange.policy import setting_among
    exchange = setting_among(cfg.exchange, len(grads))
    cfg = cfg.replace(exchange=exchange)
    if exchange in ("reternarized", "requantized"):
        return expected_reternarized(grads, name, step, cfg, ranks=ranks,
                                     second="requant" if exchange == "requantized" else "ternary")
    return expected_average(grads, name, step, cfg, ranks=ranks)[0]


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """codec/squares.py's summation order written out in numpy float32 (each addition one IEEE operation): level by
    level, 8 equal contiguous parts of the zero-padded values as ((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)); 0-d fp32."""
    import numpy as np
    y = x.detach().reshape(-1).to(torch.float32).numpy()
    while y.size > 1:
        p = np.concatenate([y, np.zeros((-y.size) % 8, np.float32)]).reshape(8, -1)
        y = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    return torch.tensor(y.reshape(()), dtype=torch.float32)


def minibatch_share_out(nu: torch.Tensor, clipped: list, divisor: float) -> torch.Tensor:
    """``nu`` with the minibatch's share taken out (codec/squares.py) as written out here: each sender's Σ f(g)²
    of its slice ``clipped[r]`` (fp32 squares, ``ordered_sum``), sent as fp32; Q = their sum / divisor²; the factor
    max(0, 1 - Q / Σ nu) in fp64, applied in fp32."""
    sent = torch.stack([ordered_sum(c.to(torch.float32) * c.to(torch.float32)) for c in clipped])
    q = float(ordered_sum(sent)) / divisor ** 2
    total = float(ordered_sum(nu))
    factor = min(max(1.0 - q / total, 0.0), 1.0) if total > 0 else 1.0
    return nu * torch.tensor(factor, dtype=torch.float64).to(torch.float32)


def expected_reternarized(grads, name, step, cfg: TernGradConfig, average=True, noise=False, ranks=None,
                          second="ternary", squares=False):
    """What the re-ternarized exchange (exchange/reternarized.py) must give every rank, written out from the
    reference codec: each rank's ternary vector with one scaler per shard (or the user's buckets); per shard, the
    average of the N ranks' values (the allgather exchange's decode formula on the shard); that average
    ternarized again with scaler max|a| per bucket, no clip, the stream of '<name>#owner' and the owner's rank;
    decoded as s'·t'.  With ``noise``, also the owners' noise estimate s'^2·|t'|.  ``ranks``: the stream rank
    of each of ``grads`` (default 0..N-1; the FSDP frontend keys streams by global rank), the owner of shard o
    drawing with ranks[o].

    ``second="requant"``: the requantized exchange (exchange/requantized.py) instead, which shares the first
    stage: the owner's average a in 4-bit groups (codec.requant.quantize, the streams of '<name>#rq4'), and its
    noise channel: the first stage's (1/N^2)·Σ_r s_r^2·|t_r| (in the decode's order: integer sums times the
    shared scaler squared, else rank by rank) plus the rounding's variance, one stochastic bit per element.
    ``squares``: the first stage's estimate with the minibatch's share taken out by the senders' squares
    (codec/squares.py, ``minibatch_share_out``)."""
    from horovod_terngrad.codec import requant, sizes
    N = len(grads)
    ranks = list(range(N)) if ranks is None else list(ranks)
    flat = [g.detach().reshape(-1).to(torch.float32) for g in grads]
    n = flat[0].numel()
    k = cfg.bucket_size
    b1 = sizes.reternarized_encode_bucket(n, N, k)
    stats = [C.tensor_stats(g, b1) for g in flat]
    thrs = [C.clip_threshold(st, cfg.clip_factor) for st in stats]
    local = [C.local_scalers(st, thr) for st, thr in zip(stats, thrs)]
    scalers = [torch.stack(local).amax(dim=0)] * N if cfg.scaler_shared_for("reternarized") else local
    tid = C.tensor_id(name)
    four = cfg.first_stage_format("requantized" if second == "requant" else "reternarized") == sizes.FOUR_LEVEL
    if four:     # codec/levels.py: four levels, dithers stratified over the N ranks (rank r is the r-th of ``grads``)
        codes = [C.levels.round_codes(flat[r], thrs[r], scalers[r], b1, C.levels.stratified_uniform24(
            C.stream_key(cfg.seed, step, tid, ranks[r]), C.levels.strata_key(cfg.seed, step, tid), r, N, 0, n))
            for r in range(N)]
        values = [torch.tensor(C.levels.VALUES)[c.long()] for c in codes]
        squared = [torch.tensor(C.levels.SQUARES)[c.long()] for c in codes]
    else:
        ternary = [C.ternarize(flat[r], thrs[r], scalers[r], b1, C.stream_key(cfg.seed, step, tid, ranks[r]))
                   for r in range(N)]
        values = [t.to(torch.float32) for t in ternary]
        squared = [t.abs().to(torch.float32) for t in ternary]

    def full(s, bucket, count):
        return s if s.numel() == 1 else s.repeat_interleave(bucket)[:count]

    out = torch.zeros(n, dtype=torch.float32)
    nu = torch.zeros(n, dtype=torch.float32)
    divisor = float(N if average else 1)
    for o, (lo, hi) in enumerate(sizes.reternarized_bounds(n, N, k)):
        if hi <= lo:
            continue
        sc = [full(s, b1, n)[lo:hi] for s in scalers]
        same = not four and all(torch.equal(s, sc[0]) for s in sc)     # the four-level code has no shortcut
        if same:
            kk = torch.stack([t[lo:hi].to(torch.int64) for t in ternary]).sum(0)
            a = (kk.to(torch.float32) * sc[0]) / divisor
        else:
            acc = torch.zeros(hi - lo, dtype=torch.float32)
            for r in range(N):
                acc = acc + values[r][lo:hi] * sc[r]
            a = acc / divisor
        if second == "requant":
            if same:
                ka = torch.stack([t[lo:hi].abs().to(torch.int64) for t in ternary]).sum(0)
                nu1 = (ka.to(torch.float32) * (sc[0] * sc[0])) / (divisor * divisor)
            else:
                acc = torch.zeros(hi - lo, dtype=torch.float32)
                for r in range(N):
                    acc = acc + squared[r][lo:hi] * (sc[r] * sc[r])
                nu1 = acc / (divisor * divisor)
            if squares:
                nu1 = minibatch_share_out(nu1, [torch.minimum(torch.maximum(flat[r][lo:hi], -thrs[r]), thrs[r])
                                                for r in range(N)], divisor)
            k_avg, k_noise = requant.keys(cfg.seed, step, name, ranks[o])
            steps, codes, var = requant.quantize(a, k_avg, lo)
            per = steps.repeat_interleave(requant.GROUP)[:hi - lo]
            out[lo:hi] = codes.to(torch.float32) * per
            top, bits = requant.quantize_noise(nu1 + var, k_noise, lo)
            nu[lo:hi] = bits.to(torch.float32) * top.repeat_interleave(requant.GROUP)[:hi - lo]
            continue
        st = C.tensor_stats(a, k)
        thr = C.clip_threshold(st, 0.0)
        s2 = C.local_scalers(st, thr)
        t2 = C.ternarize(a, thr, s2, k, C.stream_key(cfg.seed, step, C.tensor_id(name + "#owner"), ranks[o]))
        out[lo:hi] = (t2.to(torch.float32) * full(s2, k, hi - lo)) / 1.0
        nu[lo:hi] = (t2.abs().to(torch.float32) * full(s2 * s2, k, hi - lo)) / 1.0
    result = out.view(grads[0].shape).to(grads[0].dtype)
    return (result, nu) if noise else result
