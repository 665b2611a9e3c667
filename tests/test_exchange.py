"""Layer 3: the allgather exchange on N thread-ranks (no Horovod needed)."""
import pytest
import torch

from helpers import expected_average
from horovod_terngrad import NonFiniteGradientError, RankMismatchError, TernGradConfig
from horovod_terngrad.exchange import Engine, ThreadWorld, run_ranks
from horovod_terngrad.exchange import ThreadCollectives


def grad(shape, rank, tensor=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 * tensor + rank)
    return (torch.randn(shape, generator=gen) * (rank + 1)).to(dtype)


SHAPES = [(20, 50), (50,), (7, 3, 3), (1,), (1000,)]


@pytest.mark.parametrize("N", [2, 3, 4])
@pytest.mark.parametrize("cfg", [
    TernGradConfig(exchange="allgather"),
    TernGradConfig(exchange="allgather", packing="base3", seed=5),
    TernGradConfig(exchange="allgather", shared_scaler=False),
    TernGradConfig(exchange="allgather", bucket_size=64, packing="base3"),
    TernGradConfig(exchange="allgather", clip_factor=0.0),
    TernGradConfig(exchange="sharded"),
    TernGradConfig(exchange="sharded", packing="base3", bucket_size=50),
], ids=["default", "base3", "per-rank-scaler", "buckets", "noclip", "sharded", "sharded-base3-buckets"])
def test_every_rank_gets_the_recomputed_average_bit_for_bit(N, cfg):
    steps = 2

    def body(c):
        ex = Engine(c, cfg)
        outs = []
        for step in range(steps):
            tickets = [ex.start(grad(s, c.rank, i + 10 * step), f"layer{i}") for i, s in enumerate(SHAPES)]
            outs.append([ex.finish(t) for t in reversed(tickets)][::-1])   # finish order is free
        return outs

    res = run_ranks(N, body)
    for step in range(steps):
        for i, s in enumerate(SHAPES):
            want, _ = expected_average([grad(s, r, i + 10 * step) for r in range(N)], f"layer{i}", step, cfg)
            for r in range(N):
                assert torch.equal(res[r][step][i], want), (step, i, r)


def test_sum_instead_of_average():
    cfg = TernGradConfig(exchange="allgather")

    def body(c):
        return Engine(c, cfg).allreduce(grad((100,), c.rank), "w", average=False)

    res = run_ranks(3, body)
    want, _ = expected_average([grad((100,), r) for r in range(3)], "w", 0, cfg, average=False)
    assert all(torch.equal(x, want) for x in res)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_low_and_high_precision_grads_keep_their_dtype(dtype):
    cfg = TernGradConfig(exchange="allgather")

    def body(c):
        return Engine(c, cfg).allreduce(grad((300,), c.rank, dtype=dtype), "w")

    res = run_ranks(2, body)
    want, _ = expected_average([grad((300,), r, dtype=dtype) for r in range(2)], "w", 0, cfg)
    assert res[0].dtype == dtype and torch.equal(res[0], want) and torch.equal(res[1], want)


def test_non_contiguous_gradient():
    cfg = TernGradConfig(exchange="allgather")
    base = [grad((30, 40), r) for r in range(2)]

    def body(c):
        g = base[c.rank].t()
        assert not g.is_contiguous()
        return Engine(c, cfg).allreduce(g, "w")

    res = run_ranks(2, body)
    want, _ = expected_average([b.t().contiguous() for b in base], "w", 0, cfg)
    assert res[0].shape == (40, 30) and torch.equal(res[0], want)


@pytest.mark.parametrize("shared", [True, False])
def test_zero_and_empty_tensors(shared):
    cfg = TernGradConfig(exchange="allgather", shared_scaler=shared)

    def body(c):
        ex = Engine(c, cfg)
        return ex.allreduce(torch.zeros(5, 5), "zero"), ex.allreduce(torch.zeros(0, 3), "empty")

    for zero, empty in run_ranks(2, body):
        assert torch.equal(zero, torch.zeros(5, 5))
        assert empty.shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_gradient_is_a_clear_error(dtype):
    ex = Engine(ThreadWorld(1).ranks()[0], TernGradConfig(exchange="allgather"))
    with pytest.raises(TypeError, match=r"'counts' has dtype .*floating-point"):
        ex.start(torch.ones(4, dtype=dtype), "counts")


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_on_one_rank_raises_on_every_rank(shared, bad):
    cfg = TernGradConfig(exchange="allgather", shared_scaler=shared, on_nonfinite="raise")

    def body(c):
        ex = Engine(c, cfg)
        g = grad((64,), c.rank)
        if c.rank == 2:
            g[5] = bad
        err = None
        try:
            ex.allreduce(g, "fc1.weight")
        except NonFiniteGradientError as e:
            err = str(e)
        # the exchange is usable afterwards: nothing was left waiting
        after = ex.allreduce(grad((8,), c.rank), "fc2.weight")
        return err, after

    res = run_ranks(3, body, timeout=30)
    for err, after in res:
        assert err is not None and "'fc1.weight'" in err and "rank" in err and "2" in err
        assert torch.equal(after, res[0][1])


@pytest.mark.parametrize("exchange,shared", [("allgather", False), ("allgather", True), ("sharded", True)],
                         ids=["per-rank", "shared", "sharded"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_propagates_by_default_the_same_nan_on_every_rank(exchange, shared, bad):
    """The default (on_nonfinite="propagate"): a NaN/Inf on one rank makes that tensor's average NaN on every
    rank, byte for byte (what GradScaler needs to skip the step everywhere); the fused neighbours and the
    next step are untouched; counted in the stats; the step counters advance as in any step."""
    cfg = TernGradConfig(exchange=exchange, shared_scaler=shared)
    assert cfg.on_nonfinite == "propagate"

    def body(c):
        ex = Engine(c, cfg)
        items = [(grad((64,), c.rank, i), f"w{i}") for i in range(3)]
        if c.rank == 2:
            items[1][0][5] = bad
        outs = [ex.finish(tk) for tk in ex.start_group(items, "g")]
        after = ex.allreduce(grad((8,), c.rank), "fc2.weight")
        return outs, after, ex.stats.nonfinite_propagated, dict(ex.steps)

    res = run_ranks(3, body, timeout=30)
    for outs, after, count, steps in res:
        assert torch.isnan(outs[1]).all() and outs[1].shape == (64,)
        assert torch.isfinite(outs[0]).all() and torch.isfinite(outs[2]).all()
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(outs, res[0][0]))
        assert torch.equal(after, res[0][1]) and count == 1
        assert steps == {"w0": 1, "w1": 1, "w2": 1, "fc2.weight": 1}
    want, _ = expected_average([grad((64,), r, 0) for r in range(3)], "w0", 0, cfg)
    assert torch.equal(res[0][0][0], want)


def test_nonfinite_zero_policy_is_agreed():
    cfg = TernGradConfig(exchange="allgather", on_nonfinite="zero")

    def body(c):
        ex = Engine(c, cfg)
        g = grad((64,), c.rank)
        if c.rank == 0:
            g[0] = float("nan")
        return ex.allreduce(g, "w"), ex.stats.nonfinite_zeroed

    for out, zeroed in run_ranks(2, body):
        assert torch.equal(out, torch.zeros(64)) and zeroed == 1


@pytest.mark.parametrize("cfg", [TernGradConfig(exchange="allgather"), TernGradConfig(exchange="allgather", shared_scaler=False),
                                 TernGradConfig(exchange="allgather", bucket_size=4)], ids=["shared", "per-rank", "buckets"])
@pytest.mark.parametrize("shapes", [[(10,), (11,)], [(2, 5), (5, 2)]], ids=["numel", "shape"])
def test_ranks_with_mismatched_shapes_get_a_clear_error_not_a_hang(cfg, shapes):
    def body(c):
        ex = Engine(c, cfg)
        try:
            ex.allreduce(torch.randn(shapes[c.rank]), "conv.weight")
        except RankMismatchError as e:
            return str(e)
        return None

    for msg in run_ranks(2, body, timeout=30):
        assert msg is not None and "'conv.weight'" in msg and "disagree" in msg


class CountingCollectives(ThreadCollectives):
    """Counts synchronize() calls that would have had to wait."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.blocking = 0

    def synchronize(self, handle):
        if not handle.done.is_set():
            self.blocking += 1
        return super().synchronize(handle)


@pytest.mark.parametrize("ordered", [False, True])
def test_start_waits_only_for_groups_before_the_previous_one(ordered):
    """Rank 1 starts tensors before rank 0 starts any.  Polling (ordered=False): all 60 starts return
    without waiting and the 60 handshakes are in flight.  Ordered (the default): the first two starts
    return without waiting (a start advances only groups before the previous one), the third waits for
    the first's handshake, which rank 0 then completes."""
    import threading
    world = ThreadWorld(2)
    cs = [CountingCollectives(world, r) for r in range(2)]
    cfg = TernGradConfig(exchange="allgather", shared_scaler=True)
    names = [f"t{i}" for i in range(60)]
    free = 60 if not ordered else 2
    ready = threading.Event()
    out = [None, None]

    def rank1():
        ex = Engine(cs[1], cfg, ordered=ordered)
        tks = [ex.start(grad((32,), 1, i), n) for i, n in enumerate(names[:free])]
        out[1] = (cs[1].blocking, ex.pending()[0])
        ready.set()
        tks += [ex.start(grad((32,), 1, i), n) for i, n in enumerate(names) if i >= free]
        [ex.finish(t) for t in tks]

    th = threading.Thread(target=rank1)
    th.start()
    assert ready.wait(30)
    ex0 = Engine(cs[0], cfg, ordered=ordered)
    [ex0.finish(t) for t in [ex0.start(grad((32,), 0, i), n) for i, n in enumerate(names)]]
    th.join(30)
    assert not th.is_alive()
    assert out[1] == (0, free)


def test_wire_size_per_element_on_a_1M_parameter_model():
    model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10))
    params = [(n, p.numel()) for n, p in model.named_parameters()]
    total = sum(n for _, n in params)
    assert total >= 1_000_000
    for fmt, limit in [("2bit", 2.05), ("base3", 1.65)]:
        world = ThreadWorld(2)
        cfg = TernGradConfig(exchange="allgather", packing=fmt)

        def body(c):
            ex = Engine(c, cfg)
            tks = [ex.start(grad((n,), c.rank, i), name) for i, (name, n) in enumerate(params)]
            [ex.finish(t) for t in tks]
            return ex.stats

        import threading
        res = [None, None]
        ths = [threading.Thread(target=lambda c=c: res.__setitem__(c.rank, body(c))) for c in world.ranks()]
        [t.start() for t in ths]
        [t.join(60) for t in ths]
        for r in range(2):
            bits = 8 * world.bytes_in[r] / total    # every byte handed to a collective, headers included
            assert bits <= limit, (fmt, bits)
            assert res[r].bits_per_element() == pytest.approx(bits)


@pytest.mark.parametrize("fmt,limit", [("2bit", 10.0), ("base3", 10.0)])
def test_sharded_exchange_at_64_ranks_receives_at_most_10_bits_per_element(fmt, limit):
    from horovod_terngrad.exchange import sharded
    n, N = 100_003, 64
    cfg = TernGradConfig(exchange="sharded", packing=fmt)

    def body(c):
        ex = Engine(c, cfg)
        out = ex.allreduce(grad((n,), c.rank), "big")
        return out, ex.stats.bytes_received, ex.stats.payload_bytes_sent

    res = run_ranks(N, body, timeout=300)
    worst = max(8 * r[1] / n for r in res)
    assert worst <= limit, worst
    assert worst == pytest.approx(sharded.received_bits_per_element(n, N, fmt), rel=1e-9)
    assert max(8 * r[2] / n for r in res) < 2.2       # sends its codes once plus its shard's sums
    want, _ = expected_average([grad((n,), r) for r in range(N)], "big", 0, cfg)
    assert all(torch.equal(r[0], want) for r in res)   # = the allgather exchange's bits


def test_auto_exchange_picks_by_cost():
    from horovod_terngrad.exchange.cost import Network
    from horovod_terngrad.exchange.policy import auto_transport
    net = Network.from_gbps("1GbE", 1.0, 50.0)       # what exchange="auto" assumes by default
    assert auto_transport([10_000_000], 2, "2bit", network=net) == "allgather"
    # bandwidth-bound at 64 ranks: the requantized exchange ("default"'s above 4 ranks: 2 + 4.25 + 1.25 bits per
    # element against the allgather's 126)
    assert auto_transport([10_000_000], 64, "2bit", network=net) == "requantized"
    assert auto_transport([100], 64, "2bit", network=net) == "allgather"       # latency-bound: one collective wins
    assert auto_transport([100_000], 4, "2bit", network=net) == "allgather"    # at 4 ranks the allgather's 6 bits win
    from horovod_terngrad.exchange.cost import TERNGRAD_REQUANTIZED, cheapest_method
    bucketed = cheapest_method([10_000_000], 64, net, candidates=(TERNGRAD_REQUANTIZED,), bucket_size=128)
    plain = cheapest_method([10_000_000], 64, net, candidates=(TERNGRAD_REQUANTIZED,))
    assert bucketed.cost.bits_per_element > plain.cost.bits_per_element    # the configured buckets' scalers counted
    with pytest.raises(ValueError, match="needs shared_scaler"):
        TernGradConfig(exchange="sharded", shared_scaler=False)


def test_sharded_reference_path_gives_the_fused_bytes(monkeypatch):
    """The torch fallback of the sharded exchange (no fused C backend) gives the same bits."""
    cfg = TernGradConfig(exchange="sharded", packing="base3", bucket_size=30)

    def body(c):
        return Engine(c, cfg).allreduce(grad((1001,), c.rank), "w")

    fused = run_ranks(3, body)
    monkeypatch.setenv("HOROVOD_TERNGRAD_BACKEND", "torch")
    reference = run_ranks(3, body)
    want, _ = expected_average([grad((1001,), r) for r in range(3)], "w", 0, cfg)
    assert all(torch.equal(x, want) for x in fused + reference)


# -- tensor fusion ----------------------------------------------------------------------------------

FUSED = [(20, 50), (50,), (0,), (7, 3, 3), (1,), (1000,)]


class KindCounting:
    """Collectives that count the collectives this rank launches, by kind ("max", "gather", "a2a", "sum"), and
    record their names in issue order (``issued``)."""

    def __init__(self, inner):
        self.inner, self.rank, self.size, self.kinds, self.issued = inner, inner.rank, inner.size, {}, []

    def _count(self, kind, name):
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.issued.append(name)

    def allreduce_max_async(self, tensor, name):
        self._count("max", name)
        return self.inner.allreduce_max_async(tensor, name)

    def allgather_async(self, tensor, name):
        self._count("gather", name)
        return self.inner.allgather_async(tensor, name)

    def alltoall_async(self, tensor, splits, name):
        self._count("a2a", name)
        return self.inner.alltoall_async(tensor, splits, name)

    def allreduce_sum_async(self, tensor, name):
        self._count("sum", name)
        return self.inner.allreduce_sum_async(tensor, name)

    def poll(self, handle):
        return self.inner.poll(handle)

    def synchronize(self, handle):
        return self.inner.synchronize(handle)


@pytest.mark.parametrize("cfg", [TernGradConfig(exchange="allgather"), TernGradConfig(exchange="allgather", shared_scaler=False),
                                 TernGradConfig(exchange="allgather", packing="base3", bucket_size=64, seed=9),
                                 TernGradConfig(exchange="sharded", seed=2),
                                 TernGradConfig(exchange="sharded", packing="base3", bucket_size=64)],
                         ids=["shared", "per-rank", "base3-buckets", "sharded", "sharded-base3-buckets"])
@pytest.mark.parametrize("backend", ["fused-c", "torch"])
@pytest.mark.parametrize("N", [3, 5])
def test_fused_group_gives_each_tensor_its_unfused_average_bit_for_bit_in_two_collectives(cfg, backend, N,
                                                                                         monkeypatch):
    """(backend "torch": the reference path, whose statistics stay device tensors as on CUDA, so the
    handshake is built without host synchronization.)  A sharded group moves every member's chunks in
    one alltoall and every owner's sums in one allgather: 3 collectives per step."""
    if backend == "torch":
        monkeypatch.setenv("HOROVOD_TERNGRAD_BACKEND", "torch")
    steps = 2

    def body(c):
        counted = KindCounting(c)
        ex = Engine(counted, cfg)
        outs = []
        for step in range(steps):
            items = [(grad(s, c.rank, i + 10 * step), f"layer{i}") for i, s in enumerate(FUSED)]
            tickets = ex.start_group(items, "group0")
            outs.append([ex.finish(t) for t in reversed(tickets)][::-1])
        return outs, counted.kinds

    res = run_ranks(N, body)
    for step in range(steps):
        for i, s in enumerate(FUSED):
            want, _ = expected_average([grad(s, r, i + 10 * step) for r in range(N)], f"layer{i}", step, cfg)
            for r in range(N):
                assert torch.equal(res[r][0][step][i], want), (step, i, r)
    # one handshake (shared scaler only) and one allgather (+ one alltoall if sharded) per step, six tensors
    # shared: a handshake per group; per-rank: a presence check per step (a finish ends the step)
    want = {"max": steps, "gather": steps} if cfg.shares_scaler else {"sum": steps, "gather": steps}
    if cfg.exchange == "sharded":
        want["a2a"] = steps
    assert res[0][1] == want


@pytest.mark.parametrize("exchange", ["allgather", "sharded"])
def test_a_finished_group_lets_go_of_its_gradients_without_the_cycle_collector(exchange):
    """Tickets and their group point at each other; once every member is finished the group drops its
    members and received bytes, so an in-place gradient is freed as soon as its owner drops it, with the
    cycle collector off (before, every step's gradients outlived it until a collection: ~30,000 page faults
    per step on ResNet-50)."""
    import gc
    import weakref
    cfg = TernGradConfig(exchange=exchange, seed=4)

    def body(c):
        ex = Engine(c, cfg)
        grads = [grad(s, c.rank, i) for i, s in enumerate(FUSED)]
        alive = [weakref.ref(g) for g in grads]
        tickets = ex.start_group([(g, f"layer{i}") for i, g in enumerate(grads)], "group0", in_place=True)
        grp = tickets[0].group
        outs = [ex.finish(t) for t in tickets]
        in_place = all(o.data_ptr() == g.data_ptr() for o, g in zip(outs, grads))
        del grads, outs, tickets
        return in_place, grp.members, grp.sent, grp.gathered, [a() is None for a in alive]

    was = gc.isenabled()
    gc.disable()
    try:
        res = run_ranks(3, body)
    finally:
        if was:
            gc.enable()
    for in_place, members, sent, gathered, freed in res:
        assert in_place and members == [] and sent == [] and gathered is None
        assert all(freed)


@pytest.mark.parametrize("policy", ["propagate", "raise", "zero"])
@pytest.mark.parametrize("backend", ["fused-c", "torch"])
def test_fused_member_with_nan_fails_alone(policy, backend, monkeypatch):
    if backend == "torch":
        monkeypatch.setenv("HOROVOD_TERNGRAD_BACKEND", "torch")
    cfg = TernGradConfig(exchange="allgather", on_nonfinite=policy, shared_scaler=True)

    def body(c):
        ex = Engine(c, cfg)
        items = [(grad((30,), c.rank, i), f"w{i}") for i in range(3)]
        if c.rank == 1:
            items[1][0][4] = float("nan")
        out = []
        for tk in ex.start_group(items, "g"):
            try:
                out.append(ex.finish(tk))
            except NonFiniteGradientError as e:
                out.append(str(e))
        return out

    res = run_ranks(2, body, timeout=30)
    for i in (0, 2):
        want, _ = expected_average([grad((30,), r, i) for r in range(2)], f"w{i}", 0, cfg)
        assert all(torch.equal(r[i], want) for r in res)
    for r in res:
        if policy == "raise":
            assert isinstance(r[1], str) and "'w1'" in r[1] and "rank 1" in r[1]
        elif policy == "propagate":
            assert torch.isnan(r[1]).all()
        else:
            assert torch.equal(r[1], torch.zeros(30))


def test_fused_groups_that_differ_between_ranks_raise_a_clear_error_on_every_rank():
    def body(c):
        ex = Engine(c, TernGradConfig(exchange="allgather", shared_scaler=True))
        members = [(torch.randn(10), "a"), (torch.randn(12 if c.rank else 10), "b")]
        if c.rank == 1:
            members.append((torch.randn(5), "c"))      # a member the other rank does not have
        msgs = []
        for tk in ex.start_group(members, "g"):
            try:
                ex.finish(tk)
                msgs.append(None)
            except RankMismatchError as e:
                msgs.append(str(e))
        return msgs

    for msgs in run_ranks(2, body, timeout=30):
        assert all(m is not None and "disagree" in m and "fused in group 'g'" in m for m in msgs), msgs


def test_fused_handshake_is_compact_and_catches_layout_disagreement():
    """A fused group's handshake costs 32 + 16 per member + 8 per scaler bytes (72 per tensor alone);
    members of equal count whose sizes differ between ranks are caught by the layout checksum."""
    def body(c):
        ex = Engine(c, TernGradConfig(exchange="allgather", shared_scaler=True))
        tks = ex.start_group([(grad((7,), c.rank, i), f"t{i}") for i in range(5)], "g")
        for tk in tks:
            ex.finish(tk)
        hs = ex.stats.handshake_bytes_sent
        bad = [(torch.randn(10), "a"), (torch.randn(12 if c.rank else 13), "b")]
        msgs = []
        for tk in ex.start_group(bad, "g2"):
            try:
                ex.finish(tk)
                msgs.append(None)
            except RankMismatchError as e:
                msgs.append(str(e))
        return hs, msgs

    for hs, msgs in run_ranks(2, body, timeout=30):
        assert hs == 32 + 16 * 5 + 8 * 5
        assert all(m and "disagree" in m and "group 'g2'" in m for m in msgs), msgs


@pytest.mark.parametrize("cfg", [TernGradConfig(exchange="allgather", shared_scaler=True), TernGradConfig(exchange="allgather", bucket_size=7, packing="base3"),
                                 TernGradConfig(exchange="sharded"), TernGradConfig(exchange="allgather", shared_scaler=False),
                                 TernGradConfig(exchange="allgather", shared_scaler=False, bucket_size=7, packing="base3")],
                         ids=["shared", "base3-buckets", "sharded", "per-rank", "per-rank-base3-buckets"])
@pytest.mark.parametrize("world", [2, 3, 5])
def test_joined_ranks_count_as_zeros_and_results_are_exact(cfg, world):
    """hvd.join() semantics on thread-ranks: the last rank joins at once; the others average lone and fused
    tensors for two steps (allgather and alltoall are refused while a rank has joined, so the exchange
    goes by allreduce-sum); the joined rank counts as a zero gradient, and every active rank gets exactly
    the reference average over all N ranks.  With per-rank scalers the step's presence check (the joined
    rank adds 0) sends the groups by the shared-scaler handshake over the active ranks and the join
    transport instead of an allgather (which Horovod would refuse): the reference is the shared-scaler one."""
    shapes = [(33,), (4, 5), (1,), (0,)]

    def body(c):
        if c.rank == world - 1:
            return c.join(), None
        ex = Engine(c, cfg)
        outs = []
        for step in range(2):
            outs.append(ex.allreduce(grad((57,), c.rank, 9 + step), "lone"))
            tks = ex.start_group([(grad(s, c.rank, i + 3 * step), f"m{i}") for i, s in enumerate(shapes)], "g")
            outs += [ex.finish(tk) for tk in tks]
        return c.join(), (outs, ex.stats.collectives)

    results = run_ranks(world, body, timeout=60)
    assert len({last for last, _ in results}) == 1            # join returns the same rank everywhere
    active = list(range(world - 1))
    k = 0
    for step in range(2):
        items = [((57,), "lone", 9 + step)] + [(s, f"m{i}", i + 3 * step) for i, s in enumerate(shapes)]
        for shape, name, seed in items:
            want, _ = expected_average([grad(shape, r, seed) for r in active], name, step,
                                       cfg.replace(shared_scaler=True), ranks=active, world=world)
            for r in active:
                assert torch.equal(results[r][1][0][k], want), (name, step, r)
            k += 1
    # a handshake and one allreduce-sum per group and step (per-rank: and a presence check before each group,
    # as a finish comes between them)
    assert results[0][1][1] == 2 * 2 * 2 + (0 if cfg.shares_scaler else 2 * 2)


@pytest.mark.parametrize("cfg", [TernGradConfig(), TernGradConfig(exchange="sharded")], ids=["per-rank", "sharded"])
def test_nan_while_a_rank_is_joined_propagates_to_every_active_rank(cfg):
    """A step with a rank in hvd.join() goes by the join transport; a NaN on one active rank still makes that
    tensor's average NaN on every active rank (the default policy), and its fused neighbours stay exact."""
    def body(c):
        if c.rank == 2:
            return c.join(), None
        ex = Engine(c, cfg)
        items = [(grad((33,), c.rank, i), f"m{i}") for i in range(2)]
        if c.rank == 1:
            items[0][0][3] = float("inf")
        outs = [ex.finish(tk) for tk in ex.start_group(items, "g")]
        return c.join(), outs

    results = run_ranks(3, body, timeout=60)
    want, _ = expected_average([grad((33,), r, 1) for r in (0, 1)], "m1", 0, cfg.replace(shared_scaler=True),
                               ranks=[0, 1], world=3)
    for r in (0, 1):
        assert torch.isnan(results[r][1][0]).all() and torch.equal(results[r][1][1], want)


# -- the order of collectives --------------------------------------------------------------------------

def issue_orders(cfg, ordered):
    """Each rank's collectives, in issue order, when rank 1 is slower between its starts than rank 0."""
    import time

    def body(c):
        rec = KindCounting(c)
        ex = Engine(rec, cfg, ordered=ordered)
        tickets = []
        for i in range(5):
            if c.rank == 1:
                time.sleep(0.05)
            tickets.append(ex.start(grad((64,), c.rank, i), f"t{i}"))
        [ex.finish(t) for t in tickets]
        return rec.issued
    return run_ranks(2, body)


@pytest.mark.parametrize("cfg", [TernGradConfig(exchange="allgather", shared_scaler=True), TernGradConfig(exchange="sharded")],
                         ids=["allgather", "sharded"])
def test_ranks_issue_the_same_collectives_in_the_same_order_whatever_their_timing(cfg):
    """Horovod names unnamed ops after a rank-local handle counter, so a user's unnamed hvd.allreduce issued
    while TernGrad's groups are in flight gets the same name on every rank only if every rank issued the
    same number of ops before it.  Polling (ordered=False, the simulator's mode) issues payloads when a
    handshake happens to be back: the control shows the orders then differ with one slow rank."""
    orders = issue_orders(cfg, ordered=True)
    assert orders[0] == orders[1]
    assert len(orders[0]) == (10 if cfg.exchange == "allgather" else 15)
    control = issue_orders(cfg, ordered=False)
    assert control[0] != control[1]


# -- exchange="auto": the measured link ----------------------------------------------------------------

def test_link_decision_ternarizes_on_slow_links_and_not_where_the_codec_costs_more_than_it_saves():
    from horovod_terngrad.exchange.link import LinkDecision
    gbe = LinkDecision(2, 125e6, 2e-9, "2bit")             # 1 Gbit/s, a CPU core's codec
    assert gbe.compresses and gbe.fp32_s_per_element == pytest.approx(32e-9)
    assert gbe.terngrad_s_per_element == pytest.approx(2e-9 + 0.25 / 125e6, rel=1e-3)
    ib = LinkDecision(2, 12.5e9, 2e-9, "2bit")             # 100 Gbit/s: 0.32 ns/element at full precision
    assert not ib.compresses and "compression OFF" in ib.describe() and "100.00 Gbit/s" in ib.describe()
    assert LinkDecision(1, float("inf"), 0.0, "2bit").compresses       # one rank: computes what N ranks do
    # the allgather's received bytes grow with N: at 64 ranks even 1 Gbit/s is close
    assert LinkDecision(64, 125e6, 2e-9, "2bit").terngrad_s_per_element > 30 * gbe.terngrad_s_per_element


@pytest.mark.parametrize("world", [2, 3])
def test_auto_measures_the_link_once_and_every_rank_agrees(world):
    def body(c):
        ex = Engine(c, TernGradConfig(exchange="auto"))
        first = ex.plan_exchange(torch.device("cpu")).compresses
        link = ex.link
        assert ex.plan_exchange(torch.device("cpu")) is ex.plan        # made: no more collectives
        assert ex.link is link
        return first, (link.ranks, link.allreduce_Bps, link.codec_s_per_element)

    results = run_ranks(world, body, timeout=60)
    assert len(set(results)) == 1 and results[0][1][0] == world and results[0][1][1] > 0
    # not "auto": nothing is measured
    assert run_ranks(2, lambda c: (Engine(c, TernGradConfig(exchange="allgather")).plan_exchange(torch.device("cpu")).link,)) == [(None,)] * 2


def test_auto_prices_the_rate_the_user_gives_and_runs_no_probe(monkeypatch):
    """HOROVOD_TERNGRAD_GBPS wins over the measurement: exchange="auto" times only the codec and prices the given
    rate (a 400 Gbit/s fabric stays 400, whatever a probe on these cores would read)."""
    from horovod_terngrad.exchange import link as link_mod
    monkeypatch.setenv("HOROVOD_TERNGRAD_GBPS", "400")
    monkeypatch.setattr(link_mod, "probe", lambda *a, **k: pytest.fail("probed although the user gave the rate"))

    def body(c):
        ex = Engine(c, TernGradConfig(exchange="auto"))
        ex.plan_exchange(torch.device("cpu"))
        return ex.link.allreduce_Bps, ex.link.measured_Bps, "HOROVOD_TERNGRAD_GBPS" in ex.link.describe()

    assert run_ranks(2, body, timeout=60) == [(400e9 / 8, 0.0, True)] * 2


def test_auto_leaves_the_decision_open_while_a_rank_is_in_join():
    """A rank in hvd.join() adds 0 to the count: the plan step leaves the plan unsettled, the others keep
    ternarizing, and their next plan step asks again, so the joined rank, back in the next epoch, takes part in the
    measurement with them."""
    def body(c):
        if c.rank == 2:
            return c.join(), None
        ex = Engine(c, TernGradConfig(exchange="auto"))
        plan = ex.plan_exchange(torch.device("cpu"))
        return c.join(), (plan.compresses, ex.link, plan.settled, ex.planned)

    results = run_ranks(3, body, timeout=60)
    assert [r[1] for r in results[:2]] == [(True, None, False, False)] * 2


@pytest.mark.parametrize("device_path", [False, True], ids=["host-path", "device-path"])
@pytest.mark.parametrize("policy", ["propagate", "zero"])
@pytest.mark.parametrize("bucket_size", [0, 16])
def test_known_layout_decodes_the_bits_the_header_walk_decodes(policy, bucket_size, device_path, monkeypatch):
    """``Engine.layout_known`` (the FSDP and DDP frontends' engines): the allgather is decoded at offsets computed
    from this rank's own payload sizes, NaN/Inf flags combined with tensor ops (no host read on a GPU: the device
    path, run here on CPU tensors, which leaves the NaN count to the host).  The same bits as the header walk,
    fused members and lone tensors; a flagged member NaN (or zero) on every rank, its neighbours untouched."""
    from horovod_terngrad.exchange import allgather
    cfg = TernGradConfig(exchange="allgather", on_nonfinite=policy, bucket_size=bucket_size, min_numel=0)

    def body(c, known):
        ex = Engine(c, cfg)
        ex.layout_known = known
        outs = []
        for step in range(2):
            items = [(grad((37 + 20 * i,), c.rank, 10 * step + i), f"w{i}") for i in range(3)]
            if step == 1 and c.rank == 1:
                items[1][0][5] = float("nan")
            outs += [ex.finish(tk) for tk in ex.start_group(items, "g")]
            outs.append(ex.allreduce(grad((50,), c.rank, step), "lone"))
        return outs, ex.stats.nonfinite_propagated + ex.stats.nonfinite_zeroed

    walked = run_ranks(3, body, False, timeout=30)
    monkeypatch.setattr(allgather, "DEVICE_PATH_ON_CPU", device_path)
    known = run_ranks(3, body, True, timeout=30)
    for (w, wcount), (k, kcount) in zip(walked, known):
        assert wcount == 1 and kcount == (0 if device_path else 1)
        for a, b in zip(w, k):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        flagged = k[5]
        assert (torch.isnan(flagged).all() if policy == "propagate" else not flagged.any())
        assert torch.isfinite(k[4]).all() and torch.isfinite(k[6]).all()


def test_known_layout_catches_ranks_that_disagree_on_sizes():
    def body(c):
        ex = Engine(c, TernGradConfig(exchange="allgather", min_numel=0))
        ex.layout_known = True
        try:
            ex.allreduce(grad((40 + 8 * c.rank,), c.rank), "w")
        except RankMismatchError as e:
            return str(e)
        return None

    for msg in run_ranks(2, body, timeout=30):
        assert msg and "'w'" in msg and "disagree" in msg


# -- the measured links: snapped to a grid, agreed from every rank's figures --------------------------------------

def test_link_rates_snap_to_a_grid_that_holds_40_percent_of_noise_around_each_point():
    from horovod_terngrad.exchange.link import snap_gbps
    assert [snap_gbps(g) for g in (0.06, 0.31, 1.15, 2.5, 5, 12, 40, 100, 200, 400)] == \
        [0.1, 0.3, 1, 3, 3, 10, 30, 100, 300, 300]
    for point in (0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000):
        for noise in (0.6, 0.75, 0.9, 1.0, 1.1, 1.25, 1.4):
            assert snap_gbps(point * noise) == point, (point, noise)
    assert snap_gbps(float("inf")) == float("inf") and snap_gbps(0.0) == 0.0


def test_link_rate_from_two_sizes_leaves_out_what_every_collective_costs():
    """A fixed cost per collective (negotiation, latency, waking a thread) in both probes does not lower the rate;
    a large probe no slower than the small one (noise) falls back to the large one alone."""
    from types import SimpleNamespace

    from horovod_terngrad.exchange import link
    world = SimpleNamespace(size=4)
    Bps = 125e6
    overhead = 0.030
    t_small = overhead + link.sent_bytes(world, link.SMALL_NUMEL) / Bps
    t_large = overhead + link.sent_bytes(world, link.LARGE_NUMEL) / Bps
    assert link.rate_Bps(world, t_small, t_large) == pytest.approx(Bps)
    assert link.rate_Bps(world, 0.05, 0.04) == pytest.approx(link.sent_bytes(world, link.LARGE_NUMEL) / 0.04)
    # a node's group carried by world collectives sends its whole tensor to each peer
    group = SimpleNamespace(size=4, spans_world=True)
    assert link.sent_bytes(group, 100) == 3 * 400 and link.sent_bytes(world, 100) == 1.5 * 400


def _noisy_links(across_gbps, inside_gbps, across_noise, inside_noise):
    from horovod_terngrad.exchange.link import MeasuredLinks
    return MeasuredLinks(4, 2, across_gbps * across_noise * 1e9 / 8, inside_gbps * inside_noise * 1e9 / 8)


@pytest.mark.parametrize("across,inside", [(1, 3), (1, 10), (1, 100), (10, 30), (0.3, 3)])
def test_link_noise_of_40_percent_around_a_grid_rate_gives_the_same_plan(across, inside):
    """Every combination of +-40% on the rate across and inside nodes prices the same network, so hierarchical='auto'
    takes the same plan for every group size (2 nodes x 2 ranks, the Horovod frontend's defaults)."""
    from horovod_terngrad.exchange import cost, policy
    configured = cost.configured_network(2)
    cfg = TernGradConfig()
    sizes = [[1 << 12], [1 << 16], [1 << 20], [4_194_304], [1 << 24], [1_000_000, 3_000_000, 200_000]]

    def plan(net):
        return tuple(policy.hierarchy_for(cfg.exchange, s, 2, 2, cfg.packing, cfg.bucket_size, network=net,
                                          step_allreduces=2, intra_width=cfg.intra_node_width) for s in sizes)
    noise = (0.6, 0.8, 1.0, 1.2, 1.4)
    nets = {_noisy_links(across, inside, a, i).network(configured) for a in noise for i in noise}
    assert len(nets) == 1
    net = nets.pop()
    assert net.bandwidth_Bps == across * 1e9 / 8 and net.intra_node.bandwidth_Bps == inside * 1e9 / 8
    assert net.latency_s == configured.latency_s and net.intra_node.latency_s == configured.intra_node.latency_s
    assert len({plan(_noisy_links(across, inside, a, i).network(configured)) for a in noise for i in noise}) == 1
    if (across, inside) == (1, 3):
        # the figures as measured would flip it: the model goes node-aware from about 4.5 Gbit/s inside
        from dataclasses import replace
        raw = replace(net, intra_node=replace(net.intra_node, bandwidth_Bps=1.6 * net.intra_node.bandwidth_Bps))
        assert plan(raw) != plan(net)


def test_link_measurement_is_agreed_from_every_rank_and_a_stalled_rank_cannot_move_it(monkeypatch):
    """Each rank's own probe times differ (noise, one rank 10x slower); one allreduce gives every rank every rank's
    figures, and every rank computes the identical MeasuredLinks (the median over ranks) and network."""
    from horovod_terngrad.exchange import cost, link
    monkeypatch.delenv("HOROVOD_TERNGRAD_INTRA_GBPS", raising=False)
    wire_s = link.sent_bytes(type("W", (), {"size": 4})(), link.LARGE_NUMEL - link.SMALL_NUMEL) / 125e6

    def fake_probe(coll, device, name):
        stall = 10.0 if coll.rank == 3 else 1.0 + 0.05 * coll.rank
        return 0.02, 0.02 + wire_s * stall

    monkeypatch.setattr(link, "probe", fake_probe)

    def body(c):
        got = link.measure_links(c, c, torch.device("cpu"))
        return (got, got.network(cost.configured_network(2)))

    results = run_ranks(4, body, timeout=60)
    assert len(set(results)) == 1
    got, net = results[0]
    assert 0.9 < 8 * got.across_Bps / 1e9 < 1.0 and net.bandwidth_Bps == 125e6     # 1 Gbit/s, not the stalled 0.1
    assert len(got.times) == 4 and got.times[3][1] > 5 * got.times[0][1]


def test_link_plan_summary_says_which_groups_go_node_aware():
    from horovod_terngrad.exchange.link import plan_summary
    assert plan_summary(lambda n: n >= 5000) == "node-aware for groups of 8,192 elements or more, flat below"
    assert plan_summary(lambda n: True) == "node-aware for every group"
    assert plan_summary(lambda n: False, largest=1 << 20) == "flat for every group up to 1,048,576 elements"
    assert plan_summary(lambda n: n in (2, 8), largest=16) == \
        "node-aware for groups of 2, 8 elements (powers of two), flat for the others"
