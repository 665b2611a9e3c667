"""The four-level code with stratified dithers (codec/levels.py): the reference's properties (unbiased on every
rank, the group's average less noisy than with independent dithers, every rank's dither uniform, the strata fields
true fields), and the fused CPU backend (kernels/terngrad_cpu.c) and the CUDA kernels' host build (kernels/terngrad.cu)
giving the reference's bytes and decoded bits exactly."""
import pytest
import torch

from horovod_terngrad import codec as C
from horovod_terngrad.backends import REFERENCE, Backend, cpu_fused
from horovod_terngrad.backends.cuda import KernelBackend
from horovod_terngrad.backends.host_build import HostKernels
from horovod_terngrad.codec import levels, packing

GROUPS = [1, 2, 3, 8, 16, 17, 512]
SEED, STEP, TENSOR = 11, 3, C.tensor_id("layer")


@pytest.fixture(scope="module")
def host():
    return KernelBackend(HostKernels())


def sample(n, seed, scale=1.0):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    if n > 20:
        g[n // 5] = -30.0          # an outlier the clip cuts
        g[n // 2] = 0.0
    return g


def keys(rank, step=STEP):
    return C.stream_key(SEED, step, TENSOR, rank), levels.strata_key(SEED, step, TENSOR)


def ranks_of(group):
    return sorted({0, 1 % group, group // 2, group - 1})


def encode(backend, g, prep, bucket, rank, group, flags=0):
    own, shared = keys(rank)
    return backend.encode_levels(g, prep.threshold, prep.scalers, bucket, own, shared, rank, group, flags)


def codes_of(payload):
    h = packing.parse_header(payload)
    return levels.unpack_codes(packing.split(payload, h)[1], h.numel)


def walk(payloads):
    x = torch.cat(payloads)
    h, o = packing.walk(x, len(payloads))
    return x, h, o


# -- the reference's properties ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [0, 5, 15])
def test_every_rank_rounds_unbiasedly(rank):
    """E[s·V[code]] = c on each rank of a group of 16: the mean over 400 streams (steps) of the decoded values is c
    within 6 standard deviations of the mean, (s/3)/sqrt(400) per element at most."""
    c = torch.linspace(-1.0, 1.0, 301)
    s = torch.ones(1)
    acc = torch.zeros_like(c)
    steps = 400
    for step in range(steps):
        own, shared = keys(rank, step)
        pay = levels.encode(c, torch.tensor(float("inf")), s, 0, own, shared, rank, 16)
        acc += levels.decode_payload(pay)
    err = acc / steps - c
    assert err.abs().max() < 6 * (1 / 3) / steps ** 0.5
    assert err.mean().abs() < 6 * (1 / 3) / (steps * c.numel()) ** 0.5


def _average_error(c, group, stratified):
    """Mean squared error of the group's decoded average of one tensor c that every rank holds."""
    pays = []
    for r in range(group):
        own = C.stream_key(SEED, STEP, TENSOR, r)
        if stratified:
            pays.append(levels.encode(c, torch.tensor(float("inf")), torch.ones(1), 0, own,
                                      levels.strata_key(SEED, STEP, TENSOR), r, group))
        else:        # a group of one: the rank's own draws alone, independent of the other ranks'
            pays.append(levels.encode(c, torch.tensor(float("inf")), torch.ones(1), 0, own, (0, 0), 0, 1))
    x, h, o = walk(pays)
    return float(((levels.decode_average(x, h, o, group) - c) ** 2).mean())


def test_stratified_dithers_make_the_average_less_noisy_than_independent_ones():
    """Where the 16 ranks' values agree, their up/down decisions are spread over the strata: the average's variance
    falls far below that of independent dithers (which is (2s/3)²·f(1 - f)/16 per element)."""
    c = torch.rand(4096, generator=torch.Generator().manual_seed(1)) * 2 - 1
    strat, indep = _average_error(c, 16, True), _average_error(c, 16, False)
    assert indep > 0 and strat < 0.6 * indep, (strat, indep)


@pytest.mark.parametrize("group", [2, 3, 16, 17, 512])
def test_every_ranks_dither_is_uniform_and_the_strata_are_distinct(group):
    """Each rank's 24-bit dither over 2^15 elements: its top 8 bits fill 256 bins as a uniform variable does
    (chi-square under its 6-sigma bound), and at every element the ranks' strata (top k bits) are distinct."""
    k, count = levels.strata_bits(group), 1 << 15
    shared = levels.strata_key(SEED, STEP, TENSOR)
    strata = []
    for r in range(group):
        checked = r in ranks_of(group)
        u = levels.stratified_uniform24(C.stream_key(SEED, STEP, TENSOR, r), shared, r, group, 0,
                                        count if checked else 2048)
        assert int(u.min()) >= 0 and int(u.max()) < 1 << 24
        if checked:
            hist = torch.bincount(u >> 16, minlength=256).double()
            chi2 = float(((hist - count / 256) ** 2 / (count / 256)).sum())
            assert chi2 < 255 + 6 * (2 * 255) ** 0.5, (r, chi2)
        strata.append(u[:2048] >> (24 - k))
    srt = torch.stack(strata).sort(dim=0).values           # [group, elements], each column sorted
    assert bool((srt[1:] != srt[:-1]).all()), "two ranks drew the same stratum"


def _gf_mul_all(k, poly):
    """a·r for every pair of field elements (int64 [2^k, 2^k]), by shift-and-add, independent of levels.gf_mul."""
    x = torch.arange(1 << k, dtype=torch.int64)
    a, r = x[:, None].expand(-1, 1 << k), x[None, :]
    out, top = torch.zeros_like(a), 1 << k
    for i in range(k):
        out = out ^ a * ((r >> i) & 1)
        a = a << 1
        a = a ^ ((a & top) != 0).to(torch.int64) * poly
    return out


def _poly_mod(a: int, b: int) -> int:
    """a mod b for polynomials over GF(2) as bit masks."""
    db = b.bit_length()
    while a.bit_length() >= db:
        a ^= b << (a.bit_length() - db)
    return a


def test_the_strata_polynomials_are_irreducible():
    """GF(2^k) is a field (multiplication by every nonzero a a bijection, so a·rank + b takes distinct ranks to
    distinct strata) only modulo an irreducible polynomial of degree k.  For every k, no polynomial of degree
    1..k/2 divides POLYNOMIALS[k] (trial division by all of them: a reducible one has such a factor).  The
    bijection itself: on the whole table for k <= 8 (which levels.gf_mul reproduces), for some multipliers
    up to k = 12."""
    assert sorted(levels.POLYNOMIALS) == list(range(2, 17))
    for k, poly in levels.POLYNOMIALS.items():
        assert poly >> k == 1, k                                            # degree exactly k
        assert all(_poly_mod(poly, d) != 0 for d in range(2, 1 << (k // 2 + 1))), k
        if k <= 8:
            table = _gf_mul_all(k, poly)
            assert torch.equal(table[1:, :].sort(dim=1).values, torch.arange(1 << k).expand(table.shape[0] - 1, -1)), k
            for r in (1, 2, (1 << k) - 1, (1 << k) // 3):
                assert torch.equal(levels.gf_mul(torch.arange(1 << k), r, k), table[:, r]), (k, r)
        elif k <= 12:
            x = torch.arange(1 << k)
            for r in (1, 3, 0x5A5 % (1 << k), (1 << k) - 1):
                assert torch.equal(levels.gf_mul(x, r, k).sort().values, x), (k, r)


@pytest.mark.parametrize("backend", ["reference", "fused", "host"])
def test_bad_group_sizes_and_ranks_raise_on_every_backend(backend, host):
    be = {"reference": REFERENCE, "fused": cpu_fused(), "host": host}[backend]
    assert isinstance(be, Backend)
    g = sample(10, 1)
    p = REFERENCE.prepare(g, 0, 2.5)
    own, shared = keys(0)
    for n in (0, 10):
        for rank, group in ((0, 0), (0, -1), (0, levels.MAX_GROUP + 1), (3, 3), (-1, 4)):
            with pytest.raises(ValueError, match="group|rank"):
                be.encode_levels(g[:n], p.threshold, p.scalers, 0, own, shared, rank, group)
    encode(be, g, p, 0, levels.MAX_GROUP - 1, levels.MAX_GROUP)          # the largest group is fine


# -- the backends against the reference ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 1279, 1280, 1281, 5017])
@pytest.mark.parametrize("bucket", [0, 7, 128])
def test_fused_encode_gives_the_reference_bytes(n, bucket):
    fused = cpu_fused()
    for group in GROUPS:
        for rank in ranks_of(group):
            g = sample(n, 7 * n + rank + group, scale=1 + rank % 3)
            p = REFERENCE.prepare(g, bucket, 2.5)
            want = encode(REFERENCE, g, p, bucket, rank, group)
            got = encode(fused, g, p, bucket, rank, group)
            assert torch.equal(got, want), (group, rank, (got != want).nonzero().flatten()[:8].tolist())


def _payload_sets(n, bucket, npay):
    """Gathered four-level payloads of npay ranks of a group of npay: per-rank scalers, shared scalers (the case
    the ternary code decodes with integer sums), and shared but for one bucket of one payload."""
    per_rank, shared, all_but_one = [], [], []
    for r in range(npay):
        g = sample(n, 100 + r, scale=1 + r % 3)
        p = REFERENCE.prepare(g, bucket, 2.5)
        own, strata = keys(r)
        big = torch.full_like(p.scalers, 40.0)
        one_off = big.clone()
        one_off[-1] = 35.0 if r == npay // 2 else 40.0
        for out, s in ((per_rank, p.scalers), (shared, big), (all_but_one, one_off)):
            out.append(levels.encode(g, p.threshold, s, bucket, own, strata, r, npay))
    return [walk(p) for p in (per_rank, shared, all_but_one)]


@pytest.mark.parametrize("npay", [1, 2, 3, 9])
@pytest.mark.parametrize("n,bucket", [(1, 0), (5, 0), (1001, 0), (1283, 0), (6401, 0), (1001, 7), (3000, 128)])
def test_fused_decode_and_noise_give_the_reference_bits(npay, n, bucket):
    """decode = packing's general formula = levels.decode_average; decode_noise = the squares' formula with divisor
    d², for one payload, the two-payload table, layer-wise and bucketed scalers, shared or not."""
    fused = cpu_fused()
    for x, h, o in _payload_sets(n, bucket, npay):
        for d in (npay, 1):
            want = levels.decode_average(x, h, o, d)
            assert torch.equal(REFERENCE.decode(x, h, o, d), want)
            assert torch.equal(fused.decode(x, h, o, d), want)
            noise = levels.decode_average(x, h, o, float(d) ** 2, squares=True)
            assert torch.equal(fused.decode_noise(x, h, o, d), noise)
        out = torch.full((n + 1,), 7.0)
        assert torch.equal(fused.decode(x, h, o, npay, out=out[1:]), levels.decode_average(x, h, o, npay))
        assert out[0] == 7.0


def test_the_fused_shared_scaler_kernel_passes_four_level_codes_to_the_general_formula():
    """tg_decode_shared never sums four-level codes as integers, even when called directly with fmt 3."""
    import ctypes
    fused = cpu_fused()
    n = 1283
    x, h, o = _payload_sets(n, 0, 3)[1]                  # three payloads with the same scaler, 40
    want = levels.decode_average(x, h, o, 3)
    s = torch.tensor([40.0])
    at = packing.codes_offset(1)
    pp = (ctypes.c_void_p * 3)(*[x.data_ptr() + off + at for off in o])
    out = torch.empty(n)
    fused.lib.tg_decode_shared(pp, s.data_ptr(), 3, n, 3, 0, 3.0, 0, out.data_ptr(), 2)
    assert torch.equal(out, want)


def test_fused_bytes_do_not_depend_on_the_thread_count():
    fused = cpu_fused()
    g = sample(50_017, 5)
    p = REFERENCE.prepare(g, 0, 2.5)
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(encode(fused, g, p, 0, 5, 16))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 17, 1279, 1281, 5017])
@pytest.mark.parametrize("bucket", [0, 7, 128])
def test_host_built_kernels_encode_and_decode_the_reference(host, n, bucket):
    for group in (1, 3, 16, 17, 512):
        pays = []
        for rank in ranks_of(group):
            g = sample(n, 3 * n + rank + group, scale=1 + rank % 2)
            p = REFERENCE.prepare(g, bucket, 2.5)
            want = encode(REFERENCE, g, p, bucket, rank, group)
            assert torch.equal(encode(host, g, p, bucket, rank, group), want), (group, rank)
            pays.append(want)
        if n:
            x, h, o = walk(pays)
            assert torch.equal(host.decode(x, h, o, len(pays)), levels.decode_average(x, h, o, len(pays)))


@pytest.mark.parametrize("bucket", [0, 7, 64])
def test_host_decode_of_many_payloads_at_odd_offsets_into_an_unaligned_output(host, bucket):
    """Nine payloads of 1001 elements (251 code bytes: most payloads' codes start off a 4-byte boundary), per-rank,
    shared (which the kernel must not sum as integers) and all-but-one-shared scalers, into an output view that is
    not 16-byte aligned."""
    n = 1001
    for x, h, o in _payload_sets(n, bucket, 9):
        assert any((off + packing.codes_offset(h[0].num_scalers)) % 4 for off in o)
        buf = torch.full((n + 1,), 5.0)
        got = host.decode(x, h, o, 9, out=buf[1:])
        assert got.data_ptr() % 16 != 0 and torch.equal(got, levels.decode_average(x, h, o, 9)) and buf[0] == 5.0


@pytest.mark.parametrize("grid_limit,block", [(1, 1), (2, 3), (5, 7)])
def test_any_grid_covers_any_size(grid_limit, block):
    be = KernelBackend(HostKernels(grid_limit=grid_limit, block=block))
    for n, bucket in ((37, 0), (2003, 0), (2003, 9)):
        g = sample(n, n)
        p = REFERENCE.prepare(g, bucket, 2.5)
        assert torch.equal(encode(be, g, p, bucket, 2, 3), encode(REFERENCE, g, p, bucket, 2, 3))


@pytest.mark.parametrize("shift", [1, 2, 3])
def test_host_kernels_read_unaligned_and_bf16_gradients_and_write_unaligned_codes(host, shift):
    """A gradient view off the 16-byte vector alignment, a bf16 gradient (the bytes of its fp32 copy), and codes
    stored byte by byte into a region off the 4-byte alignment: the reference's bytes, nothing written outside."""
    n = 3001
    buf = sample(n + shift, 21)
    g = buf[shift:]
    for bucket in (0, 50):
        p = REFERENCE.prepare(g, bucket, 2.5)
        assert torch.equal(encode(host, g, p, bucket, 4, 8), encode(REFERENCE, g.clone(), p, bucket, 4, 8))
        b16 = g.to(torch.bfloat16)
        p16 = REFERENCE.prepare(b16.float(), bucket, 2.5)
        assert torch.equal(encode(host, b16, p16, bucket, 4, 8), encode(REFERENCE, b16.float(), p16, bucket, 4, 8))
    p = REFERENCE.prepare(g, 0, 2.5)
    own, strata = keys(6)
    want = encode(REFERENCE, g, p, 0, 6, 17)[packing.codes_offset(1):]
    k = levels.strata_bits(17)
    out = torch.full((want.numel() + shift + 1,), 0xAB, dtype=torch.uint8)
    host.k.launch("tg_levels_pack_f32", -(-want.numel() // 4),
                  [g.clone(), n, p.threshold.reshape(1), p.scalers, 0, own[0], own[1], strata[0], strata[1], 6, k,
                   levels.POLYNOMIALS[k], out[shift:]])
    assert torch.equal(out[shift:shift + want.numel()], want)
    assert (out[:shift] == 0xAB).all() and out[-1] == 0xAB


# -- edge values: the clip, zero scalers, NaN/Inf ---------------------------------------------------------------------
def _backends(host):
    return [REFERENCE, cpu_fused(), host]


def test_values_at_the_threshold_round_to_the_outer_levels(host):
    """c = ±thr = ±s gives y = 0 or 3 exactly: codes 0 and 3 on every rank, whatever the dither; beyond the threshold
    (±inf included) the clip makes them the same."""
    thr = 0.75
    g = torch.tensor([thr, -thr, 2.0, -2.0, float("inf"), -float("inf"), 0.25, 0.0] * 40)
    s = torch.tensor([thr])
    for group in (1, 3, 16):
        for rank in ranks_of(group):
            own, strata = keys(rank)
            pays = [be.encode_levels(g, torch.tensor(thr), s, 0, own, strata, rank, group) for be in _backends(host)]
            assert all(torch.equal(pay, pays[0]) for pay in pays[1:])
            codes = codes_of(pays[0]).view(40, 8)
            assert (codes[:, [0, 2, 4]] == 3).all() and (codes[:, [1, 3, 5]] == 0).all()


@pytest.mark.parametrize("bucket", [0, 100])
def test_no_clip_threshold_gives_the_reference_bytes(host, bucket):
    """clip_factor 0: the threshold is +inf, the clamp to [-inf, inf] keeps every value and s = max|g|."""
    g = sample(2001, 9, scale=3.0)
    p = REFERENCE.prepare(g, bucket, 0.0)
    assert float(p.threshold) == float("inf")
    want = encode(REFERENCE, g, p, bucket, 1, 3)
    assert all(torch.equal(encode(be, g, p, bucket, 1, 3), want) for be in _backends(host)[1:])
    assert codes_of(want)[2001 // 5] == 0                 # the outlier, -max|g| = -s: y = 0 exactly


def test_zero_scalers_give_code_zero(host):
    """s = 0 (a zero bucket, or a sender whose tensor held NaN/Inf) writes code 0 with no division by zero; it
    decodes to 0."""
    g = sample(300, 2)
    g[100:200] = 0.0
    p = REFERENCE.prepare(g, 100, 2.5)
    assert p.scalers[1] == 0 and (p.scalers[[0, 2]] > 0).all()
    for be in _backends(host):
        pay = encode(be, g, p, 100, 2, 3)
        assert (codes_of(pay)[100:200] == 0).all()
        assert (levels.decode_payload(pay)[100:200] == 0).all()
        zero = be.encode_levels(g, p.threshold, torch.zeros(3), 100, *keys(2), 2, 3)
        assert (codes_of(zero) == 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_tensors_payload_decodes_to_zeros(host, bad):
    g = sample(1500, 4)
    g[777] = bad
    fused = cpu_fused()
    want = None
    for be in _backends(host):
        p = be.prepare(g, 0, 2.5)
        assert bool(p.nonfinite) and p.scalers.tolist() == [0.0]
        pay = encode(be, g, p, 0, 1, 2, flags=packing.FLAG_NONFINITE)
        want = pay if want is None else want
        assert torch.equal(pay, want) and pay[3] == packing.FLAG_NONFINITE
    other = encode(REFERENCE, sample(1500, 5), REFERENCE.prepare(sample(1500, 5), 0, 2.5), 0, 0, 2)
    x, h, o = walk([want, other])
    for be in (REFERENCE, fused, host):
        assert torch.equal(be.decode(x, h[:1], o[:1], 1), torch.zeros(1500))
        assert torch.equal(be.decode(x, h, o, 2), levels.decode_average(x, h, o, 2))
    assert torch.equal(fused.decode_noise(x, h[:1], o[:1], 1), torch.zeros(1500))


@pytest.mark.parametrize("bucket", [0, 7])
def test_scalers_below_the_values_still_give_the_reference_bytes(host, bucket):
    """Out of contract (every caller's scalers are >= max|clip(g)| of their bucket): scalers too small, or tiny, make
    y leave [0, 3] and the codes leave 0..3, and a NaN with a positive scaler has no code; each backend keeps the
    integer's low byte as the reference's uint8 conversion does, so the bytes still agree."""
    g = sample(2003, 8)
    g[5] = float("nan")
    p = REFERENCE.prepare(sample(2003, 9), bucket, 2.5)
    for factor in (0.3, 1e-30):
        s = p.scalers * factor
        want = REFERENCE.encode_levels(g, p.threshold, s, bucket, *keys(1), 1, 3)
        for be in _backends(host)[1:]:
            assert torch.equal(be.encode_levels(g, p.threshold, s, bucket, *keys(1), 1, 3), want), (be.name, factor)


def test_ternary_kernels_refuse_the_four_level_format(host):
    """The ternary encode, owner sums and nearest rounding read codes as ternary values: given the four-level format
    they raise (as the reference's packing does) instead of writing base-3 bytes into a 2-bit region."""
    g = sample(40, 1)
    p = REFERENCE.prepare(g, 0, 2.5)
    fused = cpu_fused()
    for be in (REFERENCE, fused, host):
        with pytest.raises(ValueError, match="ternary packing"):
            be.encode(g, p.threshold, p.scalers, 0, keys(0)[0], levels.FORMAT)
    for be in (fused, host):
        with pytest.raises(ValueError, match="ternary packing"):
            be.owner_sums(torch.zeros(20, dtype=torch.uint8), 2, 40, levels.FORMAT, 3)
    with pytest.raises(ValueError, match="ternary packing"):
        fused.encode_nearest(g, levels.FORMAT)
