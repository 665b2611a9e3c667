"""Layer 3: the re-ternarized exchange (exchange/reternarized.py) on thread ranks: bit for bit against the
reference written out from the codec (tests/helpers.expected_reternarized), identical ranks, unbiased, bytes
per element flat in N, NaN/Inf policies, joined ranks, ranks that disagree.  Golden bytes: test_golden.py."""
import pytest
import torch

from helpers import expected_average, expected_reternarized
from horovod_terngrad import NonFiniteGradientError, RankMismatchError, TernGradConfig
from horovod_terngrad.codec import sizes
from horovod_terngrad.exchange import Engine, run_ranks


def grad(shape, rank, tensor=0):
    gen = torch.Generator().manual_seed(1000 * tensor + rank)
    return torch.randn(shape, generator=gen) * (rank + 1)


SHAPES = [(20, 50), (50,), (7, 3, 3), (1,), (1000,), (0,)]
CONFIGS = [TernGradConfig(exchange="reternarized"),
           TernGradConfig(exchange="reternarized", packing="base3", seed=3),
           TernGradConfig(exchange="reternarized", bucket_size=64),
           TernGradConfig(exchange="reternarized", shared_scaler=True),
           TernGradConfig(exchange="reternarized", clip_factor=0.0, packing="base3", bucket_size=30),
           TernGradConfig(exchange="reternarized", levels=4, packing="base3", bucket_size=30)]
IDS = ["default", "base3", "buckets", "shared", "noclip-base3-buckets", "4level-base3-buckets"]


@pytest.mark.parametrize("N", [2, 3, 4, 8])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("fused", [False, True], ids=["alone", "fused"])
def test_every_rank_gets_the_reference_bit_for_bit(N, cfg, fused):
    def body(c):
        ex = Engine(c, cfg)
        outs = []
        for step in range(2):
            items = [(grad(s, c.rank, i + 10 * step), f"layer{i}") for i, s in enumerate(SHAPES)]
            tickets = ex.start_group(items, "g") if fused else [ex.start(g, n) for g, n in items]
            outs.append([ex.finish(t) for t in reversed(tickets)][::-1])
        return outs, ex.stats.collectives

    res = run_ranks(N, body)
    for step in range(2):
        for i, s in enumerate(SHAPES):
            want = expected_reternarized([grad(s, r, i + 10 * step) for r in range(N)], f"layer{i}", step, cfg)
            for r in range(N):
                assert res[r][0][step][i].shape == s
                assert torch.equal(res[r][0][step][i], want), (step, i, r)
    # per group and step: an alltoall and an allgather, and a presence check per step with per-rank scalers or
    # a handshake per group with the shared one (after which the empty tensor alone, agreed empty, sends nothing)
    groups = 1 if fused else len(SHAPES)
    sending = groups - (1 if cfg.shared_scaler and not fused else 0)
    assert res[0][1] == 2 * (sending * 2 + (groups if cfg.shared_scaler else 1))


def test_it_differs_from_the_allgather_exchange_and_stays_unbiased():
    """E[out] = mean_r clip(g_r): the owner's rounding (scaler max|a|, no clip) keeps the average unbiased.
    Over 600 seeds of the reference (bit for bit the exchange, above), the mean of the outputs is within 4.5
    standard errors of the clipped mean on every element; the allgather exchange's output differs."""
    N, n = 4, 200
    grads = [grad((n,), r, 7) for r in range(N)]
    cfg = TernGradConfig(exchange="reternarized")
    outs = torch.stack([expected_reternarized(grads, "w", 0, cfg.replace(seed=s)) for s in range(600)])
    flat = [g.reshape(-1) for g in grads]
    b1 = sizes.reternarized_encode_bucket(n, N, 0)
    from horovod_terngrad import codec as C
    clipped = []
    for g in flat:
        thr = C.clip_threshold(C.tensor_stats(g, b1), cfg.clip_factor)
        thr = thr.repeat_interleave(b1)[:n] if thr.numel() > 1 else thr
        clipped.append(torch.maximum(torch.minimum(g, thr), -thr))
    target = torch.stack(clipped).mean(0)
    se = outs.std(0) / outs.shape[0] ** 0.5
    assert ((outs.mean(0) - target).abs() <= 4.5 * se + 1e-6).all()
    ag, _ = expected_average(grads, "w", 0, TernGradConfig(shared_scaler=False))
    assert not torch.equal(outs[0], ag)


def _bits(cfg, N, n=1_000_000):
    def body(c):
        ex = Engine(c, cfg)
        ex.allreduce(torch.randn(n, generator=torch.Generator().manual_seed(c.rank)), "w")
        return ex.stats.payload_bytes_sent, ex.stats.bytes_received

    res = run_ranks(N, body, timeout=120)
    return max(8 * s / n for s, _ in res), max(8 * r / n for _, r in res)


def test_bits_per_element_stay_flat_from_2_to_8_ranks():
    """Bits per element of a 1M-element tensor, the most any rank moves: received at most 2 x 2 x (N-1)/N
    + headers, handed to collectives (its own shard included) at most 2 + 2/N, so both <= 4.01 at every N from 2
    to 8, where the allgather exchange receives (N-1) x 2 and the sharded one (N-1)/N x (2 + ceil(log2(2N+1)))
    (both measured too)."""
    table = {}
    for N in (2, 3, 4, 6, 8):
        table[N] = {x: _bits(TernGradConfig(exchange=x), N) for x in ("reternarized", "allgather", "sharded")}
    for N, row in table.items():
        sent, received = row["reternarized"]
        assert received <= 2 * 2 * (N - 1) / N + 0.01 and sent <= 2 + 2 / N + 0.01, (N, row)
        assert received == pytest.approx(sizes.reternarized_chunk_bytes(1_000_000, N, "2bit")[0] * 8 * 2 * (N - 1)
                                         / 1_000_000, rel=0.01)
    assert table[8]["allgather"][1] > 13.9 and table[8]["sharded"][1] > 6      # the others grow with N
    assert table[8]["reternarized"][1] - table[2]["reternarized"][1] < 1.51    # 2 x 2 x (7/8 - 1/2)


@pytest.mark.parametrize("exchange", ["reternarized", "requantized"])
@pytest.mark.parametrize("policy", ["propagate", "zero", "raise"])
def test_nonfinite_on_one_rank_is_decided_alike_on_every_rank(policy, exchange):
    """Both shard-owner exchanges (the requantized one with its noise channel asked for): the owner carries the
    sender's flag on, so every rank propagates, zeroes or raises alike, and nothing is left waiting."""
    cfg = TernGradConfig(exchange=exchange, on_nonfinite=policy)

    def body(c):
        ex = Engine(c, cfg)
        items = [(grad((300,), c.rank, i), f"m{i}") for i in range(2)]
        if c.rank == 2:
            items[0][0][250] = float("nan")          # in the last owner's shard only
        tickets = ex.start_group(items, "g")
        for tk in tickets:
            tk.want_noise = exchange == "requantized"
        try:
            outs = [ex.finish(t) for t in tickets]
        except NonFiniteGradientError as e:
            outs = str(e)
        after = ex.allreduce(grad((40,), c.rank, 5), "next")         # nothing left waiting
        return outs, after

    res = run_ranks(3, body, timeout=60)
    want1 = expected_reternarized([grad((300,), r, 1) for r in range(3)], "m1", 0, cfg,
                                  second="requant" if exchange == "requantized" else "ternary")
    for outs, after in res:
        assert torch.equal(after, res[0][1])
        if policy == "raise":
            assert isinstance(outs, str) and "'m0'" in outs and "NaN or Inf" in outs
            continue
        assert torch.isnan(outs[0]).all() if policy == "propagate" else torch.equal(outs[0], torch.zeros(300))
        assert torch.equal(outs[1], want1)


def test_ranks_that_disagree_on_a_shape_get_a_clear_error_not_a_hang():
    cfg = TernGradConfig(exchange="reternarized")

    def body(c):
        try:
            Engine(c, cfg).allreduce(torch.randn(100 + 40 * c.rank), "conv.weight")
        except RankMismatchError as e:
            return str(e)
        return None

    for msg in run_ranks(2, body, timeout=30):
        assert msg is not None and "'conv.weight'" in msg and "disagree" in msg


@pytest.mark.parametrize("exchange", ["reternarized", "requantized"])
def test_a_step_with_a_joined_rank_goes_by_the_join_transport_exactly(exchange):
    """hvd.join() on thread ranks: the last rank joins; the step's presence check sends the group by the
    shared-scaler handshake and the join transport, with the scalers of the re-ternarized exchange's encode
    (one per shard of the world's N; the requantized exchange shares it): the active ranks get the shared-scaler
    reference at that bucket size."""
    world = 3
    cfg = TernGradConfig(exchange=exchange)

    def body(c):
        if c.rank == world - 1:
            return c.join(), None
        ex = Engine(c, cfg)
        out = ex.allreduce(grad((257,), c.rank, 4), "lone")
        return c.join(), out

    results = run_ranks(world, body, timeout=60)
    bucket = sizes.reternarized_encode_bucket(257, world)
    want, _ = expected_average([grad((257,), r, 4) for r in (0, 1)], "lone", 0,
                               TernGradConfig(shared_scaler=True, bucket_size=bucket), ranks=[0, 1], world=world)
    for r in (0, 1):
        assert torch.equal(results[r][1], want)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[1], CONFIGS[2]], ids=IDS[:3])
def test_the_noise_estimate_is_the_owners_squared_values_bit_for_bit(cfg):
    """For horovod_terngrad.optim's default Adam: with the ticket's want_noise, every rank gets s'^2·|t'| of
    every owner's payload (the reference's, bit for bit), identical on every rank."""
    N, shape = 4, (30, 41)

    def body(c):
        ex = Engine(c, cfg)
        tk = ex.start(grad(shape, c.rank, 3), "w")
        tk.want_noise = True
        ex.finish(tk)
        return tk.noise

    res = run_ranks(N, body)
    _, want = expected_reternarized([grad(shape, r, 3) for r in range(N)], "w", 0, cfg, noise=True)
    for nu in res:
        assert torch.equal(nu, want)
    assert (want > 0).any()


def test_ranks_whose_shard_headers_disagree_at_equal_sizes_fail_at_finish_not_a_hang():
    """Rank 0 with one scaler per shard, rank 1 with buckets of 60 (the shard size): the same bytes, other headers.
    Every owner reads a disagreeing sender's header, so every rank's finish raises RankMismatchError naming the
    tensor (set on the members, not raised out of the owner step), and the next exchange still works."""
    def body(c):
        ex = Engine(c, TernGradConfig(exchange="reternarized", bucket_size=60 * c.rank))
        try:
            ex.allreduce(grad((100,), c.rank), "fc.weight")
            msg = None
        except RankMismatchError as e:
            msg = str(e)
        ok = Engine(c, TernGradConfig(exchange="reternarized")).allreduce(grad((40,), c.rank, 2), "next")
        return msg, ok

    res = run_ranks(2, body, timeout=30)
    for msg, ok in res:
        assert msg is not None and "'fc.weight'" in msg and "disagree" in msg
        assert torch.equal(ok, res[0][1])


@pytest.mark.parametrize("numel,N,fmt,bucket", [(1000, 8, "2bit", 0), (1000, 3, "base3", 0), (4096, 64, "2bit", 0),
                                                (999, 4, "2bit", 60), (100, 8, "base3", 0), (5, 4, "2bit", 0),
                                                (12345, 16, "base3", 20)])
def test_shard_payloads_are_each_shards_own_payload_byte_for_byte(numel, N, fmt, bucket):
    """The block layout of the full-size shards (reternarized.shard_payloads) gives the bytes shard_payload gives
    shard by shard, the sender's NaN/Inf flag included."""
    from horovod_terngrad import backends, codec
    from horovod_terngrad.exchange.reternarized import shard_payload, shard_payloads
    g = torch.randn(numel)
    enc = sizes.reternarized_encode_bucket(numel, N, bucket)
    backend = backends.for_device(g.device)
    prep = backend.prepare(g, enc, 2.5)
    payload = backend.encode(g, prep.threshold, prep.scalers, enc, codec.stream_key(0, 0, 1, 0), fmt, flags=1)
    got = shard_payloads(payload, numel, N, enc, fmt, bucket)
    want = [shard_payload(payload, numel, lo, hi, enc, fmt, bucket)
            for lo, hi in sizes.reternarized_bounds(numel, N, bucket)]
    assert len(got) == N
    for a, b in zip(got, want):
        assert torch.equal(a, b)
