"""Layer 2: the fused CPU backend gives the reference codec's bytes exactly."""
import math

import pytest
import torch

from horovod_terngrad import codec as C
from horovod_terngrad.backends import (ADAM_CORRECTED, NEAREST, NOISE_DECODE, REFERENCE, REQUANT, SHARDED_SUMS, SQUARE_SUMS,
                                       AdamCorrectedBackend, Backend, NearestBackend, NoiseDecodeBackend,
                                       ShardedSumsBackend, SquareSumsBackend, cpu, has_capability)
from horovod_terngrad.codec import nearest, squares
from horovod_terngrad.backends.compile_cache import cache_dir
from horovod_terngrad.codec import packing

# the sizes above a million elements take seconds each on the reference codec: the slow tier, in this process
ONE_PROCESS_SLOW = [pytest.mark.slow, pytest.mark.one_process]
SIZES = [0, 1, 3, 4, 5, 7, 8, 9, 1279, 1280, 1281, 2047, 2048, 2049, 4097, 65537,
         pytest.param(1 << 20, marks=ONE_PROCESS_SLOW), pytest.param((1 << 21) + 3, marks=ONE_PROCESS_SLOW)]


def sample(n, seed):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if n > 10:
        g[n // 3] = 40.0   # an outlier that clipping cuts
        g[n // 2] = 0.0
    return g


def assert_same_prep(a, b):
    assert a.numel == b.numel
    assert float(a.threshold) == float(b.threshold) or (math.isinf(float(a.threshold)) and math.isinf(float(b.threshold)))
    assert torch.equal(a.scalers.cpu(), b.scalers.cpu())
    assert bool(a.nonfinite) == bool(b.nonfinite)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bucket", [0, 7, 512, 3000])     # 3000: a bucket longer than a C chunk
@pytest.mark.parametrize("fmt", ["2bit", "base3"])
def test_fused_matches_reference_bytes(fused, n, bucket, fmt):
    payloads_ref, payloads_fused = [], []
    for rank in range(3):
        g = sample(n, seed=n * 7 + rank) * (rank + 1)
        pr = REFERENCE.prepare(g, bucket, 2.5)
        pf = fused.prepare(g, bucket, 2.5)
        assert_same_prep(pr, pf)
        key = C.stream_key(9, 4, C.tensor_id("w"), rank)
        a = REFERENCE.encode(g, pr.threshold, pr.scalers, bucket, key, fmt, shape=(n,))
        b = fused.encode(g, pf.threshold, pf.scalers, bucket, key, fmt, shape=(n,))
        assert torch.equal(a, b)
        payloads_ref.append(a)
        # the same tensor ternarized with a shared (larger) scaler
        shared = pr.scalers * 1.5
        a2 = REFERENCE.encode(g, pr.threshold, shared, bucket, key, fmt)
        b2 = fused.encode(g, pf.threshold, shared, bucket, key, fmt)
        assert torch.equal(a2, b2)
        payloads_fused.append(a2)
    for payloads in (payloads_ref, payloads_fused):   # per-rank scalers, then shared ones
        gathered = torch.cat(payloads)
        headers, offsets = packing.walk(gathered, len(payloads))
        for divisor in (3, 1):
            ref = REFERENCE.decode(gathered, headers, offsets, divisor)
            assert torch.equal(fused.decode(gathered, headers, offsets, divisor), ref)


def test_nonfinite_detected_from_sums(fused):
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = sample(5000, 1)
        g[4321] = bad
        assert REFERENCE.prepare(g, 0, 2.5).nonfinite.item() is True
        p = fused.prepare(g, 0, 2.5)
        assert p.nonfinite.item() is True and p.scalers.tolist() == [0.0]
    big = torch.full((1000,), 3.0e38)   # finite fp32 whose squares overflow fp32 but not fp64
    assert fused.prepare(big, 0, 2.5).nonfinite.item() is False
    assert REFERENCE.prepare(big, 0, 2.5).nonfinite.item() is False


def test_threshold_host_and_device_agree():
    for seed in range(50):
        g = sample(3001, seed) * 10 ** (seed % 7 - 3)
        st = C.tensor_stats(g)
        dev = C.clip_threshold(st, 2.5).item()
        host = C.ternary.clip_threshold_host(st.numel, st.sum.item(), st.sumsq.item(), 2.5)
        assert dev == host


@pytest.mark.parametrize("n,bucket", [(0, 0), (1, 0), (5000, 0), (5000, 512)])
@pytest.mark.parametrize("bad", [False, True])
def test_prepared_holds_0d_tensors_on_the_gradient_device(fused, n, bucket, bad):
    g = sample(n, 3)
    if bad and n:
        g[n // 2] = float("nan")
    for be in (REFERENCE, fused):
        p = be.prepare(g, bucket, 2.5)
        assert isinstance(p.threshold, torch.Tensor) and p.threshold.shape == () and p.threshold.dtype == torch.float32
        assert isinstance(p.nonfinite, torch.Tensor) and p.nonfinite.shape == () and p.nonfinite.dtype == torch.bool
        assert p.scalers.dtype == torch.float32 and p.scalers.shape == (C.num_buckets(n, bucket),)
        assert p.threshold.device == p.nonfinite.device == p.scalers.device == g.device
        assert p.nonfinite.item() is (bad and n > 0), be.name


def test_backends_declare_their_capabilities(fused):
    assert isinstance(REFERENCE, Backend) and isinstance(fused, Backend)
    assert REFERENCE.capabilities == frozenset() and not has_capability(REFERENCE, SHARDED_SUMS)
    assert fused.capabilities == frozenset({SHARDED_SUMS, NOISE_DECODE, ADAM_CORRECTED, REQUANT, NEAREST, SQUARE_SUMS})
    assert isinstance(fused, SquareSumsBackend) and not has_capability(REFERENCE, SQUARE_SUMS)
    assert isinstance(fused, NearestBackend) and not has_capability(REFERENCE, NEAREST)
    assert has_capability(fused, SHARDED_SUMS) and has_capability(fused, ADAM_CORRECTED)
    assert not has_capability(REFERENCE, ADAM_CORRECTED) and isinstance(fused, AdamCorrectedBackend)
    assert has_capability(fused, NOISE_DECODE) and not has_capability(REFERENCE, NOISE_DECODE)
    assert isinstance(fused, ShardedSumsBackend) and not isinstance(REFERENCE, ShardedSumsBackend)
    assert isinstance(fused, NoiseDecodeBackend) and not isinstance(REFERENCE, NoiseDecodeBackend)


@pytest.mark.parametrize("n", [0, 1, 4, 5, 1279, 1280, 1281, 65537])
@pytest.mark.parametrize("fmt", ["2bit", "base3"])
@pytest.mark.parametrize("bucket", [0, 128, 1000])
def test_fused_nearest_rounding_matches_reference_bytes(fused, n, fmt, bucket):
    """The owner-step exchange's weight differences: the fused pass's payload is codec/nearest.py's, ties (2|d| = s)
    and zeros included, with one scaler or one per bucket (a tensor of one bucket says 0 in its header)."""
    d = sample(n, 11)
    if n > 4:
        d[1] = d.abs().max() / 2          # a tie: rounds to +-1
        d[2] = -d[1]
        d[3] = torch.nextafter(d[1], torch.tensor(0.0))      # just under the tie: 0
    assert torch.equal(fused.encode_nearest(d, fmt, bucket), nearest.encode_nearest(d, fmt, bucket))
    if n:
        zeros = torch.zeros(n)
        assert torch.equal(fused.encode_nearest(zeros, fmt, bucket), nearest.encode_nearest(zeros, fmt, bucket))


@pytest.mark.parametrize("bounds", [[(0, 1)], [(0, 8)], [(0, 9)], [(0, 65)], [(0, 70001)],
                                    [(0, 3), (3, 6), (6, 9), (9, 11)], [(0, 0), (0, 5000), (5000, 10000), (10000, 10000)],
                                    [(0, 4096), (4096, 8192), (8192, 9000), (9000, 70001)]])
@pytest.mark.parametrize("thr", [0.5, float("inf")])
def test_fused_clipped_square_sums_match_reference_bits(fused, bounds, thr):
    """The senders' squares: the fused pass sums each run of equal shards in ordered_row_sums' order, bit for bit."""
    g = sample(70001, 12)
    t = torch.tensor(thr, dtype=torch.float32)
    want = squares.clipped_square_sums(g, t, bounds)
    got = fused.clipped_square_sums(g, t, bounds)
    assert got.dtype == torch.float32 and torch.equal(got, want), (got, want)
    bf = g.to(torch.bfloat16)
    assert torch.equal(fused.clipped_square_sums(bf, t, bounds), squares.clipped_square_sums(bf, t, bounds))


def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("HOROVOD_TERNGRAD_CACHE", str(tmp_path))
    assert cache_dir() == str(tmp_path / "cpu")
    so = cpu.build()
    mtime = tmp_path.joinpath("cpu").stat().st_mtime_ns
    assert so.startswith(str(tmp_path)) and so.endswith(".so")
    assert cpu.build() == so                          # second call: found in the cache
    assert [p.name for p in (tmp_path / "cpu").iterdir()] == [so.rsplit("/", 1)[1]]   # no temp files left
    assert tmp_path.joinpath("cpu").stat().st_mtime_ns == mtime


def test_missing_compiler_falls_back_with_a_warning(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("HOROVOD_TERNGRAD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level("WARNING", logger="horovod_terngrad"):
        assert cpu.load() is None
    assert "fused CPU codec unavailable" in caplog.text


@pytest.mark.parametrize("fmt", ["2bit", "base3"])
def test_counting_decode_with_more_payloads_than_one_lane_group(fused, fmt):
    # base3 lanes hold sums of up to 2047 payloads; more are decoded group by group
    n, N = 23, 2100
    gen = torch.Generator().manual_seed(0)
    s = torch.tensor([0.75])
    pays = [packing.assemble(C.pack(torch.randint(-1, 2, (n,), generator=gen, dtype=torch.int8), fmt), n, fmt, s, 0)
            for _ in range(N)]
    gathered = torch.cat(pays)
    headers, offsets = packing.walk(gathered, N)
    want = REFERENCE.decode(gathered, headers, offsets, N)
    assert torch.equal(fused.decode(gathered, headers, offsets, N), want)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 1279, 1280, 1283, 6401])
def test_two_payload_decode_matches_reference_for_every_byte(fused, n):
    # two 2bit payloads with per-rank scalers (the allgather exchange at N = 2) take the fused backend's
    # two-payload table; every byte value, the invalid code 3 among them, and a last partial byte
    gen = torch.Generator().manual_seed(n)
    pays = []
    for _ in range(2):
        p = packing.encode(torch.zeros(n, dtype=torch.int8), "2bit", torch.rand(1, generator=gen) + 0.1, 0)
        start = C.sizes.codes_offset(1)
        p[start:] = torch.randint(0, 256, (p.numel() - start,), dtype=torch.uint8, generator=gen)
        pays.append(p)
    gathered = torch.cat(pays)
    headers, offsets = packing.walk(gathered, 2)
    for divisor in (2, 1, 3):
        want = REFERENCE.decode(gathered, headers, offsets, divisor)
        assert torch.equal(fused.decode(gathered, headers, offsets, divisor).view(torch.int32), want.view(torch.int32))
    # the noise decode reads codes as |t| with squared scalers: the reference's decode of those mapped payloads
    mapped = [p.clone() for p in pays]
    for p in mapped:
        sc = p[packing.HEADER_BYTES:C.sizes.codes_offset(1)].view(torch.float32)
        sc.mul_(sc)
        codes = p[C.sizes.codes_offset(1):]
        codes.bitwise_or_(codes >> 1).bitwise_and_(0x55)
    want = REFERENCE.decode(torch.cat(mapped), headers, offsets, 4.0)
    assert torch.equal(fused.decode_noise(gathered, headers, offsets, 2).view(torch.int32), want.view(torch.int32))


def test_thread_count_does_not_change_bytes(fused):
    g = sample(3_000_001, 4)
    key = C.stream_key(0, 0, 0, 0)
    old = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            p = fused.prepare(g, 0, 2.5)
            results.append((p.threshold, p.scalers, fused.encode(g, p.threshold, p.scalers, 0, key, "2bit")))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][2], results[1][2])


@pytest.mark.parametrize("N", [2, 3, 5, 64, 200])      # sum widths 3, 3, 4, 8 and 9 bits
@pytest.mark.parametrize("m", [1, 7, 8, 1283, 2 * 1280 + 13])
@pytest.mark.parametrize("fmt", ["2bit", "base3"])
def test_sharded_owner_sums_and_decode_match_reference(fused, N, m, fmt, monkeypatch):
    """The fused one-pass owner sums (code sums packed in L bits, chunked over threads) and the fused
    decode of the gathered sums give the torch reference's bytes and floats, for every sum width."""
    from horovod_terngrad.exchange import sharded
    gen = torch.Generator().manual_seed(N * 1000 + m)
    chunks = [C.pack(torch.randint(-1, 2, (m,), generator=gen, dtype=torch.int8), fmt) for _ in range(N)]
    received = torch.cat(chunks)
    bits = sharded.sum_bits(N)
    want = sharded.owner_sums_reference(received, N, m, chunks[0].numel(), fmt)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(fused.owner_sums(received, N, m, fmt, bits), want), threads
    finally:
        torch.set_num_threads(old)
    # decode: an n-element tensor whose shards' sums were gathered (bucketed scalers too)
    n = N * m - (m // 2)
    bounds = sharded.shard_bounds(n, N)
    parts = [sharded.pack_bits(torch.randint(0, 2 * N + 1, (hi - lo,), generator=gen), bits) for lo, hi in bounds]
    gathered = torch.cat(parts)
    for scalers, bucket in ((torch.tensor([0.3]), 0), (torch.rand(-(-n // 7), generator=gen) + 0.1, 7),
                            (torch.rand(-(-n // 1500), generator=gen) + 0.1, 1500)):
        got = sharded.decode_gathered(gathered, n, N, scalers, bucket, float(N))
        monkeypatch.setattr(sharded, "_fused", lambda device: None)
        ref = sharded.decode_gathered(gathered, n, N, scalers, bucket, float(N))
        monkeypatch.undo()
        assert torch.equal(got, ref)


def test_short_gathered_sums_are_refused_before_any_byte_is_read(fused):
    from horovod_terngrad.exchange import sharded
    n, N = 1000, 4
    full = sum(-(-(hi - lo) * sharded.sum_bits(N) // 8) for lo, hi in sharded.shard_bounds(n, N))
    with pytest.raises(ValueError, match="expected"):
        sharded.decode_gathered(torch.zeros(full - 1, dtype=torch.uint8), n, N, torch.ones(1), 0, 4.0)
