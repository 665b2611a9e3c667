"""Layer 2: the fused CPU backend's ``REQUANT`` capability (kernels/terngrad_cpu.c, tg_requant_encode /
tg_requant_decode) gives codec/requant.py's bytes and values exactly: every size (short groups, odd counts, 0 and
1 elements), key and start (the element word across 2^32), with and without the noise channel, all-zero, tiny and
huge groups, NaN / Inf; and the requantized exchange on thread ranks gives the same payloads and results with the
fused backend as with the reference backend."""
import pytest
import torch

from horovod_terngrad import TernGradConfig
from horovod_terngrad.backends import REFERENCE, REQUANT, RequantBackend, has_capability
from horovod_terngrad.codec import requant, sizes
from horovod_terngrad.exchange import Engine, requantized, run_ranks

SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 127, 128, 129, 255, 256, 257, 1023, 1024, 1025, 1031, 2047, 2049, 5000,
         65537, (1 << 18) + 5]
INF, NAN = float("inf"), float("nan")


def shard(m, seed):
    """An average-like shard and a noise estimate (>= 0) with all-zero, tiny and wide-ranging groups."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, generator=gen) * torch.logspace(-3, 2, m) if m else torch.zeros(0)
    nu = torch.rand(m, generator=gen) ** 3
    if m > 400:
        a[128:256] = 0.0                 # an all-zero group (step 0)
        nu[128:256] = 0.0
        a[256:300] = 1e-45               # subnormal: its step underflows to 0
        nu[300:310] = 1e-44
        a[m // 2] = -a[m // 2].abs() * 50
    return a, nu


def same_bits(x, y):
    return x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))


def decode_both(fused, payload, m, with_noise, pad=3):
    """Both decodes of ``payload`` placed at an unaligned offset: (reference out, noise), (fused out, noise)."""
    buf = torch.cat([torch.full((pad,), 0xAB, dtype=torch.uint8), payload, torch.zeros(5, dtype=torch.uint8)])
    ref = (torch.full((m,), -1.0), torch.full((m,), -1.0))
    got = (torch.full((m,), -1.0), torch.full((m,), -1.0))
    requant.decode(buf, pad, m, with_noise, *ref)
    fused.requant_decode(buf, pad, m, with_noise, *got)
    return ref, got


def test_the_fused_backend_declares_requant(fused):
    assert has_capability(fused, REQUANT) and isinstance(fused, RequantBackend)
    assert not has_capability(REFERENCE, REQUANT) and not isinstance(REFERENCE, RequantBackend)


@pytest.mark.parametrize("m", SIZES)
@pytest.mark.parametrize("with_noise", [False, True], ids=["plain", "noise"])
def test_encode_gives_the_reference_bytes_and_decode_its_bits(fused, m, with_noise):
    for seed, start, flags in ((0, 0, 0), (1, 40, 1), (2, (1 << 32) - 700, 0), (3, 5 << 32, 1)):
        a, nu = shard(m, 31 * m + seed)
        keys = requant.keys(seed, 7 + seed, f"layer{seed}", seed % 3)
        noise = nu if with_noise else None
        want = requant.encode(a, keys, start, noise, flags=flags)
        got = fused.requant_encode(a, keys, start, noise, flags=flags)
        assert got.dtype == torch.uint8 and got.numel() == sizes.requantized_owner_bytes(m, with_noise)
        assert torch.equal(got, want), (m, seed, (got != want).nonzero().flatten()[:8].tolist())
        (ro, rn), (fo, fn) = decode_both(fused, want, m, with_noise, pad=1 + seed)
        assert same_bits(fo, ro) and same_bits(fn, rn)


EXTREME_CASES = ["inf", "-inf", "nan", "noise_inf", "noise_nan", "overflow", "all_zero"]


def extreme_shard(case, m=1000):
    """A shard and noise estimate of ``m`` elements made extreme as ``case`` (one of ``EXTREME_CASES``) says."""
    a, nu = shard(m, 5)
    if case == "inf":
        a[3] = INF
    elif case == "-inf":
        a[200], a[999] = -INF, INF
    elif case == "nan":
        a[130] = NAN
    elif case == "noise_inf":
        nu[7] = INF
    elif case == "noise_nan":
        nu[900] = NAN
    elif case == "overflow":
        a[:] = 1e38
        a[3] = 3.4e38
    else:
        a.zero_()
        nu.zero_()
    return a, nu


def check_extreme_shard(backend, case):
    """``backend``'s requant encode gives the reference's bytes and its decode the reference's bits on
    ``extreme_shard(case)``, with and without the noise channel."""
    a, nu = extreme_shard(case)
    keys = requant.keys(1, 2, "x", 0)
    for noise in (None, nu):
        want = requant.encode(a, keys, 10, noise)
        assert torch.equal(backend.requant_encode(a, keys, 10, noise), want), case
        (ro, rn), (go, gn) = decode_both(backend, want, a.numel(), noise is not None)
        assert same_bits(go, ro) and same_bits(gn, rn), case


@pytest.mark.parametrize("case", EXTREME_CASES)
def test_non_finite_and_extreme_shards_give_the_reference_bytes(fused, case):
    """Which the exchange can meet: an average that overflowed to ±Inf, a noise estimate whose squares did, steps
    whose squares do (their variance Inf or NaN); and NaN, which the reference also defines (amax's NaN is
    0x7fc00000, a NaN code casts to 0 on x86)."""
    check_extreme_shard(fused, case)


def test_threads_change_no_byte(fused):
    a, nu = shard(300_001, 9)
    keys = requant.keys(4, 1, "w", 2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused.requant_encode(a, keys, 1234, nu)
        torch.set_num_threads(max(2, before))
        assert torch.equal(fused.requant_encode(a, keys, 1234, nu), one)
        (ro, rn), (fo, fn) = decode_both(fused, one, a.numel(), True)
        assert same_bits(fo, ro) and same_bits(fn, rn)
    finally:
        torch.set_num_threads(before)


def test_decode_into_views_and_without_the_noise_channel(fused):
    m = 777
    a, nu = shard(m, 11)
    keys = requant.keys(0, 0, "v", 1)
    payload = requant.encode(a, keys, 0, nu)
    # a payload with the channel decoded without it, and outputs that are not contiguous
    (ro, rn), (fo, fn) = decode_both(fused, payload, m, False)
    assert same_bits(fo, ro) and (fn == -1).all() and (rn == -1).all()
    ref_out, ref_nu = torch.empty(m), torch.empty(m)
    requant.decode(payload, 0, m, True, ref_out, ref_nu)
    out, noise = torch.full((m, 2), -1.0), torch.full((m, 2), -1.0)
    fused.requant_decode(payload, 0, m, True, out[:, 1], noise[:, 0])
    assert same_bits(out[:, 1].contiguous(), ref_out) and same_bits(noise[:, 0].contiguous(), ref_nu)
    assert (out[:, 0] == -1).all() and (noise[:, 1] == -1).all()
    fused.requant_decode(payload, 0, m, True, out[:, 0], None)      # no noise output: the channel is not read
    assert same_bits(out[:, 0].contiguous(), ref_out)
    with pytest.raises(ValueError, match="no requantized payload"):
        fused.requant_decode(payload[:-40], 0, m, True, out[:, 0], noise[:, 1])


# -- the exchange on thread ranks: fused backend against the reference backend ------------------------------------
SHAPES = [(300, 7), (1,), (0,), (129,), (20, 50), (3000,)]


def _run(N, cfg, steps=2):
    """Per rank: (outputs, noises, every owner payload it formed) over ``steps`` steps of SHAPES."""
    made = {}
    real = requantized.RequantizedStage.owner_payload

    def spy(backend, received, offsets, lo, hi, tk, ex):
        payload = real(backend, received, offsets, lo, hi, tk, ex)
        made.setdefault(ex.coll.rank, []).append(payload.clone())
        return payload

    def body(c):
        ex = Engine(c, cfg)
        outs, noises = [], []
        for step in range(steps):
            items = [(torch.randn(s, generator=torch.Generator().manual_seed(100 * c.rank + 10 * step + i)) * (i + 1),
                      f"w{i}") for i, s in enumerate(SHAPES)]
            tickets = ex.start_group(items, "g")
            for i, tk in enumerate(tickets):
                tk.want_noise = (i + step) % 2 == 0
            outs.append([ex.finish(t) for t in tickets])
            noises.append([t.noise for t in tickets])
        return outs, noises

    requantized.RequantizedStage.owner_payload = staticmethod(spy)
    try:
        res = run_ranks(N, body)
    finally:
        requantized.RequantizedStage.owner_payload = staticmethod(real)
    return [(res[r][0], res[r][1], made.get(r, [])) for r in range(N)]


@pytest.mark.parametrize("N", [2, 3, 5])
@pytest.mark.parametrize("cfg", [TernGradConfig(exchange="requantized"),
                                 TernGradConfig(exchange="requantized", packing="base3", bucket_size=64, seed=4)],
                         ids=["default", "base3-buckets"])
def test_the_exchange_gives_the_same_payloads_and_results_with_either_backend(fused, monkeypatch, N, cfg):
    calls = {"encode": 0, "decode": 0}
    enc, dec = requant.encode, requant.decode

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(requant, "encode", count("encode", enc))
    monkeypatch.setattr(requant, "decode", count("decode", dec))
    got = _run(N, cfg)
    assert calls == {"encode": 0, "decode": 0}            # the fused backend took both
    monkeypatch.setenv("HOROVOD_TERNGRAD_BACKEND", "torch")
    want = _run(N, cfg)
    assert calls["encode"] > 0 and calls["decode"] > 0      # the reference backend lacks REQUANT: codec/requant.py
    for r in range(N):
        assert len(got[r][2]) == len(want[r][2]) > 0
        for p, q in zip(got[r][2], want[r][2]):
            assert torch.equal(p, q)
        for step in range(2):
            for i in range(len(SHAPES)):
                assert same_bits(got[r][0][step][i], want[r][0][step][i]), (r, step, i)
                nu_got, nu_want = got[r][1][step][i], want[r][1][step][i]
                assert (nu_got is None) == (nu_want is None)
                if nu_got is not None:
                    assert same_bits(nu_got, nu_want), (r, step, i)
