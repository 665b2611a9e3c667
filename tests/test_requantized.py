"""Layers 1 and 3: the requantized exchange (exchange/requantized.py, codec/requant.py) on thread ranks: bit for
bit against the reference written out from the codec (tests/helpers.expected_reternarized(second="requant")),
identical ranks, unbiased average and noise channel, the second rounding's variance, bits per element flat in N,
ranks that disagree (NaN/Inf policies and joined ranks: test_reternarized.py, which runs them for both
shard-owner exchanges)."""
import pytest
import torch

from helpers import expected_average, expected_reternarized
from horovod_terngrad import RankMismatchError, TernGradConfig
from horovod_terngrad.codec import requant, sizes
from horovod_terngrad.exchange import Engine, run_ranks


def grad(shape, rank, tensor=0):
    gen = torch.Generator().manual_seed(1000 * tensor + rank)
    return torch.randn(shape, generator=gen) * (rank + 1)


SHAPES = [(20, 50), (50,), (7, 3, 3), (1,), (1000,), (300, 7), (0,)]
CONFIGS = [TernGradConfig(exchange="requantized"),
           TernGradConfig(exchange="requantized", packing="base3", seed=3),
           TernGradConfig(exchange="requantized", bucket_size=64),
           TernGradConfig(exchange="requantized", shared_scaler=True),
           TernGradConfig(exchange="requantized", levels=4),
           TernGradConfig(exchange="requantized", levels=4, packing="base3", bucket_size=64, shared_scaler=True)]
IDS = ["default", "base3", "buckets", "shared", "4level", "4level-buckets-shared"]


# -- layer 1: the codec ----------------------------------------------------------------------------------------
def test_quantize_keeps_codes_in_range_and_its_variance_is_the_rounding_s_own():
    a = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.01, 3, 1000)
    keys = requant.keys(0, 0, "w", 0)
    steps, codes, var = requant.quantize(a, keys[0], 0)
    assert steps.numel() == 8 and int(codes.abs().max()) <= requant.LEVELS
    delta = steps.repeat_interleave(requant.GROUP)[:1000]
    err = codes.to(torch.float32) * delta - a
    assert (err.abs() <= delta * (1 + 1e-6)).all()           # one step at most: floor or floor + 1
    q = (a / delta).clamp(-requant.LEVELS, requant.LEVELS)      # (a group's maximum may divide to 7 + 1 ulp)
    f = q - torch.floor(q)
    assert torch.allclose(var, delta * delta * f * (1 - f))
    assert (var <= delta * delta / 4 + 1e-12).all()


def test_quantize_and_the_noise_bit_are_unbiased():
    """Over 2000 draws (the step word of the key), the mean decoded value of every element is within 4.5
    standard errors of a (average) and of nu (noise channel), the errors from the roundings' exact variances
    (Δ²·f·(1 - f) and ν·(νmax - ν)), so elements that are rarely rounded up are judged fairly."""
    a = torch.randn(256, generator=torch.Generator().manual_seed(0)) * 2
    nu = torch.rand(256, generator=torch.Generator().manual_seed(1)) ** 3
    outs, bits = [], []
    for step in range(2000):
        k_avg, k_noise = requant.keys(5, step, "w", 1)
        steps, codes, var = requant.quantize(a, k_avg, 0)
        outs.append(codes.to(torch.float32) * steps.repeat_interleave(requant.GROUP))
        top, b = requant.quantize_noise(nu, k_noise, 0)
        bits.append(b.to(torch.float32) * top.repeat_interleave(requant.GROUP))
    top = top.repeat_interleave(requant.GROUP)
    for draws, target, variance in ((torch.stack(outs), a, var), (torch.stack(bits), nu, nu * (top - nu))):
        se = (variance / draws.shape[0]).sqrt()
        assert ((draws.mean(0) - target).abs() <= 4.5 * se + 1e-6 * target.abs().max()).all()
    # and the draws do vary: the streams of different steps differ
    assert torch.stack(outs).std(0).max() > 0 and torch.stack(bits).std(0).max() > 0


@pytest.mark.parametrize("m", [0, 1, 127, 128, 129, 1000])
@pytest.mark.parametrize("with_noise", [False, True])
def test_a_payload_decodes_to_what_was_quantized_at_any_offset(m, with_noise):
    a = torch.randn(m)
    nu = torch.rand(m)
    keys = requant.keys(1, 2, "w", 3)
    payload = requant.encode(a, keys, 40, nu if with_noise else None, flags=1)
    assert payload.numel() == sizes.requantized_owner_bytes(m, with_noise) and payload.numel() % 4 == 0
    buf = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])     # unaligned, as in a gathered buffer
    assert requant.read_header(buf, 3, "x") == (m, 1 | (requant.FLAG_NOISE if with_noise else 0))
    out, noise = torch.empty(m), torch.full((m,), -1.0)
    requant.decode(buf, 3, m, with_noise, out, noise)
    steps, codes, var = requant.quantize(a, keys[0], 40)
    assert torch.equal(out, codes.to(torch.float32) * steps.repeat_interleave(requant.GROUP)[:m])
    if with_noise:
        top, bits = requant.quantize_noise(nu + var, keys[1], 40)
        assert torch.equal(noise, bits.to(torch.float32) * top.repeat_interleave(requant.GROUP)[:m])
    else:
        assert (noise == -1).all()
    with pytest.raises(ValueError, match="not a requantized owner payload"):
        requant.read_header(torch.zeros(8, dtype=torch.uint8), 0, "x")


# -- layer 3: the exchange -------------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [2, 3, 4, 8])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
@pytest.mark.parametrize("fused", [False, True], ids=["alone", "fused"])
def test_every_rank_gets_the_reference_bit_for_bit_with_and_without_noise(N, cfg, fused):
    def body(c):
        ex = Engine(c, cfg)
        outs, noises = [], []
        for step in range(2):
            items = [(grad(s, c.rank, i + 10 * step), f"layer{i}") for i, s in enumerate(SHAPES)]
            if fused:
                tickets = ex.start_group(items, "g")
            else:     # as the frontends do: the request right after its start, before the next start moves it on
                tickets = []
                for g, n in items:
                    tickets.append(ex.start(g, n))
                    tickets[-1].want_noise = (len(tickets) - 1 + step) % 2 == 0
            if fused:
                for i, tk in enumerate(tickets):
                    tk.want_noise = (i + step) % 2 == 0
            outs.append([ex.finish(t) for t in reversed(tickets)][::-1])
            noises.append([(t.noise, t.squares) for t in tickets])
        return outs, noises

    res = run_ranks(N, body)
    for step in range(2):
        for i, s in enumerate(SHAPES):
            # the senders' squares go with a request made before the payloads left (with the shared scaler's
            # handshake here; the frontends' routes always are): every rank made the same choice
            sent = {res[r][1][step][i][1] for r in range(N)}
            assert len(sent) == 1
            want, want_nu = expected_reternarized([grad(s, r, i + 10 * step) for r in range(N)], f"layer{i}", step,
                                                  cfg, noise=True, second="requant", squares=sent.pop())
            for r in range(N):
                assert res[r][0][step][i].shape == s
                assert torch.equal(res[r][0][step][i], want), (step, i, r)
                nu = res[r][1][step][i][0]
                if s == (0,):       # nothing to estimate (with the shared scaler, agreed empty: nothing sent)
                    assert nu is None or nu.numel() == 0
                elif (i + step) % 2 == 0:
                    assert torch.equal(nu, want_nu), (step, i, r)
                else:
                    assert nu is None


def _moments(cfg, draws=300, N=4, n=256):
    grads = [grad((n,), r, 7) for r in range(N)]
    second = "requant" if cfg.exchange == "requantized" else "ternary"
    outs = torch.stack([expected_reternarized(grads, "w", 0, cfg.replace(seed=s), second=second)
                        for s in range(draws)])
    return grads, outs


def test_the_average_is_unbiased_and_the_second_rounding_adds_far_less_than_ternary_rounding():
    """E[out] = the first stage's E[a] = mean_r clip(g_r) (within 4.5 standard errors over 300 seeds); the
    variance over seeds, first stage included, is at most 0.6x the re-ternarized exchange's (whose owner rounds
    to 3 levels) and within 1.2x the allgather exchange's (no second rounding)."""
    cfg = TernGradConfig(exchange="requantized")
    grads, outs = _moments(cfg)
    _, tern = _moments(TernGradConfig(exchange="reternarized"))
    from horovod_terngrad import codec as C
    n, N = 256, 4
    b1 = sizes.reternarized_encode_bucket(n, N, 0)
    clipped = []
    for g in grads:
        thr = C.clip_threshold(C.tensor_stats(g, b1), cfg.clip_factor)
        thr = thr.repeat_interleave(b1)[:n] if thr.numel() > 1 else thr
        clipped.append(torch.maximum(torch.minimum(g, thr), -thr))
    target = torch.stack(clipped).mean(0)
    se = outs.std(0) / outs.shape[0] ** 0.5
    assert ((outs.mean(0) - target).abs() <= 4.5 * se + 1e-6).all()
    flat = torch.stack([expected_average(grads, "w", 0, TernGradConfig(shared_scaler=False, bucket_size=b1,
                                                                       seed=s))[0] for s in range(300)])
    v_rq, v_rt, v_ag = outs.var(0).sum(), tern.var(0).sum(), flat.var(0).sum()
    assert v_rq <= 0.6 * v_rt and v_rq <= 1.2 * v_ag, (float(v_rq), float(v_rt), float(v_ag))


def _bits(cfg, N, n=1_000_000, noise=False):
    def body(c):
        ex = Engine(c, cfg)
        tk = ex.start(torch.randn(n, generator=torch.Generator().manual_seed(c.rank)), "w")
        tk.want_noise = noise
        ex.finish(tk)
        return ex.stats.payload_bytes_sent, ex.stats.bytes_received

    res = run_ranks(N, body, timeout=120)
    return max(8 * s / n for s, _ in res), max(8 * r / n for _, r in res)


def test_bits_per_element_stay_flat_from_2_to_8_ranks():
    """Received by the busiest rank, 1M elements: (N-1)/N x (2 + 4.25) + headers without the noise channel,
    (N-1)/N x (2 + 5.5) with it: at most 7.5 at every N, where the allgather exchange receives (N-1) x 2."""
    for N in (2, 4, 8):
        _, plain = _bits(TernGradConfig(exchange="requantized"), N)
        _, noisy = _bits(TernGradConfig(exchange="requantized"), N, noise=True)
        frac = (N - 1) / N
        assert plain == pytest.approx(frac * (2 + 4.25), abs=0.02), (N, plain)
        assert noisy == pytest.approx(frac * (2 + 5.5), abs=0.02), (N, noisy)
        assert noisy <= 7.5
    assert _bits(TernGradConfig(exchange="allgather"), 8)[1] > 13.9


def test_ranks_that_disagree_get_a_clear_error_not_a_hang():
    """On a shape (sizes differ), and on whether the optimizer asked for the noise channel (the owners'
    payloads differ in size): RankMismatchError naming the tensor on every rank, and the next exchange works."""
    cfg = TernGradConfig(exchange="requantized")

    def body(c):
        msgs = []
        for case in ("shape", "noise"):
            ex = Engine(c, cfg)
            try:
                tk = ex.start(torch.randn(100 + 40 * c.rank if case == "shape" else 1000), "conv.weight")
                tk.want_noise = case == "noise" and c.rank == 1
                ex.finish(tk)
                msgs.append(None)
            except RankMismatchError as e:
                msgs.append(str(e))
        ok = Engine(c, cfg).allreduce(grad((40,), c.rank, 2), "next")
        return msgs, ok

    res = run_ranks(2, body, timeout=30)
    for msgs, ok in res:
        for msg in msgs:
            assert msg is not None and "conv.weight" in msg and "disagree" in msg, msgs
        assert "noise estimate" in msgs[1]
        assert torch.equal(ok, res[0][1])


@pytest.mark.parametrize("N", [2, 3, 4, 5, 8])
def test_the_default_exchange_is_the_allgather_up_to_4_ranks_and_requantized_above(N):
    """TernGradConfig()'s exchange="default": every rank gets the allgather reference at N <= 4 and the
    requantized reference above (policy.default_transport), noise estimate included and identical on every rank; a
    pure function of N, no collective."""
    cfg = TernGradConfig()
    assert cfg.exchange == "default"
    shape = (64, 100)

    def body(c):
        ex = Engine(c, cfg)
        tk = ex.start(grad(shape, c.rank, 4), "w")
        tk.want_noise = True
        return ex.finish(tk), tk.noise

    res = run_ranks(N, body)
    grads = [grad(shape, r, 4) for r in range(N)]
    if N <= 4:
        want, _ = expected_average(grads, "w", 0, cfg.replace(exchange="allgather"))
    else:
        want = expected_reternarized(grads, "w", 0, cfg.replace(exchange="requantized"), second="requant")
    for out, nu in res:
        assert torch.equal(out, want) and nu is not None and torch.equal(nu, res[0][1])
