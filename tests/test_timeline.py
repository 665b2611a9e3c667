"""Scheduled step model (horovod_terngrad/modelling/timeline.py): hand-checked schedules on a flat network."""
import pytest

from horovod_terngrad import TernGradConfig
from horovod_terngrad.codec import sizes
from horovod_terngrad.exchange import cost
from horovod_terngrad.modelling import hsdp, perfmodel as pm
from horovod_terngrad.modelling.codec_rates import CodecRates, measure_codec_rates
from horovod_terngrad.modelling.timeline import method_of, timeline_step

FLAT = pm.Network("flat", latency_s=1e-3, bandwidth_Bps=1e6)      # alpha 1 ms, 1 MB/s
# allreduces are charged as exchange/cost.py picks them: the ring or, where faster, the tree
# (2·ceil(log2 N)·alpha + 2·B·beta: the 4-byte presence check and the handshakes at N >= 4 here)


def test_fp32_one_tensor_waits_for_backward_then_one_allreduce():
    # one tensor: its gradient is ready when backward ends, so nothing overlaps
    n, N, compute = 1000, 4, 0.5
    t = timeline_step([n], compute, N, FLAT, "fp32")
    assert t.step_s == pytest.approx(compute + pm.allreduce_time(4 * n, N, FLAT))
    assert t.rounds == 1


def test_fp32_last_layer_overlaps_backward_of_the_others():
    # two equal tensors, no fusion: the last layer's allreduce (issued halfway through backward) hides
    # under the other half of backward when the link is fast enough
    n, N, compute = 1000, 2, 3.0       # backward = 2 s, 1 s per tensor; one allreduce = 2 ms + 4 ms
    one = pm.allreduce_time(4 * n, N, FLAT)
    t = timeline_step([n, n], compute, N, FLAT, "fp32", fusion_bytes=0)
    assert t.step_s == pytest.approx(compute + one)          # only the first layer's allreduce is exposed
    additive = pm.predict_step([n, n], compute, N, FLAT, "fp32", fusion_bytes=0).step_s
    assert additive == pytest.approx(compute + 2 * one)
    assert t.rounds == 2


def test_fp32_tensors_ready_while_the_channel_is_busy_fuse_into_one_round():
    # a slow link: the first allreduce is still running when the other tensors become ready, so they
    # go together in the next round (one latency term for three tensors)
    sizes, N, compute = [1000, 1000, 1000, 1_000_000], 2, 0.003
    t = timeline_step(sizes, compute, N, FLAT, "fp32")
    assert t.rounds == 2
    assert t.channel_busy_s == pytest.approx(pm.allreduce_time(4_000_000, N, FLAT)
                                             + pm.allreduce_time(12_000, N, FLAT))


RATES = CodecRates(prepare=1e-8, encode=2e-8, decode_base=1e-8, decode_per_payload=1e-9, owner_sum=1e-9,
                   decode_sums=1e-8, cast=1e-9)


def test_per_rank_scalers_send_one_presence_check_and_encode_in_the_hook():
    # the default (per-rank scalers): no handshake; the step's first group sends the 4-byte presence check
    # and its hook waits for it, then encodes and sends the payload; one tensor: nothing to overlap with
    n, N, compute = 100_000, 4, 0.01
    t = timeline_step([n], compute, N, FLAT, "terngrad_allgather", codec=RATES, fusion_numel=0)
    presence = pm.allreduce_time(4, N, FLAT)
    assert presence == pytest.approx(2 * 2 * 1e-3 + 2 * 4e-6)         # the tree (ring: 6 ms + 6 us)
    ag = pm.ring_allgather_time(pm.payload_bytes(n), N, FLAT)
    codec = (1e-8 + 2e-8 + 1e-8 + 4e-9) * n
    assert t.codec_s == pytest.approx(codec)
    assert t.step_s == pytest.approx(compute + codec + presence + ag)
    # prepare, the presence wait and the encode all happen inside the backward hook
    assert t.backward_end_s == pytest.approx(compute + (1e-8 + 2e-8) * n + presence)
    assert t.rounds == t.collectives == 2
    assert t.issued == ("terngrad.presence.0", "terngrad.ag.0")
    free = timeline_step([n], compute, N, FLAT, "terngrad_allgather", fusion_numel=0)
    assert free.step_s == pytest.approx(t.step_s - codec)
    # torch.distributed has no hvd.join(): no presence check at all
    ddp = timeline_step([n], compute, N, FLAT, "terngrad_allgather", codec=RATES, fusion_numel=0, joins=False)
    assert ddp.issued == ("terngrad.ag.0",) and ddp.step_s == pytest.approx(compute + codec + ag)


def test_shared_scaler_sends_a_handshake_per_group_and_encodes_after_backward():
    n, N, compute = 100_000, 4, 0.01
    cfg = TernGradConfig(shared_scaler=True)
    t = timeline_step([n], compute, N, FLAT, "terngrad_allgather", codec=RATES, fusion_numel=0, config=cfg)
    hs = pm.allreduce_time(pm.handshake_bytes(1), N, FLAT)
    assert hs == pytest.approx(4e-3 + 2 * 72e-6)                      # 72 bytes by tree
    ag = pm.ring_allgather_time(pm.payload_bytes(n), N, FLAT)
    codec = (1e-8 + 2e-8 + 1e-8 + 4e-9) * n
    assert t.step_s == pytest.approx(compute + codec + hs + ag)
    assert t.backward_end_s == pytest.approx(compute + 1e-8 * n)   # only the statistics in the hook
    assert t.issued == ("terngrad.hs.0", "terngrad.ag.0")
    # the per-rank schedule is shorter by the handshake less the presence check
    per_rank = timeline_step([n], compute, N, FLAT, "terngrad_allgather", codec=RATES, fusion_numel=0)
    assert t.step_s - per_rank.step_s == pytest.approx(hs - pm.allreduce_time(4, N, FLAT))


GROUPS5 = [100_000] * 5        # with fusion_numel=0: five groups, group g = tensor 4 - g (backward order)


@pytest.mark.parametrize("method,cfg,issued", [
    ("terngrad_allgather", TernGradConfig(),
     ["presence.0", "ag.0", "ag.1", "ag.2", "ag.3", "ag.4"]),
    ("terngrad_allgather", TernGradConfig(shared_scaler=True),
     ["hs.0", "hs.1", "hs.2", "ag.0", "hs.3", "ag.1", "hs.4", "ag.2", "ag.3", "ag.4"]),
    ("terngrad_sharded", TernGradConfig(exchange="sharded"),
     ["hs.0", "hs.1", "hs.2", "a2a.0", "sg.0", "hs.3", "a2a.1", "sg.1", "hs.4", "a2a.2", "sg.2",
      "a2a.3", "a2a.4", "sg.3", "sg.4"]),
], ids=["per-rank", "shared", "sharded"])
def test_collectives_per_step_and_their_order(method, cfg, issued):
    # per-rank: one payload allgather per group + 1 presence check; shared scaler: a handshake and a payload
    # collective per group, each group advanced (waiting) when the group after next starts, the rest in
    # synchronize; sharded: handshake, alltoall and the owners' sums' allgather per group
    t = timeline_step(GROUPS5, 0.05, 3, FLAT, method, codec=RATES, fusion_numel=0, config=cfg)
    per_group = {"terngrad_allgather": 1 if not cfg.shares_scaler else 2, "terngrad_sharded": 3}[method]
    assert t.collectives == len(GROUPS5) * per_group + (0 if cfg.shares_scaler else 1)
    assert list(t.issued) == ["terngrad." + x for x in issued]


@pytest.mark.parametrize("cfg", [TernGradConfig(min_numel=100, fusion_numel=0),
                                 TernGradConfig(min_numel=100, fusion_numel=1500),
                                 TernGradConfig(min_numel=100, fusion_numel=0, shared_scaler=True),
                                 TernGradConfig(min_numel=100, fusion_numel=1500, shared_scaler=True),
                                 TernGradConfig(min_numel=100, fusion_numel=0, exchange="sharded"),
                                 TernGradConfig(min_numel=100, fusion_numel=1500, exchange="sharded"),
                                 TernGradConfig(min_numel=100, fusion_numel=0, exchange="reternarized"),
                                 TernGradConfig(min_numel=100, fusion_numel=1500, exchange="reternarized"),
                                 TernGradConfig(min_numel=100, fusion_numel=0, exchange="requantized"),
                                 TernGradConfig(min_numel=100, fusion_numel=1500, exchange="requantized"),
                                 (TernGradConfig(min_numel=100, fusion_numel=1500), 5),
                                 (TernGradConfig(min_numel=100, fusion_numel=1500, exchange="auto"), 5)],
                         ids=["per-rank", "per-rank-fused", "shared", "shared-fused", "sharded", "sharded-fused",
                              "reternarized", "reternarized-fused", "requantized", "requantized-fused",
                              "default-5-ranks", "auto-5-ranks"])
def test_the_schedule_issues_what_the_engine_issues(cfg):
    # the real engine on three thread-ranks (five: where "default" runs the re-ternarized exchange), started group
    # by group as the frontend does (the plan's groups, members in backward order; the two tensors under min_numel
    # in no group), then finished in hook order: the timeline names the same collectives in the same order
    import torch
    from test_exchange import KindCounting

    from horovod_terngrad.exchange import Engine, run_ranks
    cfg, N = cfg if isinstance(cfg, tuple) else (cfg, 3)
    sizes = [300, 700, 40, 900, 500, 1000, 60]
    method = method_of(cfg)
    t = timeline_step(sizes, 0.05, N, FLAT, method, config=cfg)
    groups = [b.members for b in pm.plan_buffers(method, sizes, N, FLAT, config=cfg) if b.method != "fp32"]
    assert sorted(i for g in groups for i in g) == [0, 1, 3, 4, 5]

    def body(c):
        rec = KindCounting(c)
        ex = Engine(rec, cfg)
        tickets = []
        for g, members in enumerate(groups):
            tickets += ex.start_group([(torch.randn(sizes[i]), f"t{i}") for i in members], str(g))
        for tk in tickets:
            ex.finish(tk)
        return rec.issued, ex.stats.collectives

    (issued, count), *_ = run_ranks(N, body)
    assert issued == list(t.issued)
    kinds = [b.method for b in pm.plan_buffers(method, sizes, N, FLAT, config=cfg) if b.method != "fp32"]
    if cfg.exchange == "default":       # TernGradConfig()'s: the allgather up to 4 ranks, requantized above
        assert set(kinds) == {"terngrad_allgather" if N <= 4 else "terngrad_requantized"}
    per_group = {"terngrad_allgather": 1 if not cfg.shares_scaler else 2, "terngrad_sharded": 3,
                 "terngrad_reternarized": 2, "terngrad_requantized": 2}
    # re-ternarized, requantized: alltoall + allgather, per-rank scalers
    assert t.collectives == count == sum(per_group[k] for k in kinds) + (0 if cfg.shares_scaler else 1)


def test_tensors_under_min_numel_travel_by_horovods_allreduce():
    # the default min_numel=4096: the two small tensors go by Horovod's fp32 allreduce (one round each: the
    # presence check and the payload allgather come between them), the large one is a group of its own
    sizes, N = [100, 100_000, 100], 2
    t = timeline_step(sizes, 0.01, N, FLAT, "terngrad_allgather")
    assert t.issued == ("terngrad.presence.0", "terngrad.ag.0")
    assert t.rounds == 4
    assert t.channel_busy_s == pytest.approx(2 * pm.allreduce_time(4 * 100, N, FLAT)
                                             + pm.allreduce_time(4, N, FLAT)
                                             + pm.ring_allgather_time(pm.payload_bytes(100_000), N, FLAT))
    every = timeline_step(sizes, 0.01, N, FLAT, "terngrad_allgather", config=TernGradConfig(min_numel=0))
    assert every.issued == ("terngrad.presence.0", "terngrad.ag.0") and every.rounds == 2   # one fused group


def test_collectives_submitted_together_share_one_round():
    # many small tensors, no TernGrad fusion, per-rank scalers: every payload allgather is issued during
    # backward; those issued while one runs fuse, so there are far fewer rounds than collectives, and the
    # step is shorter than the additive model's
    sizes = [100] * 50
    every = TernGradConfig(min_numel=0)
    t = timeline_step(sizes, 0.001, 8, FLAT, "terngrad_allgather", fusion_numel=0, config=every)
    assert t.collectives == 51
    assert t.rounds < t.collectives / 4
    additive = pm.predict_step(sizes, 0.001, 8, FLAT, "terngrad_allgather", fusion_numel=0, config=every)
    assert t.step_s < additive.step_s
    # the shared scaler: each hook waits for the handshake of the group before the previous one (the
    # engine's ordered start), so on this slow network backward is stretched to about one round per group
    shared = timeline_step(sizes, 0.001, 8, FLAT, "terngrad_allgather", fusion_numel=0,
                           config=every.replace(shared_scaler=True))
    assert shared.collectives == 100
    hs = pm.allreduce_time(pm.handshake_bytes(1), 8, FLAT)
    assert shared.backward_end_s > 40 * hs > 10 * t.backward_end_s


def test_sharded_schedule_has_alltoall_then_sums_allgather():
    n, N = 1_000_000, 8
    t = timeline_step([n], 0.01, N, FLAT, "terngrad_sharded", fusion_numel=0)
    m = pm.shard_numel(n, N)
    a2a = pm.alltoall_time(pm.packed_bytes(m), N, FLAT)
    sums = pm.ring_allgather_time(-(-m * pm.sum_bits(N) // 8), N, FLAT)
    hs = pm.allreduce_time(pm.handshake_bytes(1), N, FLAT)
    assert hs == pytest.approx(2 * 3 * 1e-3 + 2 * 72e-6)              # by tree (ring: 14 ms + 126 us)
    assert t.step_s == pytest.approx(0.01 + hs + a2a + sums)
    ring = timeline_step([n], 0.01, N, FLAT.with_allreduce("ring"), "terngrad_sharded", fusion_numel=0)
    assert ring.step_s - t.step_s == pytest.approx((14e-3 + 2 * 7 / 8 * 72e-6) - hs)
    assert t.rounds == 3


def test_reternarized_schedule_has_the_shard_alltoall_then_the_owners_allgather():
    """exchange="reternarized": a presence check, the alltoall of shard payloads, the owners' payloads'
    allgather, both of c = exchange.cost.reternarized_bytes per peer; codec time off: compute + those three."""
    n, N = 1_000_000, 8
    t = timeline_step([n], 0.01, N, FLAT, "terngrad_reternarized", fusion_numel=0)
    c = cost.reternarized_bytes([n], N, "2bit")
    assert c == sizes.payload_size(sizes.reternarized_shard(n, N), "2bit")
    presence = pm.allreduce_time(4, N, FLAT)
    a2a = pm.alltoall_time(c, N, FLAT)
    ag = pm.ring_allgather_time(c, N, FLAT)
    assert t.step_s == pytest.approx(0.01 + presence + a2a + ag)
    assert list(t.issued) == ["terngrad.presence.0", "terngrad.rt.0", "terngrad.rg.0"]
    sharded = timeline_step([n], 0.01, N, FLAT, "terngrad_sharded", fusion_numel=0)
    assert t.step_s < sharded.step_s           # fewer bytes, no handshake


def test_one_worker_is_compute_only_and_bad_arguments_are_refused():
    assert timeline_step([10, 20], 0.2, 1, FLAT, "terngrad").step_s == 0.2
    with pytest.raises(ValueError):
        timeline_step([10], 0.2, 2, FLAT, "int8")
    with pytest.raises(ValueError):
        timeline_step([10], 0.2, 2, FLAT, "fp32", backward_fraction=1.5)


def test_measured_codec_rates_are_positive_and_decode_grows_with_payloads():
    r = measure_codec_rates(numel=400_000, repeat=1)
    for name in ("prepare", "encode", "owner_sum", "decode_sums", "cast"):
        assert 0 < getattr(r, name) < 1e-4, name          # seconds per element, not per 1000 (a loose bound: timed on a busy machine)
    # the decode's two terms are a two-point fit, each clamped at 0: on a busy machine either may come out 0
    assert 0 <= r.decode_base < 1e-4 and 0 <= r.decode_per_payload < 1e-4
    assert r.decode_base + r.decode_per_payload > 0
    assert r.slowed(2.0).encode == pytest.approx(2 * r.encode)
    m = measure_codec_rates(numel=400_000, repeat=3, statistic="median")     # what a calibration uses
    assert all(0 < getattr(m, f) < 1e-4 for f in ("prepare", "encode", "owner_sum"))
    with pytest.raises(ValueError, match="statistic"):
        measure_codec_rates(numel=1000, statistic="mean")


def test_channel_fuses_allgathers_and_allreduces_but_never_alltoalls():
    from horovod_terngrad.modelling.timeline import _Channel
    ch = _Channel(cycle_s=0.005)
    ch.submit(0.0, "allgather", "a", 0.001, 0.010)
    ch.submit(0.002, "allgather", "b", 0.001, 0.020)     # before "a" starts (at 5 ms): same round
    assert ch.rounds() == 1 and ch.finish_time("a") == ch.finish_time("b") == pytest.approx(0.005 + 0.001 + 0.030)
    ch.submit(0.003, "alltoall", "c", 0.001, 0.010)
    ch.submit(0.003, "alltoall", "d", 0.001, 0.010)      # Horovod runs every alltoall on its own
    assert ch.rounds() == 3
    assert ch.finish_time("d") == pytest.approx(ch.finish_time("c") + 0.011)
    ch.submit(1.0, "allgather", "e", 0.001, 0.010)       # after the channel went idle: a new round
    assert ch.rounds() == 4 and ch.finish_time("e") == pytest.approx(1.0 + 0.005 + 0.011)


def test_sharded_groups_advance_in_the_hook_of_the_group_after_next_and_the_rest_in_synchronize():
    # three large layers, each a group: the engine's ordered start advances a group (waiting for its
    # handshake and then its alltoall) only when the group after next starts, so the last layer's group is
    # encoded and owner-summed in the first layer's hook; the other two wait for synchronize
    fast = pm.Network("fast", latency_s=1e-5, bandwidth_Bps=1e10)
    rates = CodecRates(prepare=1e-9, encode=1e-9, decode_base=1e-9, decode_per_payload=0, owner_sum=1e-8,
                       decode_sums=1e-9, cast=0)
    n = 1_000_000
    t = timeline_step([n, n, n], 3.0, 4, fast, "terngrad_sharded", codec=rates, fusion_numel=0)
    owner = 1e-8 * n                                     # 10 ms per layer
    # hooks: 3 x 1 ms statistics + 1 encode + 1 owner step; after backward: 2 encodes, 2 owner steps and
    # 3 decodes (1 ms each), plus microseconds of network
    assert t.backward_end_s == pytest.approx(3.0 + 3e-3 + 1e-3 + owner, abs=2e-4)
    assert t.step_s == pytest.approx(t.backward_end_s + 2e-3 + 2 * owner + 3e-3, abs=5e-4)
    assert t.issued[:5] == ("terngrad.hs.0", "terngrad.hs.1", "terngrad.hs.2", "terngrad.a2a.0", "terngrad.sg.0")


def test_fused_sharded_group_charges_per_member_shards_and_excluded_tensors_go_fp32():
    # one fused group of awkward sizes: the alltoall and the sums are exchange.cost.sharded_bytes' (every
    # member sharded on its own, as the engine does), the handshake codec.sizes.handshake_size's
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.codec import sizes
    from horovod_terngrad.exchange import cost
    numels, N = [21, 59, 1001], 3
    t = timeline_step(numels, 0.01, N, FLAT, "terngrad_sharded", config=TernGradConfig(min_numel=0))
    c, p_sum = cost.sharded_bytes(numels, N, "2bit")
    assert t.rounds == 3
    assert t.channel_busy_s == pytest.approx(pm.allreduce_time(sizes.handshake_size([1, 1, 1]), N, FLAT)
                                             + pm.alltoall_time(c, N, FLAT) + pm.ring_allgather_time(p_sum, N, FLAT))
    # a config's exclude: that tensor goes through Horovod's fp32 allreduce, the rest as a group of two
    cfg = TernGradConfig(exclude=("fc3",), min_numel=0, shared_scaler=True)
    t = timeline_step([1000, 10, 1000], 0.01, 4, FLAT, "terngrad_allgather", config=cfg,
                      names=["a.weight", "a.bias", "fc3.weight"])
    fp32 = pm.allreduce_time(4 * 1000, 4, FLAT)
    assert fp32 == pytest.approx(12e-3)              # ring 6 ms + 6 ms = tree 4 ms + 8 ms: the ring
    hs = pm.allreduce_time(sizes.handshake_size([1, 1]), 4, FLAT)
    assert hs == pytest.approx(4e-3 + 160e-6)        # 80 bytes by tree
    ag = pm.ring_allgather_time(sizes.payload_size(10, "2bit") + sizes.payload_size(1000, "2bit"), 4, FLAT)
    assert t.rounds == 3
    assert t.channel_busy_s == pytest.approx(fp32 + hs + ag)
    per_rank = timeline_step([1000, 10, 1000], 0.01, 4, FLAT, "terngrad_allgather", config=cfg.replace(shared_scaler=None),
                             names=["a.weight", "a.bias", "fc3.weight"])
    assert per_rank.channel_busy_s == pytest.approx(fp32 + pm.allreduce_time(4, 4, FLAT) + ag)


# -- node-aware groups (exchange/hierarchical.py) --------------------------------------------------------
def nodes(gbps=1.0, ranks_per_node=2, intra_gbps=100.0):
    """Nodes of ``ranks_per_node`` ranks on a ``gbps`` link (alpha 50 us), ``intra_gbps`` inside (alpha 5 us)."""
    return pm.Network.from_gbps("nodes", gbps, 50.0, ranks_per_node,
                                pm.Network.from_gbps("intra", intra_gbps, 5.0))


ENGINE_SIZES = [300, 700, 40, 900, 500, 1000, 60]


def engine_issued(topo, cfg, groups, sizes, joins):
    """Run one step of the real hierarchical engine on thread ranks of ``topo`` (groups of tensor indices,
    started in order, then finished): per global rank, the names it issued on the world, local and cross
    collectives (one list, in issue order) and its ``stats.collectives``."""
    import torch
    from test_exchange import KindCounting
    from test_hierarchical import run_hier

    from horovod_terngrad.exchange import Engine
    from horovod_terngrad.exchange.hierarchical import HierarchicalEngine

    def body(c, local, cross):
        issued = []
        recs = [KindCounting(x) for x in (c, local, cross)]
        for rec in recs:
            rec.issued = issued            # one list: the order across the three sets of collectives
        ex = HierarchicalEngine(Engine(recs[0], cfg, joins=joins), recs[1], recs[2], topo,
                                  end_of_step_sync=joins)
        tickets = []
        for g, members in enumerate(groups):
            tickets += ex.start_group([(torch.randn(sizes[i]), f"t{i}") for i in members], str(g))
        for tk in tickets:
            ex.finish(tk)
        return issued, ex.stats.collectives

    res, errs = run_hier(topo, body)
    assert errs == [None] * topo.size, errs
    return res


@pytest.mark.parametrize("cfg,shape,joins", [
    (TernGradConfig(min_numel=100, fusion_numel=0, hierarchical=True), (2, 2), True),
    (TernGradConfig(min_numel=100, fusion_numel=1500, hierarchical=True), (2, 2), True),
    (TernGradConfig(min_numel=100, fusion_numel=0, hierarchical=True), (2, 2), False),
    (TernGradConfig(min_numel=100, fusion_numel=0, shared_scaler=True, hierarchical=True), (2, 2), True),
    (TernGradConfig(min_numel=100, fusion_numel=1500, shared_scaler=True, hierarchical=True), (2, 2), True),
    (TernGradConfig(min_numel=100, fusion_numel=0, exchange="sharded", hierarchical=True), (2, 2), True),
    (TernGradConfig(min_numel=100, fusion_numel=1500, exchange="sharded", hierarchical=True), (3, 2), True),
    (TernGradConfig(min_numel=100, fusion_numel=1500, exchange="reternarized", hierarchical=True), (3, 2), True),
    (TernGradConfig(min_numel=100, fusion_numel=0, exchange="auto", hierarchical=True), (2, 3), True),
    (TernGradConfig(min_numel=100, fusion_numel=1500, exchange="requantized", hierarchical=True), (3, 2), True),
    (TernGradConfig(min_numel=100, fusion_numel=1500, hierarchical=True), (5, 2), True),
], ids=["per-rank", "per-rank-fused", "per-rank-ddp", "shared", "shared-fused", "sharded", "sharded-fused-3x2",
        "reternarized-fused-3x2", "auto-2x3", "requantized-fused-3x2", "default-5x2"])
def test_node_aware_schedule_issues_what_the_hierarchical_engine_issues(cfg, shape, joins):
    """The node-aware engine on M x G thread-ranks with subgroups (the Horovod frontend's: presence check and
    end-of-step sync; joins=False: the DDP hook's, neither), started group by group and finished in hook
    order: every local rank's collectives (world, node and cross group, in one list as issued) have the names,
    order and count the timeline schedules for that local rank."""
    from horovod_terngrad.exchange.topology import Topology
    M, G = shape
    N, net, sizes = M * G, nodes(ranks_per_node=G), ENGINE_SIZES
    topo = Topology.contiguous(N, G)
    method = method_of(cfg)
    plan = pm.plan_buffers(method, sizes, N, net, config=cfg)
    groups = [b.members for b in plan if b.method != "fp32"]
    assert {b.method for b in plan} == {"terngrad_hierarchical", "fp32"}

    res = engine_issued(topo, cfg, groups, sizes, joins)
    for r in range(N):
        t = timeline_step(sizes, 0.05, N, net, method, config=cfg, joins=joins, local_rank=topo.local_rank(r))
        issued, count = res[r]
        assert issued == list(t.issued), r
        assert t.collectives == count
        assert sum(x.startswith("terngrad.h.a2a.") for x in issued) == len(groups)
        assert sum(x.startswith(("terngrad.presence.", "terngrad.h.done.")) for x in issued) == (2 if joins else 0)


def test_node_aware_and_flat_groups_in_one_step_issue_what_the_engine_issues(monkeypatch):
    """hierarchical="auto" on 2 x 2 thread-ranks: the engine decides each group on the configured network
    (the environment's defaults), the timeline on the same network passed as ``auto_network``: the large
    groups go node-aware, the small ones flat (the flat engine's own presence check), one under min_numel
    by Horovod's allreduce; the same names in the same order."""
    from horovod_terngrad.exchange import cost
    from horovod_terngrad.exchange.topology import Topology
    for var in ("GBPS", "ALPHA_US", "INTRA_GBPS", "INTRA_ALPHA_US", "INTRA_LINKS"):
        monkeypatch.delenv(f"HOROVOD_TERNGRAD_{var}", raising=False)
    monkeypatch.setenv("HOROVOD_TERNGRAD_MEASURE_LINKS", "0")     # the configured network's decisions
    sizes, N, topo = [200_000, 5000, 100, 150_000, 6000], 4, Topology.contiguous(4, 2)
    for cfg in (TernGradConfig(fusion_numel=0), TernGradConfig(fusion_numel=0, shared_scaler=True)):
        kw = dict(config=cfg, auto_network=cost.configured_network())
        t = timeline_step(sizes, 0.05, N, nodes(), "terngrad_allgather", **kw)
        plan = pm.plan_buffers("terngrad_allgather", sizes, N, cost.configured_network(), config=cfg,
                               step_allreduces=pm.HOROVOD_STEP_ALLREDUCES, ranks_per_node=2)
        assert [b.method for b in plan] == ["terngrad_allgather", "terngrad_hierarchical", "terngrad_allgather",
                                              "terngrad_hierarchical", "fp32"]
        groups = [b.members for b in plan if b.method != "fp32"]
        res = engine_issued(topo, cfg, groups, sizes, joins=True)
        for r in range(N):
            mine = timeline_step(sizes, 0.05, N, nodes(), "terngrad_allgather", local_rank=r % 2, **kw)
            assert res[r] == (list(mine.issued), mine.collectives), r
        assert "terngrad.h.a2a.1" in t.issued and "terngrad.h.a2a.0" not in t.issued


@pytest.mark.parametrize("cfg,shape", [
    (TernGradConfig(hierarchical=True, fusion_numel=0), (2, 2)),
    (TernGradConfig(hierarchical=True, fusion_numel=0, shared_scaler=True), (2, 4)),
    (TernGradConfig(hierarchical=True, fusion_numel=0, exchange="sharded"), (3, 2)),
    (TernGradConfig(hierarchical=True, fusion_numel=0, exchange="auto"), (4, 2)),
], ids=["per-rank-2x2", "shared-2x4", "sharded-3x2", "auto-4x2"])
def test_node_aware_communication_is_the_cost_models_at_most(cfg, shape):
    """No compute, no codec: one node-aware group costs what exchange.cost.hierarchical_cost says (its
    intra-node alltoall and allgather on the intra-node channel, the slowest local rank's cross exchange on a
    G-th of the node's link) plus the two 4-byte world allreduces (none for the DDP hook); several groups
    at most the additive model's sum, less where one group's intra-node stages overlap another's cross
    exchange; with compute, at most compute + that sum."""
    from horovod_terngrad.exchange import cost, policy, topology
    M, G = shape
    N, net, method = M * G, nodes(ranks_per_node=G), method_of(cfg)
    n = 1_000_003                               # shards of unequal size: the slowest local rank sets the time
    one = cost.hierarchical_cost([n], M, G, net, cfg.packing, cfg.bucket_size, cfg.scaler_shared_for("allgather"),
                                 policy.transport_among(cfg.exchange, M), cfg.intra_node_width)
    presence = cost.presence_cost(N, net).time_s
    t = timeline_step([n], 0.0, N, net, method, config=cfg)
    assert t.step_s == pytest.approx(one.time_s + 2 * presence, rel=1e-12)
    assert t.collectives == len(t.issued) and t.issued[0] == "terngrad.presence.0"
    c, P = topology.intra_node_bytes([n], G, cfg.intra_node_width)
    assert t.intra_busy_s == pytest.approx(pm.alltoall_time(c, G, net.intra_node, G)
                                           + pm.ring_allgather_time(P, G, net.intra_node))
    assert t.channel_busy_s == pytest.approx(t.step_s - t.intra_busy_s)    # nothing overlaps in one group
    ddp = timeline_step([n], 0.0, N, net, method, config=cfg, joins=False)
    assert ddp.step_s == pytest.approx(one.time_s, rel=1e-12)
    assert t.step_s == max(timeline_step([n], 0.0, N, net, method, config=cfg, local_rank=j).step_s for j in range(G))
    # several groups: the additive model charges them one after another
    sizes = [n, 700_001, 300_000, 1_200_000]
    additive = pm.model_exchange_cost(method, sizes, N, net, config=cfg, fusion_numel=0)[0].time_s
    assert additive == pytest.approx(sum(cost.hierarchical_cost([x], M, G, net, cfg.packing, 0,
                                                                cfg.scaler_shared_for("allgather"),
                                                                policy.transport_among(cfg.exchange, M),
                                                                cfg.intra_node_width).time_s
                                         for x in sizes) + 2 * presence)
    many = timeline_step(sizes, 0.0, N, net, method, config=cfg)
    assert many.step_s <= additive * (1 + 1e-12)
    # every collective once (collectives fused into one round pay one latency term)
    assert additive - 4 * 50e-6 * many.collectives < many.intra_busy_s + many.channel_busy_s <= additive * (1 + 1e-12)
    assert many.step_s < additive - 0.5 * many.intra_busy_s     # the intra-node stages mostly hide
    busy = timeline_step(sizes, 0.2, N, net, method, config=cfg)
    assert busy.step_s <= 0.2 + additive and busy.step_s < 0.2 + many.step_s


def test_node_aware_codec_stages_run_where_the_engine_runs_them():
    """One tensor of n elements on 2 x 2: the hook sends the presence check (waited for) and the intra-node
    alltoall, nothing else; after backward the node sum (G passes over the n/G shard), the statistics and
    encoding of the shard, its decode from M payloads, and the copy of the member out of the gathered shards."""
    n, compute = 100_000, 0.01
    rates = CodecRates(prepare=1e-8, encode=2e-8, decode_base=1e-8, decode_per_payload=1e-9, owner_sum=1e-9,
                       decode_sums=1e-8, cast=1e-9, add=3e-9)
    net = nodes()
    t = timeline_step([n], compute, 4, net, "terngrad_allgather", codec=rates, fusion_numel=0,
                      config=TernGradConfig(hierarchical=True))
    presence = pm.allreduce_time(4, 4, net)
    assert t.backward_end_s == pytest.approx(compute + presence)
    shard = n // 2
    codec = 2 * 3e-9 * shard + (1e-8 + 2e-8 + 1e-8 + 2 * 1e-9) * shard + 3e-9 * n
    assert t.codec_s == pytest.approx(codec)
    free = timeline_step([n], compute, 4, net, "terngrad_allgather", fusion_numel=0,
                         config=TernGradConfig(hierarchical=True))
    assert t.step_s == pytest.approx(free.step_s + codec)
    # a calibration from before ``add`` was measured: one fp32 pass is charged as a cast
    old = CodecRates(*[getattr(rates, f) for f in ("prepare", "encode", "decode_base", "decode_per_payload",
                                                   "owner_sum", "decode_sums", "cast")])
    assert old.add is None and old.fp32_pass == 1e-9 and old.slowed(2).fp32_pass == 2e-9
    with pytest.raises(ValueError, match="local_rank"):
        timeline_step([n], compute, 4, net, "terngrad_allgather", config=TernGradConfig(hierarchical=True),
                      local_rank=2)


def test_node_aware_schedule_beats_flat_on_a_slow_link_and_auto_follows_hierarchy_for():
    """1.5 Gbit/s between nodes of 2 ranks, 100 Gbit/s inside: a 6.25M-element layer's group is faster
    node-aware than flat; hierarchical="auto" sends a group node-aware exactly where
    exchange.cost.hierarchy_for does, with the Horovod frontend's two 4-byte world allreduces weighed
    (``step_allreduces``), without them for the DDP hook; the default plan on the paper's Ethernet cluster
    (nodes of 4) is scheduled, not refused."""
    from horovod_terngrad.exchange import cost
    net = nodes(gbps=1.5)
    big = [6_250_000]
    flat = timeline_step(big, 0.1, 4, net, "terngrad", hierarchical=False)
    aware = timeline_step(big, 0.1, 4, net, "terngrad", hierarchical=True)
    assert "terngrad.h.a2a.0" in aware.issued and not any(".h." in x for x in flat.issued)
    assert aware.step_s - 0.1 < 0.6 * (flat.step_s - 0.1)      # what the step adds to compute: about half
    sizes = [1_000_000, 50_000, 3_000_000, 20_000]
    for joins, allreduces in ((True, pm.HOROVOD_STEP_ALLREDUCES), (False, 0)):
        t = timeline_step(sizes, 0.1, 4, net, "terngrad_allgather", fusion_numel=0, joins=joins)
        want = [cost.hierarchy_for([x], 2, 2, network=net, step_allreduces=allreduces) for x in sizes[::-1]]
        assert [f"terngrad.h.a2a.{g}" in t.issued for g in range(len(sizes))] == want
        assert want == ([False, True, False, True] if joins else [True] * 4)     # groups in backward order
    eth = pm.ETHERNET_1G                              # 8 ranks: 2 nodes of 4 on 1 Gbit/s, PCIe inside
    sizes = [1_000_000, 4096, 300_000]
    t = timeline_step(sizes, 0.1, 8, eth, "terngrad_allgather")
    assert pm.predict_step(sizes, 0.1, 8, eth, "terngrad_allgather").exchanges[0] == "terngrad_hierarchical"
    assert "terngrad.h.a2a.0" in t.issued and t.local_rank in range(4)
    flat = timeline_step(sizes, 0.1, 8, eth, "terngrad_allgather", hierarchical=False)
    assert 0.1 < t.step_s < flat.step_s


def test_world_negotiation_is_half_a_cycle_plus_a_tree_over_the_world():
    from horovod_terngrad.modelling.timeline import HOROVOD_CYCLE_TIME_S, negotiation_s
    net = pm.CLUSTERS["infiniband"].network
    assert negotiation_s(1, net) == 0.0
    assert negotiation_s(512, net) == pytest.approx(HOROVOD_CYCLE_TIME_S / 2 + 2 * 9 * net.link_for(512).latency_s)
    waits = [negotiation_s(n, net) for n in (2, 8, 64, 512)]
    assert waits == sorted(waits) and waits[0] < waits[-1]


def test_scheduled_scaling_is_timeline_step_with_the_negotiation_wait():
    from horovod_terngrad.modelling.timeline import negotiation_s, scheduled_scaling
    model, cluster = pm.MODELS["alexnet"], pm.CLUSTERS["infiniband"]
    c = model.compute_s[cluster.gpu]
    with_wait = scheduled_scaling(model, cluster, [64], methods=(pm.FP16, pm.TERNGRAD_RETERNARIZED))[0]
    without = scheduled_scaling(model, cluster, [64], methods=(pm.FP16, pm.TERNGRAD_RETERNARIZED),
                                negotiation=False)[0]
    for m, t in with_wait.items():
        want = timeline_step(model.sizes, c, 64, cluster.network, m, cycle_s=negotiation_s(64, cluster.network),
                             names=[n for n, _ in model.tensors])
        assert t.step_s == want.step_s and t.compute_s == c
        assert c <= without[m].step_s < t.step_s      # every collective waits for the cycle: the step grows


def test_scheduled_hsdp_charges_the_additive_models_busy_times_and_overlaps_them():
    """The scheduled HSDP step keeps the additive model's link busy times (same bytes and latencies) and is never
    longer than their sum with compute; on one node there is no cross-node time."""
    model = hsdp.GPTConfig("tiny GPT", 2, 256, 1000, 128)
    for key in ("ethernet", "infiniband"):
        net = pm.CLUSTERS[key].network
        for method in (hsdp.HSDP_BF16, hsdp.HSDP_TERNGRAD, hsdp.HSDP_TERNGRAD_RETERNARIZED):
            for N in (4, 16):
                s = hsdp.scheduled_hsdp_step(model, N, net, method, compute_s=0.05)
                a = hsdp.predict_hsdp_step(model, N, net, method, compute_s=0.05)
                assert s.intra_s == pytest.approx(a.intra_s) and s.cross_s == pytest.approx(a.cross_s)
                assert max(s.compute_s, s.cross_s) <= s.step_s <= a.step_s + 1e-12
                assert s.limit_s == pytest.approx(a.limit_s)
                if N == 4:
                    assert s.cross_s == 0.0


def test_the_command_line_prints_the_scheduled_tables(capsys):
    from horovod_terngrad.modelling import cli
    assert cli.main(["--model", "alexnet", "--cluster", "infiniband", "--max-workers", "8", "--scheduled"]) == 0
    out = capsys.readouterr().out
    assert "scheduled step model" in out and "| 8 | 0.530 |" in out and "| reternarized |" in out
    assert "| fp32 | fp16 | default | auto |" in out      # default: TernGradConfig(); auto: exchange="auto"
    assert cli.main(["hsdp", "--cluster", "ethernet", "--workers", "8", "--scheduled", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| 8 | 2 |" in out and "TG-rt / limit" in out and "| default |" in out
