"""Layer 3: the node-aware exchange (exchange/hierarchical.py, exchange/topology.py) on thread-ranks with
subgroups, against an independent recomputation of the hierarchical average."""
import os
import subprocess
import sys
import threading

import pytest
import torch

from helpers import expected_average, expected_hierarchical as reference, run_hier
from horovod_terngrad import NonFiniteGradientError, TernGradConfig
from horovod_terngrad.exchange import Engine, ThreadWorld
from horovod_terngrad.exchange.collectives import CollectiveError
from horovod_terngrad.exchange.hierarchical import HierarchicalEngine, HierarchicalTicket
from horovod_terngrad.exchange.topology import Piece, Topology, piece_name, shard_bounds, shard_plan  # noqa: F401


def grad(shape, rank, tensor=0):
    gen = torch.Generator().manual_seed(1000 * tensor + rank)
    return torch.randn(shape, generator=gen) * (rank + 1)


def engine(cfg, c, local, cross, topo, steps=None):
    return HierarchicalEngine(Engine(c, cfg, steps=steps), local, cross, topo)


# -- topology and plan --------------------------------------------------------------------------
def test_topology_from_hosts_handles_interleaved_placement_and_says_when_it_cannot_apply():
    topo = Topology.from_hosts(["a", "b", "a", "b", "a", "b"])
    assert topo.nodes == ((0, 2, 4), (1, 3, 5))
    assert topo.local_groups() == [(0, 2, 4), (1, 3, 5)] and topo.cross_groups() == [(0, 1), (2, 3), (4, 5)]
    assert topo.local_rank(4) == 2 and topo.node_of(5) == 1 and topo.cross_ranks_of(3) == (2, 3)
    assert topo.flat_reason() is None and "interleaved" in topo.describe()
    assert "one node" in Topology.from_hosts(["a"] * 4).flat_reason()
    assert "one rank" in Topology.from_hosts(["a", "b", "c"]).flat_reason()
    assert "different rank counts" in Topology.from_hosts(["a", "a", "b", "b", "b"]).flat_reason()
    assert Topology.contiguous(8, 4).nodes == ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.mark.parametrize("numels,G", [([10], 3), ([5, 7, 1], 4), ([2], 4), ([100, 3, 50], 2)])
def test_shard_plan_covers_every_element_once_in_order(numels, G):
    plan = shard_plan(numels, G)
    assert len(plan) == G
    seen = [[] for _ in numels]
    for j, pieces in enumerate(plan):
        assert sum(p.numel for p in pieces) == shard_bounds(sum(numels), G)[j][1] - shard_bounds(sum(numels), G)[j][0]
        for p in pieces:
            seen[p.member].append((p.start, p.stop))
    for n, spans in zip(numels, seen):
        assert sorted(spans) == spans and spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert piece_name("w", Piece(0, 0, 5), 5) == "w" and piece_name("w", Piece(0, 2, 5), 5) == "w[2:5]"


# -- bit for bit against the reference ----------------------------------------------------------
TOPOS = {"2x2": Topology.contiguous(4, 2), "2x3": Topology.contiguous(6, 3), "4x2": Topology.contiguous(8, 2),
         "2x2-interleaved": Topology.from_hosts(["h0", "h1", "h0", "h1"]),
         "2x2-crossed": Topology.from_hosts(["h0", "h1", "h1", "h0"])}   # cross group 1 is (2, 3): node 1 first
CONFIGS = {"default": TernGradConfig(hierarchical=True),
           "shared": TernGradConfig(hierarchical=True, shared_scaler=True),
           "sharded": TernGradConfig(hierarchical=True, exchange="sharded", packing="base3"),
           "reternarized": TernGradConfig(hierarchical=True, exchange="reternarized"),
           "buckets": TernGradConfig(hierarchical=True, bucket_size=7, seed=3),
           # the intra-node stages in bf16: each rank's shard and the averaged shards rounded on the wire
           "bf16": TernGradConfig(hierarchical=True, intra_node_dtype="bfloat16"),
           "bf16-reternarized": TernGradConfig(hierarchical=True, exchange="reternarized", intra_node_dtype="bfloat16")}
SHAPES = [(20, 50), (37,), (7, 3, 3), (1,), (1001,)]


def two_steps(ex, rank, names, fused):
    """Two steps of SHAPES' gradients of ``rank`` through ``ex``, fused as one group or each alone: the
    averages per step, and the classes of the tickets ``ex`` handed out."""
    outs, kinds = [], set()
    for step in range(2):
        gs = [grad(s, rank, i + 10 * step) for i, s in enumerate(SHAPES)]
        if fused:
            tickets = ex.start_group(list(zip(gs, names)), "g0")
        else:
            tickets = [ex.start(g, n) for g, n in zip(gs, names)]
        kinds |= {type(t) for t in tickets}
        outs.append([ex.finish(t) for t in tickets])
    return outs, kinds


@pytest.mark.parametrize("topo", list(TOPOS), ids=list(TOPOS))
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "alone"])
def test_every_rank_gets_the_recomputed_hierarchical_average_bit_for_bit(topo, cfg, fused):
    topo, cfg = TOPOS[topo], CONFIGS[cfg]
    names = [f"layer{i}" for i in range(len(SHAPES))]

    def body(c, local, cross):
        ex = engine(cfg, c, local, cross, topo)
        outs, kinds = two_steps(ex, c.rank, names, fused)
        assert kinds == {HierarchicalTicket}
        return outs, dict(ex.steps)

    res, errs = run_hier(topo, body)
    assert errs == [None] * topo.size, errs
    ref_steps: dict = {}
    for step in range(2):
        per_rank = [[grad(s, r, i + 10 * step) for i, s in enumerate(SHAPES)] for r in range(topo.size)]
        if fused:
            want = reference(per_rank, names, topo, cfg, ref_steps)
        else:
            want = [reference([[per_rank[r][i]] for r in range(topo.size)], [names[i]], topo, cfg, ref_steps)[0]
                    for i in range(len(SHAPES))]
        for r in range(topo.size):
            for i in range(len(SHAPES)):
                assert torch.equal(res[r][0][step][i], want[i]), (step, i, r)
    # the step counters a checkpoint saves: every piece's, on every rank (not only the pieces it owns)
    for r in range(topo.size):
        assert res[r][1] == ref_steps, r


@pytest.mark.parametrize("intra", ["float32", "bfloat16"])
@pytest.mark.parametrize("topo", ["2x2", "2x3", "2x2-crossed"])
@pytest.mark.parametrize("exchange", ["requantized", "reternarized", "allgather"])
def test_the_noise_estimate_comes_through_the_node_aware_exchange(topo, exchange, intra):
    """horovod_terngrad.optim's noise estimate on the node-aware path: the cross stage's estimate (its only
    ternary rounding) of every piece, carried by the intra-node allgather to every local rank and put together
    per member as the average is: the reference's bit for bit (re-ternarized, requantized), identical on every
    rank of the job (allgather too), only for the members that asked, and the averages unchanged by asking."""
    topo = TOPOS[topo]
    cfg = TernGradConfig(hierarchical=True, exchange=exchange, intra_node_dtype=intra)
    names = [f"layer{i}" for i in range(len(SHAPES))]

    def body(c, local, cross):
        ex = engine(cfg, c, local, cross, topo)
        gs = [grad(s, c.rank, i) for i, s in enumerate(SHAPES)]
        tickets = ex.start_group(list(zip(gs, names)), "g0")
        for i, tk in enumerate(tickets):
            tk.want_noise = i != 1          # one member does not ask
        outs = [ex.finish(t) for t in tickets]
        return outs, [t.noise for t in tickets]

    res, errs = run_hier(topo, body)
    assert errs == [None] * topo.size, errs
    per_rank = [[grad(s, r, i) for i, s in enumerate(SHAPES)] for r in range(topo.size)]
    if exchange == "allgather":
        want = reference(per_rank, names, topo, cfg, {})
        want_nu = res[0][1]
    else:
        want, want_nu = reference(per_rank, names, topo, cfg, {}, noise=True)
    for r in range(topo.size):
        outs, noises = res[r]
        for i in range(len(SHAPES)):
            assert torch.equal(outs[i], want[i]), (r, i)
            if i == 1:
                assert noises[i] is None
            else:
                assert torch.equal(noises[i].reshape(-1), want_nu[i].reshape(-1)), (r, i)
                assert (noises[i] >= 0).all()
    assert any(bool((n > 0).any()) for n in want_nu if n is not None)


@pytest.mark.parametrize("topo", list(TOPOS), ids=list(TOPOS))
@pytest.mark.parametrize("cfg", ["default", "buckets", "auto", "requantized"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "alone"])
def test_world_groups_give_the_subgroups_bits(topo, cfg, fused):
    """The node and cross groups carried by world alltoalls (no process sets): the same average, bit for bit,
    as the reference; a tensor of fewer elements than a node has ranks goes flat there (some local rank would
    own nothing and post nothing); the cross collectives are named alike in every cross group."""
    topo = TOPOS[topo]
    cfg = CONFIGS[cfg] if cfg not in ("auto", "requantized") else TernGradConfig(hierarchical=True, exchange=cfg)
    names = [f"layer{i}" for i in range(len(SHAPES))]
    posted = []

    def body(c, local, cross):
        assert local.spans_world and cross.spans_world
        ex = engine(cfg, c, local, cross, topo)
        return two_steps(ex, c.rank, names, fused)[0], dict(ex.steps)

    world_post = ThreadWorld.post

    def spy(self, kind, name, rank, tensor, splits=None):
        posted.append((kind, name, rank))
        return world_post(self, kind, name, rank, tensor, splits)

    ThreadWorld.post = spy
    try:
        res, errs = run_hier(topo, body, world_groups=True)
    finally:
        ThreadWorld.post = world_post
    assert errs == [None] * topo.size, errs
    ref_steps: dict = {}
    for step in range(2):
        per_rank = [[grad(s, r, i + 10 * step) for i, s in enumerate(SHAPES)] for r in range(topo.size)]
        if fused:
            want = reference(per_rank, names, topo, cfg, ref_steps)
        else:
            want = []
            for i, shape in enumerate(SHAPES):
                one = [[per_rank[r][i]] for r in range(topo.size)]
                if per_rank[0][i].numel() < topo.ranks_per_node:      # flat: every rank's own stream
                    want.append(expected_average([o[0] for o in one], names[i], step, cfg)[0])
                else:
                    want.append(reference(one, [names[i]], topo, cfg, ref_steps)[0])
        for r in range(topo.size):
            for i in range(len(SHAPES)):
                assert torch.equal(res[r][0][step][i], want[i]), (step, i, r)
    # every collective was posted by every rank of the world under one name (world ops only)
    by_name: dict = {}
    for kind, name, rank in posted:
        by_name.setdefault((kind, name), set()).add(rank)
    assert by_name and all(ranks == set(range(topo.size)) for ranks in by_name.values()), by_name
    assert any(".x." in n or n.endswith(".x") for _, n in by_name), sorted(by_name)


def test_auto_over_world_groups_runs_what_default_runs_among_the_nodes():
    """Over world collectives every cross group must post the same collectives, so exchange="auto" cannot decide
    per cross group: it runs what "default" runs among the M nodes, bit for bit (5 nodes: the re-ternarized
    exchange in 128-element buckets), not the allgather it kept to before
    (2·(M-1) bits per element received across nodes, where "auto" is meant to be no slower than "default")."""
    topo = Topology.contiguous(10, 2)
    names = [f"layer{i}" for i in range(len(SHAPES))]
    got = {}
    for setting in ("default", "auto"):
        cfg = TernGradConfig(hierarchical=True, exchange=setting)

        def body(c, local, cross):
            ex = engine(cfg, c, local, cross, topo)
            outs = two_steps(ex, c.rank, names, fused=True)[0]
            return outs, ex.cross_engine.stats.bytes_received

        res, errs = run_hier(topo, body, world_groups=True)
        assert errs == [None] * topo.size, errs
        got[setting] = res
    for r in range(topo.size):
        (auto, auto_bytes), (default, default_bytes) = got["auto"][r], got["default"][r]
        assert auto_bytes == default_bytes > 0
        for step in range(2):
            assert all(torch.equal(a, d) for a, d in zip(auto[step], default[step])), (r, step)
    from horovod_terngrad.exchange import policy
    assert policy.default_transport(5) == "requantized"


def test_world_group_collectives_allgather_alltoall_and_allreduce():
    topo = Topology.from_hosts(["a", "b", "b", "a", "c", "c"])     # nodes (0, 3), (1, 2), (4, 5)

    def body(c, local, cross):
        me = torch.tensor([float(c.rank)] * (c.rank % 2 + 1))
        ag = local.synchronize(local.allgather_async(me, "ag"))
        a2a = local.synchronize(local.alltoall_async(torch.arange(2, dtype=torch.float32) + 10 * c.rank, [1, 1], "a2a"))
        mx = cross.synchronize(cross.allreduce_max_async(torch.tensor([c.rank, -c.rank], dtype=torch.float64), "mx"))
        sm = cross.synchronize(cross.allreduce_sum_async(torch.tensor([1, c.rank], dtype=torch.int32), "sm"))
        return local.rank, local.size, cross.rank, cross.size, ag, a2a, mx, sm

    res, errs = run_hier(topo, body, world_groups=True)
    assert errs == [None] * 6, errs
    for r, (lr, ls, cr, cs, ag, a2a, mx, sm) in enumerate(res):
        node = topo.local_ranks_of(r)
        group = topo.cross_ranks_of(r)
        assert (lr, ls, cr, cs) == (node.index(r), 2, group.index(r), 3)
        assert ag.tolist() == [float(q) for q in node for _ in range(q % 2 + 1)]
        assert a2a.tolist() == [10.0 * q + node.index(r) for q in node]
        assert mx.tolist() == [max(group), -min(group)]
        assert sm.tolist() == [3, sum(group)]


def test_steps_leave_nothing_queued_and_reuse_the_intra_node_buffer():
    """A long run must not accumulate finished groups (the queue held every group of every step), and the
    allgather's send buffer of a group, and its bf16 send buffers, serve it again the next step (no fresh tens of
    MB per step)."""
    topo, cfg = TOPOS["2x2"], CONFIGS["default"]

    def body(c, local, cross):
        ex = engine(cfg, c, local, cross, topo)
        seen = []
        for step in range(3):
            tickets = [ex.start(grad((400,), c.rank, i + 10 * step), f"w{i}") for i in range(3)]
            for t in reversed(tickets):       # Horovod's order: the last started is often finished first
                ex.finish(t)
            seen.append(({k: v.data_ptr() for k, v in ex._buffers.outboxes.items()},
                         {k: v.data_ptr() for k, v in ex._buffers.wires.items()}))
            assert ex._cross_queue == [] and ex._a2a_queue == [] and ex.pending() == (0, 0)
        return seen

    assert cfg.intra_node_dtype == "bfloat16"
    res, errs = run_hier(topo, body)
    assert errs == [None] * topo.size, errs
    for seen in res:
        assert sorted(seen[0][0]) == ["w0", "w1", "w2"]
        # the bf16 send buffers of both intra-node stages, kept as well (the bits: the bit-for-bit tests' 2nd step)
        assert sorted(seen[0][1]) == [(f"w{i}", stage) for i in range(3) for stage in ("a2a", "ag")]
        assert seen[0] == seen[1] == seen[2]


def test_sum_and_low_precision_dtype():
    topo, cfg = TOPOS["2x2"], CONFIGS["default"]

    def body(c, local, cross):
        ex = engine(cfg, c, local, cross, topo)
        out = ex.finish(ex.start(grad((300,), c.rank).to(torch.bfloat16), "w", average=False))
        return out

    res, errs = run_hier(topo, body)
    assert errs == [None] * 4
    want = reference([[grad((300,), r).to(torch.bfloat16)] for r in range(4)], ["w"], topo, cfg, {}, average=False)[0]
    for out in res:
        assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))


def test_resume_draws_the_streams_of_an_uninterrupted_run():
    topo, cfg = TOPOS["2x3"], CONFIGS["default"]

    def run(steps_in, n_steps, first):
        def body(c, local, cross):
            steps = dict(steps_in[c.rank]) if steps_in else {}
            ex = engine(cfg, c, local, cross, topo, steps=steps)
            outs = [ex.finish(ex.start(grad((500,), c.rank, first + k), "w")) for k in range(n_steps)]
            return outs, dict(ex.steps)
        res, errs = run_hier(topo, body)
        assert errs == [None] * topo.size
        return res

    whole = run(None, 3, 0)
    part = run(None, 1, 0)
    resumed = run([r[1] for r in part], 2, 1)
    for r in range(topo.size):
        assert torch.equal(whole[r][0][1], resumed[r][0][0]) and torch.equal(whole[r][0][2], resumed[r][0][1])


@pytest.mark.parametrize("world_groups", [False, True], ids=["subgroups", "world-groups"])
@pytest.mark.parametrize("policy", ["propagate", "raise", "zero"])
def test_nan_on_one_rank_of_one_node_reaches_every_rank(policy, world_groups):
    topo = TOPOS["2x2"]
    cfg = TernGradConfig(hierarchical=True, on_nonfinite=policy)

    def body(c, local, cross):
        ex = engine(cfg, c, local, cross, topo)
        g = grad((40,), c.rank)
        if c.rank == 3:
            g[37] = float("nan")     # in the second half: shard 1, owned by local rank 1
        tks = ex.start_group([(g, "w"), (grad((9,), c.rank, 1), "b")], "g")
        outs = []
        for t in tks:
            try:
                outs.append(ex.finish(t))
            except NonFiniteGradientError as e:
                outs.append(e)
        # the next step works
        after = ex.finish(ex.start(grad((40,), c.rank, 2), "w"))
        return outs, after

    res, errs = run_hier(topo, body, world_groups=world_groups)
    assert errs == [None] * 4
    for outs, after in res:
        if policy == "raise":
            assert isinstance(outs[0], NonFiniteGradientError) and "'w'" in str(outs[0])
        elif policy == "propagate":    # NaN on every rank, the same bits (all NaN), as an allreduce would give
            assert outs[0].shape == (40,) and torch.isnan(outs[0]).all()
        else:
            assert torch.equal(outs[0], torch.zeros(40))
        assert isinstance(outs[1], torch.Tensor) and torch.isfinite(outs[1]).all()
        assert torch.isfinite(after).all()
    assert all(torch.equal(res[0][1], r[1]) for r in res)


@pytest.mark.parametrize("device_path", [False, True], ids=["host-path", "device-path"])
@pytest.mark.parametrize("policy", ["propagate", "raise", "zero"])
@pytest.mark.parametrize("across", ["reternarized", "allgather-layout-known"])
def test_nan_across_the_cross_stage_and_the_noise_of_the_members_after_it(policy, device_path, across, monkeypatch):
    """A NaN that reaches the cross exchange (3 nodes x 2: the re-ternarized one; or the allgather one decoding at
    known offsets, as the DDP frontend's engines do) is told to every rank of the node by the status words, on the
    host path (the cross engine raises per piece) and on the accelerator's path (the piece comes back NaN-filled
    and its status is set on the device: no host read per piece), run here on CPU tensors.  The members after the
    poisoned one keep their own noise estimate, bit for bit the clean run's."""
    from horovod_terngrad.exchange import allgather
    monkeypatch.setattr(allgather, "DEVICE_PATH_ON_CPU", device_path)
    topo = Topology.contiguous(6, 2)
    known = across == "allgather-layout-known"
    cfg = TernGradConfig(hierarchical=True, exchange="allgather" if known else "reternarized", on_nonfinite=policy)

    def run(poison):
        def body(c, local, cross):
            ex = engine(cfg, c, local, cross, topo)
            if known:
                ex.flat.layout_known = ex.cross_engine.layout_known = True
            gs = [grad((40,), c.rank), grad((90,), c.rank, 1), grad((33,), c.rank, 2)]
            if poison and c.rank == 3:
                gs[0][5] = float("nan")
            tks = ex.start_group([(gs[0], "w"), (gs[1], "b"), (gs[2], "c")], "g")
            for t in tks:
                t.want_noise = True
            outs = []
            for t in tks:
                try:
                    outs.append((ex.finish(t), t.noise))
                except NonFiniteGradientError as e:
                    outs.append((e, None))
            return outs
        res, errs = run_hier(topo, body)
        assert errs == [None] * topo.size, errs
        return res

    clean, poisoned = run(False), run(True)
    for r in range(topo.size):
        (w, w_noise), *rest = poisoned[r]
        if policy == "raise":
            assert isinstance(w, NonFiniteGradientError) and "'w'" in str(w)
        elif policy == "propagate":      # NaN on every rank, as an allreduce would give
            assert w.shape == (40,) and torch.isnan(w).all() and w_noise is None
        else:
            assert torch.equal(w, torch.zeros(40)) and w_noise is None
        for (out, noise), (want, want_noise) in zip(rest, clean[r][1:]):
            assert torch.equal(out, want)
            assert noise is not None and torch.equal(noise, want_noise)


def test_a_joined_rank_sends_the_step_by_the_flat_engine_with_zeros_for_it():
    topo, cfg = TOPOS["2x2"], CONFIGS["default"]

    def body(c, local, cross):
        ex = engine(cfg, c, local, cross, topo)
        first = ex.finish(ex.start(grad((64,), c.rank), "w"))
        if c.rank == 2:
            c.join()
            return first, None
        out = ex.finish(ex.start(grad((64,), c.rank, 1), "w"))
        c.join()
        return first, out

    res, errs = run_hier(topo, body)
    assert errs == [None] * 4, errs
    # the joined step: the flat join transport, rank 2 as zeros, the max of the active ranks' scalers
    grads = [grad((64,), r, 1) for r in (0, 1, 3)]
    # ('w' is 64 elements on 2 local ranks: the hierarchical step sent pieces 'w[0:32]' and 'w[32:64]', so
    # this is the first step of the stream of 'w' itself)
    want, _ = expected_average(grads, "w", 0, cfg.replace(shared_scaler=True), ranks=[0, 1, 3], world=4)
    for r in (0, 1, 3):
        assert torch.equal(res[r][1], want), r


def test_a_failed_collective_raises_the_collectives_error_on_every_rank_and_nobody_hangs():
    topo, cfg = TOPOS["2x2"], CONFIGS["default"]

    def body(c, local, cross):
        for coll in (c, local, cross):
            coll.timeout = 5.0
        ex = engine(cfg, c, local, cross, topo)
        if c.rank == 1:
            return "left"           # a rank that is gone
        return ex.finish(ex.start(grad((64,), c.rank), "w"))

    res, errs = run_hier(topo, body, timeout=60)
    for r in (0, 2, 3):
        assert isinstance(errs[r], CollectiveError), (r, errs[r])


@pytest.mark.parametrize("cfg", ["default", "shared", "sharded"])
def test_simulator_with_nodes_gives_the_hierarchical_average(cfg):
    """The simulator (one thread plays every rank, polling) drives the same node-aware engine."""
    from horovod_terngrad.modelling.simulate import Simulator
    cfg = CONFIGS[cfg]
    topo = Topology.contiguous(8, 4)
    sim = Simulator(torch.nn.Linear(2, 2), 8, cfg, ranks_per_node=4)
    assert all(isinstance(e, HierarchicalEngine) for e in sim.engines)
    ref_steps: dict = {}
    for step in range(2):
        per_rank = [grad((333,), r, step) for r in range(8)]
        got = sim.average_tensor(per_rank, "w")
        want = reference([[t] for t in per_rank], ["w"], topo, cfg, ref_steps)[0]
        assert torch.equal(got, want), step


def test_cost_model_charges_the_plans_sizes_and_prefers_the_hierarchy_on_slow_links():
    from horovod_terngrad.codec import sizes as wire
    from horovod_terngrad.exchange import cost
    from horovod_terngrad.exchange.topology import intra_node_bytes
    slow = cost.Network.from_gbps("eth", 1, 50, 4, cost.Network.from_gbps("pcie", 100, 5))
    numels = [1_000_000, 4096, 300_000]
    h = cost.hierarchical_cost(numels, 8, 4, slow, cross="allgather")
    worst = max(shard_plan(numels, 4), key=lambda ps: (sum(p.numel for p in ps), len(ps)))
    P = sum(wire.payload_size(p.numel, "2bit", 0) for p in worst)
    assert h.bytes_received == 7 * P                       # the cross allgather on M = 8 nodes
    c, P_local = intra_node_bytes(numels, 4)
    assert c == 4 * sum(p.numel for p in worst) and P_local == c + 4 * len(worst)
    assert cost.hierarchy_for(numels, 8, 4, network=slow)
    assert not cost.hierarchy_for(numels, 1, 4, network=slow) and not cost.hierarchy_for(numels, 8, 1, network=slow)
    # inside a node slower than between nodes, reducing there first does not pay
    odd = cost.Network.from_gbps("ib", 100, 1, 4, cost.Network.from_gbps("slow-bus", 0.1, 500))
    assert not cost.hierarchy_for(numels, 2, 4, network=odd)


def test_hierarchical_auto_measures_the_links_once_agrees_and_says_so(monkeypatch, caplog):
    """hierarchical="auto" without a configured rate (no HOROVOD_TERNGRAD_GBPS): the plan step measures the link
    across nodes (a world probe) and inside a node (each node's, agreed as the mean over the job), every rank
    prices the same measured network, rank 0 says what it measured and chose in one line; the averages are still
    bit for bit one of the two plans' (both are exact functions of the data).  With a rate given, nothing is
    measured."""
    import logging
    monkeypatch.delenv("HOROVOD_TERNGRAD_GBPS", raising=False)
    monkeypatch.delenv("HOROVOD_TERNGRAD_MEASURE_LINKS", raising=False)
    topo = TOPOS["2x2"]
    cfg = TernGradConfig()

    def body(c, local, cross):
        ex = engine(cfg, c, local, cross, topo)
        ex.plan_exchange(torch.device("cpu"))
        outs = [ex.allreduce(grad((300, 300), c.rank, step), "w") for step in range(2)]
        net = ex.plan.network
        return outs, (net.name, net.bandwidth_Bps, net.intra_node.bandwidth_Bps)

    with caplog.at_level(logging.INFO, logger="horovod_terngrad"):
        res, errs = run_hier(topo, body)
    assert errs == [None] * topo.size, errs
    assert len({r[1] for r in res}) == 1 and res[0][1][0] == "measured" and res[0][1][1] > 0
    said = [r for r in caplog.records if "TernGrad plan" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said     # seen with Python's default logging
    text = said[0].getMessage()
    assert text.startswith(f"TernGrad plan on {topo.describe()} (hierarchical='auto'): "), text
    assert "measured" in text and "across nodes" in text and "priced as" in text and "\n" not in text, text
    for step in range(2):
        assert all(torch.equal(r[0][step], res[0][0][step]) for r in res)

    from horovod_terngrad.exchange import engine as engine_mod
    monkeypatch.setenv("HOROVOD_TERNGRAD_GBPS", "1")
    monkeypatch.setattr(engine_mod, "_stated", set())        # a line said earlier in this process is not said again
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="horovod_terngrad"):
        res2, errs = run_hier(topo, body)
    assert errs == [None] * topo.size and res2[0][1][0] == "configured"
    said = [r.getMessage() for r in caplog.records if "TernGrad plan" in r.getMessage()]
    assert len(said) == 1 and "measured" not in said[0], said


class _Issued:
    """A rank's collectives that record the name of every collective issued on them, in issue order."""

    def __init__(self, inner):
        self.inner, self.issued = inner, []

    def __getattr__(self, attr):
        got = getattr(self.inner, attr)
        if not attr.endswith("_async"):
            return got

        def issue(*args, **kw):
            self.issued.append(next(a for a in args if isinstance(a, str)))
            return got(*args, **kw)
        return issue


# measured links (Gbit/s across nodes, inside a node) and what hierarchical="auto" plans on them for one group of
# 90,000 elements on 2 nodes x 2 ranks: inside no faster than across (the 2 emulated hosts of 2 ranks at 1 Gbit/s,
# where the plan is flat), and a fast node on a slow network (node-aware)
PLANNED_LINKS = {"flat": (1.2, 1.2), "node-aware": (1.0, 100.0)}


@pytest.mark.parametrize("links", list(PLANNED_LINKS))
def test_the_plan_is_made_before_the_first_exchange_and_its_one_line_names_what_runs(monkeypatch, caplog, links):
    """The plan step (``plan_exchange``) measures the links and decides node-aware or flat before the first
    exchange: every collective of the measurement comes before the first collective of an exchange, and none after.
    Rank 0 says the plan in one line, and what runs is what the line says: the node-aware exchange with the
    transport it names across nodes, or the flat exchange with the transport it names among all ranks."""
    import logging

    from horovod_terngrad.exchange import engine as engine_mod, link
    from horovod_terngrad.exchange.thread_collectives import run_ranks
    from horovod_terngrad.exchange.world_groups import WorldGroupCollectives
    monkeypatch.delenv("HOROVOD_TERNGRAD_GBPS", raising=False)
    monkeypatch.delenv("HOROVOD_TERNGRAD_INTRA_GBPS", raising=False)
    monkeypatch.delenv("HOROVOD_TERNGRAD_MEASURE_LINKS", raising=False)
    monkeypatch.setattr(engine_mod, "_stated", set())
    across, inside = PLANNED_LINKS[links]

    def probe(coll, device, name):        # the ring's times at the rate of the link it crosses
        gbps = inside if name.endswith(".node") else across
        return 0.01, 0.01 + link.sent_bytes(coll, link.LARGE_NUMEL - link.SMALL_NUMEL) / (gbps * 1e9 / 8)
    monkeypatch.setattr(link, "probe", probe)
    topo = TOPOS["2x2"]

    def body(c):
        rec = _Issued(c)
        local = WorldGroupCollectives(rec, topo.local_ranks_of(c.rank))
        cross = WorldGroupCollectives(rec, topo.cross_ranks_of(c.rank))
        ex = HierarchicalEngine(Engine(rec, TernGradConfig()), local, cross, topo, over="over world collectives")
        ex.plan_exchange(torch.device("cpu"))
        planned = len(rec.issued)
        tk = ex.start(grad((300, 300), c.rank), "w")
        ex.finish(tk)
        # what ran, from the collectives' names: the node's alltoall, then the allgather transport across nodes
        # (terngrad.ag.w.x), or the allgather transport among all ranks (terngrad.ag.w)
        exchanged = [n for n in rec.issued[planned:] if not n.startswith("terngrad.presence")]
        return rec.issued, planned, (isinstance(tk, HierarchicalTicket), tuple(exchanged))

    with caplog.at_level(logging.INFO, logger="horovod_terngrad"):
        res = run_ranks(topo.size, body, timeout=120)
    for issued, planned, _ in res:
        assert planned > 0 and all(n.startswith("terngrad.link.") for n in issued[:planned]), issued
        assert issued[planned:] and not any(n.startswith("terngrad.link.") for n in issued[planned:]), issued
    ran = {r[2] for r in res}
    if links == "node-aware":
        assert ran == {(True, ("terngrad.h.a2a.w", "terngrad.ag.w.x", "terngrad.h.ag.w"))}, ran
    else:
        assert ran == {(False, ("terngrad.ag.w",))}, ran
    said = [r.getMessage() for r in caplog.records if "TernGrad plan" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    if links == "node-aware":
        assert "node-aware for groups of" in said[0] or "node-aware for every group" in said[0], said
        assert "across nodes the allgather exchange among 2 ranks" in said[0], said
    else:
        assert "flat for every group" in said[0] and "flat: the allgather exchange among 4 ranks" in said[0], said


def _priced_links_2x2() -> list:
    """Every rank's (name, rate across, rate inside) of the network hierarchical='auto' prices on 2 nodes x 2 ranks,
    after one exchange."""
    topo = TOPOS["2x2"]

    def body(c, local, cross):
        ex = engine(TernGradConfig(), c, local, cross, topo)
        ex.plan_exchange(torch.device("cpu"))
        ex.allreduce(grad((300, 300), c.rank, 0), "w")
        net = ex.plan.network
        return net.name, net.bandwidth_Bps, net.intra_node.bandwidth_Bps

    res, errs = run_hier(topo, body)
    assert errs == [None] * topo.size, errs
    return res


@pytest.mark.parametrize("given", [{"HOROVOD_TERNGRAD_GBPS": "25"},
                                   {"HOROVOD_TERNGRAD_GBPS": "25", "HOROVOD_TERNGRAD_INTRA_GBPS": "7"}])
def test_hierarchical_auto_a_rate_the_user_gives_wins_and_nothing_is_measured(monkeypatch, given):
    from horovod_terngrad.exchange import link
    monkeypatch.delenv("HOROVOD_TERNGRAD_INTRA_GBPS", raising=False)
    for k, v in given.items():
        monkeypatch.setenv(k, v)

    def refused(*a, **k):
        raise AssertionError("measured although HOROVOD_TERNGRAD_GBPS was given")
    monkeypatch.setattr(link, "measure_links", refused)
    res = _priced_links_2x2()
    intra = float(given.get("HOROVOD_TERNGRAD_INTRA_GBPS", "100"))
    assert set(res) == {("configured", 25e9 / 8, intra * 1e9 / 8)}


def test_hierarchical_auto_a_rate_given_inside_a_node_is_kept_and_the_link_across_measured(monkeypatch):
    from horovod_terngrad.exchange import link
    monkeypatch.delenv("HOROVOD_TERNGRAD_GBPS", raising=False)
    monkeypatch.delenv("HOROVOD_TERNGRAD_MEASURE_LINKS", raising=False)
    monkeypatch.setenv("HOROVOD_TERNGRAD_INTRA_GBPS", "7")
    monkeypatch.setattr(link, "probe", lambda coll, device, name: (0.01, 0.01 + link.sent_bytes(
        coll, link.LARGE_NUMEL - link.SMALL_NUMEL) / (1.2e9 / 8)))     # 1.2 Gbit/s on every ring
    res = _priced_links_2x2()
    assert set(res) == {("measured", 1e9 / 8, 7e9 / 8)}          # 1.2 measured, priced as 1; 7 as given


def test_the_plan_line_says_once_on_rank_0_what_travels_inside_a_node(caplog):
    """Rank 0's one plan line of a node-aware engine names the topology, which groups go node-aware, what the
    exchange sends inside a node (the default bf16, or float32) and what carries it, once per line; other ranks say
    nothing.  Where the node-aware exchange cannot run, the flat plan's line says why and names the exchange the
    defaults pick among its ranks (the requantized one above 4), at INFO where that is quiet."""
    import logging

    from horovod_terngrad.exchange import cost, engine as engine_mod, policy
    topo = TOPOS["2x2"]
    for dtype in ("bfloat16", "float32"):
        cfg = TernGradConfig(intra_node_dtype=dtype, hierarchical=True)
        plan = policy.node_exchange_plan(policy.exchange_plan(cfg, 4), 2, 2, topo.describe(),
                                         cost.configured_network(2), over=f"test transport {dtype}")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="horovod_terngrad"):
            for rank in (0, 1, 0):
                engine_mod.say_plan(plan, rank)
        said = [r.getMessage() for r in caplog.records if "TernGrad plan" in r.getMessage()]
        assert said == [f"TernGrad plan on {topo.describe()} (hierarchical=True): node-aware for every group; "
                        f"node-aware: {dtype} inside a node, test transport {dtype}, across nodes the allgather "
                        f"exchange among 2 ranks (exchange='default')"], said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="horovod_terngrad"):
        engine_mod.say_plan(policy.exchange_plan(TernGradConfig(), 8, off=("all 8 ranks are on one node", True)), 0)
    said = [r for r in caplog.records if "node-aware exchange off" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert said[0].getMessage().endswith("(flat), the requantized exchange among 8 ranks (exchange='default')")


def test_the_simulator_with_nodes_and_the_defaults_does_not_measure_links(monkeypatch):
    """hierarchical="auto" (the default) with no configured rate measures the links in the frontends; the
    simulator plays every rank from one thread, where a probe would wait for ranks that cannot post: it prices the
    configured links instead, and a step completes."""
    from horovod_terngrad.modelling.simulate import Simulator
    monkeypatch.delenv("HOROVOD_TERNGRAD_GBPS", raising=False)
    monkeypatch.delenv("HOROVOD_TERNGRAD_MEASURE_LINKS", raising=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    sim = Simulator(model, 4, TernGradConfig(min_numel=0), ranks_per_node=2)
    done = []

    def step():
        sim.step(torch.randn(8, 64), torch.randint(0, 4, (8,)), torch.nn.functional.cross_entropy,
                 torch.optim.SGD(model.parameters(), lr=0.1))
        done.append(True)

    t = threading.Thread(target=step, daemon=True)
    t.start()
    t.join(60)
    assert done == [True]
    assert isinstance(sim.engines[0], HierarchicalEngine) and not sim.engines[0].measures_links()


def test_intra_node_dtype_is_checked_halves_the_bytes_inside_a_node_and_the_cost_model_knows():
    from horovod_terngrad.exchange.topology import intra_node_bytes
    with pytest.raises(ValueError, match="intra_node_dtype must be one of"):
        TernGradConfig(intra_node_dtype="float8")
    assert TernGradConfig(intra_node_dtype="bfloat16").intra_node_width == 2 == TernGradConfig(intra_node_dtype="float32").intra_node_width // 2
    assert TernGradConfig().intra_node_dtype == "bfloat16"        # the default
    c4, p4 = intra_node_bytes([1000, 37, 5], 2)
    c2, p2 = intra_node_bytes([1000, 37, 5], 2, 2)
    assert (c2 * 2, p2 * 2) == (c4, p4)
    topo = TOPOS["2x2"]
    sent = {}
    for dtype in ("float32", "bfloat16"):
        cfg = TernGradConfig(hierarchical=True, intra_node_dtype=dtype)

        def body(c, local, cross):
            ex = engine(cfg, c, local, cross, topo)
            ex.finish(ex.start(grad((1000,), c.rank), "w"))
            return ex.stats.intra_node_bytes_sent, ex.stats.intra_node_bytes_received
        res, errs = run_hier(topo, body)
        assert errs == [None] * topo.size, errs
        sent[dtype] = res
    assert all(b * 2 == f for fs, bs in zip(sent["float32"], sent["bfloat16"]) for f, b in zip(fs, bs))
    assert all(f > 0 for fs in sent["float32"] for f in fs)


@pytest.mark.slow
@pytest.mark.one_process
def test_the_bf16_wire_benchmark_gives_the_same_bits_both_ways():
    """scripts/bench_bf16_wire.py (the figures docs/scale.md quotes for the node-aware exchange's CPU work) checks
    that the way it was done and the way it is done give the same bits, and prints a row per step."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_bf16_wire.py"), "--numel", "10001"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [line for line in p.stdout.splitlines() if line.startswith("| ") and not line.startswith("| step")]
    assert len(rows) == 4 and all(float(c) >= 0 for r in rows for c in r.strip("| ").split(" | ")[1:]), p.stdout
