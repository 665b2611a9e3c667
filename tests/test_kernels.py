"""kernels/terngrad.cu: compiled by nvcc for the GPUs we support, and checked without a GPU by
building the same source for the host (backends/host_build.py with kernels/host_shim.h) and comparing its
bytes with the reference codec.  The CuPy tests run where CUDA is available."""
import os
import shutil
import subprocess

import pytest
import torch

from horovod_terngrad import TernGradConfig
from horovod_terngrad import codec as C
from horovod_terngrad.backends import REFERENCE, cpu_fused
from horovod_terngrad.backends.cuda import NVCC_OPTIONS, SIGNATURES, SOURCE, KernelBackend
from horovod_terngrad.backends.host_build import HostKernels
from horovod_terngrad.codec import packing
from test_requant_kernel import EXTREME_CASES, check_extreme_shard

ARCHS = ["sm_75", "sm_80", "sm_90"]   # CUDA 13 (installed here) no longer builds sm_70
SIZES = [0, 1, 3, 4, 5, 7, 8, 9, 255, 256, 257, 2047, 2048, 2049, 65535, 65537, (1 << 22) + 1]


@pytest.fixture(scope="module")
def host():
    return KernelBackend(HostKernels())


def _nvcc():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc is required in CI to compile kernels/*.cu")
        pytest.skip("nvcc not installed")
    return nvcc


@pytest.mark.slow
@pytest.mark.one_process
@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_every_kernel(tmp_path, arch):
    nvcc = _nvcc()
    kernels = sorted(f for f in os.listdir(os.path.dirname(SOURCE)) if f.endswith(".cu"))
    assert kernels == ["adam.cu", "terngrad.cu"]    # adam.cu: tests/test_adam_kernel.py
    out = tmp_path / f"terngrad.{arch}.cubin"
    opts = [o for o in NVCC_OPTIONS]
    # a register spill (local memory traffic in a bandwidth-bound kernel) fails the build too
    p = subprocess.run([nvcc, f"-arch={arch}", "-cubin", *opts, "-Werror", "all-warnings", "-Xptxas",
                        "--warn-on-spills", SOURCE, "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert out.stat().st_size > 1000
    names = subprocess.run(["strings", str(out)], capture_output=True, text=True).stdout
    for k in SIGNATURES:
        assert k in names



def _nvrtc():
    """libnvrtc (what CuPy compiles with): $NVRTC_LIBRARY, the nvidia-cuda-nvrtc wheels' copies, or the system's."""
    import ctypes
    import ctypes.util
    import glob
    import site
    found = [os.environ.get("NVRTC_LIBRARY", "")]
    for d in site.getsitepackages():
        found += sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", "libnvrtc.so*")))
    found.append(ctypes.util.find_library("nvrtc") or "")
    for path in filter(None, found):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    pytest.skip("libnvrtc not found (CuPy's compiler; set NVRTC_LIBRARY or pip install nvidia-cuda-nvrtc)")


@pytest.mark.slow
@pytest.mark.one_process
@pytest.mark.parametrize("source", ["terngrad.cu", "adam.cu"])
def test_nvrtc_compiles_every_kernel_with_cupys_options(source):
    """CuPy builds the kernels with NVRTC, not nvcc: no host headers, and the options CuPy is given."""
    import ctypes
    from horovod_terngrad.backends import cuda_adam
    lib = _nvrtc()
    opts = {"terngrad.cu": NVCC_OPTIONS, "adam.cu": cuda_adam.NVCC_OPTIONS}[source]
    path = os.path.join(os.path.dirname(SOURCE), source)
    for arch in ("compute_80", "compute_90"):
        prog = ctypes.c_void_p()
        with open(path, "rb") as f:
            assert lib.nvrtcCreateProgram(ctypes.byref(prog), f.read(), source.encode(), 0, None, None) == 0
        args = [o.encode() for o in (*opts, f"--gpu-architecture={arch}")]
        rc = lib.nvrtcCompileProgram(prog, len(args), (ctypes.c_char_p * len(args))(*args))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        assert rc == 0, f"{source} for {arch}: {log.value.decode(errors='replace')}"

def sample(n, seed):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if n > 20:
        g[n // 5] = -30.0
    return g


# the bucketed variant runs on the smaller sizes only, and 4M elements in 2bit only: host emulation of 4M elements
# is slow (the packings share the statistics and the word loop).  Buckets of 3 and 7 elements straddle packed
# bytes (4 or 5 elements), and 3 is shorter than one: the kernels find each element's bucket per word, stepping
# across boundaries
CASES = ([(n, 0, fmt) for n in SIZES for fmt in ("2bit", "base3") if n < 100_000 or fmt == "2bit"]
         + [(n, b, fmt) for n in SIZES if n < 100_000 for b in (3, 7, 100) for fmt in ("2bit", "base3")])


@pytest.mark.parametrize("n,bucket,fmt", CASES)
def test_host_built_kernels_match_reference_and_fused_cpu(host, n, bucket, fmt):
    fused = cpu_fused()
    per_rank, shared_pay = [], []
    for rank in range(2):
        g = sample(n, n + rank) * (1 + rank)
        a, k = REFERENCE.prepare(g, bucket, 2.5), host.prepare(g, bucket, 2.5)
        assert torch.equal(a.threshold, k.threshold) and torch.equal(a.scalers, k.scalers)
        assert bool(a.nonfinite) == bool(k.nonfinite)
        key = C.stream_key(5, 1, C.tensor_id("x"), rank)
        ref = REFERENCE.encode(g, a.threshold, a.scalers, bucket, key, fmt)
        assert torch.equal(host.encode(g, k.threshold, k.scalers, bucket, key, fmt), ref)
        assert torch.equal(fused.encode(g, float(a.threshold), a.scalers, bucket, key, fmt), ref)
        assert torch.equal(fused.encode(g, a.threshold, a.scalers, bucket, key, fmt), ref)
        per_rank.append(ref)
        shared_pay.append(REFERENCE.encode(g, a.threshold, a.scalers * 0 + 2.0, bucket, key, fmt))
    for pays in (per_rank, shared_pay):
        x = torch.cat(pays)
        h, o = packing.walk(x, 2)
        want = REFERENCE.decode(x, h, o, 2)
        assert torch.equal(host.decode(x, h, o, 2), want)
        assert torch.equal(fused.decode(x, h, o, 2), want)


@pytest.mark.parametrize("cfg", [dict(), dict(packing="base3", bucket_size=50), dict(shared_scaler=False)])
def test_kernel_driver_in_fused_and_single_exchanges(host, monkeypatch, cfg):
    """The CUDA driver code (KernelBackend: device-resident scalers and NaN flags, decode at arbitrary
    payload offsets) run through the exchange on 3 thread-ranks, with the host build of the kernels:
    a fused group (payloads of several tensors interleaved by rank) and a tensor alone give the
    reference's averages bit for bit."""
    import horovod_terngrad.backends as B
    from helpers import expected_average
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.exchange import Engine, run_ranks
    monkeypatch.setattr(B, "for_device", lambda device: host)
    config = TernGradConfig(seed=4, **cfg)
    shapes = [(30, 7), (5,), (0,), (300,)]

    def grads(rank):
        return [sample(int(torch.Size(s).numel()), 10 * rank + i).reshape(s) for i, s in enumerate(shapes)]

    def body(c):
        ex = Engine(c, config)
        fused = [ex.finish(t) for t in ex.start_group([(g, f"k{i}") for i, g in enumerate(grads(c.rank))], "grp")]
        alone = ex.allreduce(grads(c.rank)[0] * 3, "alone")
        return fused, alone

    res = run_ranks(3, body)
    monkeypatch.undo()
    for i in range(len(shapes)):
        want, _ = expected_average([grads(r)[i] for r in range(3)], f"k{i}", 0, config)
        assert all(torch.equal(r[0][i], want) for r in res), i
    want, _ = expected_average([grads(r)[0] * 3 for r in range(3)], "alone", 0, config)
    assert all(torch.equal(r[1], want) for r in res)


def test_host_kernels_flag_nonfinite(host):
    g = sample(5000, 3)
    g[17] = float("nan")
    p = host.prepare(g, 0, 2.5)
    assert p.nonfinite.item() and p.scalers.tolist() == [0.0]


def test_kernel_backend_declares_its_capabilities(host):
    from horovod_terngrad.backends import BF16_INPUT, REQUANT, SHARDED_SUMS, Backend, ShardedSumsBackend, has_capability
    assert isinstance(host, Backend) and isinstance(host, ShardedSumsBackend) and host.name == "host-kernels"
    assert host.capabilities == frozenset({BF16_INPUT, SHARDED_SUMS, REQUANT}) and has_capability(host, REQUANT)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("n", [1, 5, 2049, 10_000_019])
@pytest.mark.parametrize("fmt", ["2bit", "base3"])
def test_cupy_kernels_match_reference(n, fmt):
    from horovod_terngrad.backends import cuda_kernels
    be = cuda_kernels()
    assert be is not None, "CuPy kernels failed to load on a CUDA machine"
    g = sample(n, 1).cuda()
    a, k = REFERENCE.prepare(g.cpu(), 0, 2.5), be.prepare(g, 0, 2.5)
    assert torch.equal(a.threshold, k.threshold.cpu()) and torch.equal(a.scalers, k.scalers.cpu())
    key = C.stream_key(1, 2, 3, 0)
    ref = REFERENCE.encode(g.cpu(), a.threshold, a.scalers, 0, key, fmt)
    got = be.encode(g, k.threshold, k.scalers, 0, key, fmt)
    assert torch.equal(got.cpu(), ref)
    x = torch.cat([got, got])
    h, o = packing.walk(x, 2)
    assert torch.equal(be.decode(x, h, o, 2).cpu(), REFERENCE.decode(x.cpu(), h, o, 2))


def test_traffic_counts_the_bytes_each_path_moves_per_element():
    from horovod_terngrad.backends.cuda import traffic
    assert traffic("compress") == 8.25                                    # 4 + 4 + 1/4
    assert traffic("compress", in_bytes=2, fmt="base3") == pytest.approx(4.2)
    assert traffic("decode", payloads=2) == 4.5
    assert traffic("decode", fmt="base3", payloads=5) == 5.0
    with pytest.raises(ValueError, match="op"):
        traffic("copy")
    with pytest.raises(ValueError, match="fmt"):
        traffic("compress", fmt="4bit")


def _same_compress(backend, g, bucket, fmt, want_g=None):
    """backend's prepare + encode of g give the reference's threshold, scalers, NaN flag and payload of want_g
    (default: g itself)."""
    want_g = g if want_g is None else want_g
    a, k = REFERENCE.prepare(want_g, bucket, 2.5), backend.prepare(g, bucket, 2.5)
    assert torch.equal(a.threshold, k.threshold) and torch.equal(a.scalers, k.scalers)
    assert bool(a.nonfinite) == bool(k.nonfinite)
    key = C.stream_key(7, 3, C.tensor_id("w"), 1)
    want = REFERENCE.encode(want_g, a.threshold, a.scalers, bucket, key, fmt)
    assert torch.equal(backend.encode(g, k.threshold, k.scalers, bucket, key, fmt), want)
    return want


@pytest.mark.parametrize("n,bucket", [(1, 0), (15, 0), (17, 0), (21, 4), (2049, 0), (4133, 16), (4133, 100),
                                      (9001, 3)])
@pytest.mark.parametrize("fmt", ["2bit", "base3"])
def test_bf16_gradients_give_the_bytes_of_their_fp32_copy(host, n, bucket, fmt):
    g = sample(n, n).to(torch.bfloat16)
    _same_compress(host, g, bucket, fmt, want_g=g.float())


@pytest.mark.parametrize("dtype,shift", [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 1),
                                         (torch.bfloat16, 2), (torch.bfloat16, 3)])
@pytest.mark.parametrize("fmt", ["2bit", "base3"])
def test_gradients_off_the_vector_alignment_take_the_element_path(host, dtype, shift, fmt):
    """A view starting `shift` elements into its storage is not aligned for 4-element vector loads (16 bytes of
    fp32, 8 of bf16): the same bytes come out, bucketed or not."""
    n = 3000
    buf = sample(n + shift, 11).to(dtype)
    g = buf[shift:]
    assert g.data_ptr() % (4 * g.element_size()) != 0
    for bucket in (0, 50):
        _same_compress(host, g, bucket, fmt, want_g=g.float())


@pytest.mark.parametrize("grid_limit,block", [(1, 1), (2, 3), (1, 64), (5, 7)])
@pytest.mark.parametrize("fmt", ["2bit", "base3"])
def test_any_grid_covers_any_size(grid_limit, block, fmt):
    """Grids of a single thread up to a few odd-sized blocks: every grid-stride loop goes round, and the bytes and
    the decode are the reference's."""
    be = KernelBackend(HostKernels(grid_limit=grid_limit, block=block))
    for n, bucket in ((37, 0), (5003, 0), (5003, 9)):
        pays = [_same_compress(be, sample(n, r) * (r + 1), bucket, fmt) for r in range(3)]
        x = torch.cat(pays)
        h, o = packing.walk(x, 3)
        assert torch.equal(be.decode(x, h, o, 3), REFERENCE.decode(x, h, o, 3))


@pytest.mark.parametrize("fmt", ["2bit", "base3"])
@pytest.mark.parametrize("bucket", [0, 7, 64])
def test_decode_of_many_payloads_at_odd_offsets_into_an_unaligned_output(host, fmt, bucket):
    """Nine payloads of 1001 elements (a packed length that is no multiple of 4: most payloads start at a byte
    offset that is no multiple of 4, so their words are read byte by byte), per-rank and shared scalers (and shared
    but for the last bucket of one payload, which makes the whole decode per-rank), written into an output view
    that is not 16-byte aligned."""
    n, npay = 1001, 9
    per_rank, shared, all_but_one = [], [], []
    for r in range(npay):
        g = sample(n, 100 + r) * (1 + r % 3)
        p = REFERENCE.prepare(g, bucket, 2.5)
        key = C.stream_key(1, 2, 3, r)
        per_rank.append(REFERENCE.encode(g, p.threshold, p.scalers, bucket, key, fmt))
        shared.append(REFERENCE.encode(g, p.threshold, p.scalers * 0 + 0.75, bucket, key, fmt))
        s = p.scalers * 0 + 0.75
        if r == 5:
            s[-1] = 0.5
        all_but_one.append(REFERENCE.encode(g, p.threshold, s, bucket, key, fmt))
    for pays in (per_rank, shared, all_but_one):
        x = torch.cat(pays)
        h, o = packing.walk(x, npay)
        assert any((off + packing.codes_offset(h[0].num_scalers)) % 4 for off in o)
        want = REFERENCE.decode(x, h, o, npay)
        buf = torch.full((n + 1,), 5.0)
        got = host.decode(x, h, o, npay, out=buf[1:])
        assert got.data_ptr() % 16 != 0 and torch.equal(got, want) and buf[0] == 5.0


def test_base3_bytes_above_242_decode_to_zero(host):
    """No valid base-3 byte exceeds 242 (3^5 - 1); the kernels' decode reads such a byte as five zeros, as the
    fused CPU decode does."""
    g = sample(40, 1)
    p = REFERENCE.prepare(g, 0, 2.5)
    pay = REFERENCE.encode(g, p.threshold, p.scalers, 0, C.stream_key(0, 0, 0, 0), "base3").clone()
    start = packing.codes_offset(1)
    pay[start:start + 8] = torch.arange(243, 251, dtype=torch.uint8)
    h, o = packing.walk(pay, 1)
    want = cpu_fused().decode(pay, h, o, 1)
    assert torch.equal(want[:40], torch.zeros(40)) and torch.equal(host.decode(pay, h, o, 1), want)


@pytest.mark.parametrize("case", ["constant", "single", "tiny", "huge", "mixed", "zeros", "inf", "nan_bf16"])
@pytest.mark.parametrize("clip", [2.5, 0.0, -1.0, 1e-3])
def test_threshold_and_scalers_are_computed_on_the_device_as_the_codec_does(host, case, clip):
    """tg_tree's last launch evaluates codec.clip_threshold and local_scalers: the same fp32 bits on inputs where
    the variance is 0, rounds to 0, overflows to no clipping, or the tensor holds Inf/NaN."""
    n = 3001
    g = {"constant": torch.full((n,), 0.3), "single": torch.tensor([-2.0]), "tiny": sample(n, 1) * 1e-30,
         "huge": sample(n, 2) * 1e36, "mixed": torch.cat([sample(n, 3) * 1e-20, torch.tensor([1e20])]),
         "zeros": torch.zeros(n), "inf": sample(n, 4).index_fill(0, torch.tensor([9]), float("inf")),
         "nan_bf16": sample(n, 5).index_fill(0, torch.tensor([2999]), float("nan")).to(torch.bfloat16)}[case]
    for bucket in (0, 1000):
        a, k = REFERENCE.prepare(g.float(), bucket, clip), host.prepare(g, bucket, clip)
        assert torch.equal(a.threshold, k.threshold), (a.threshold, k.threshold)
        assert torch.equal(a.scalers, k.scalers) and bool(a.nonfinite) == bool(k.nonfinite)


@pytest.mark.parametrize("m", [4, 8, 9, 64, 65, 511, 4096, 4097, 40_000, 300_001])
def test_tree_launches_reduce_partials_in_the_codecs_order(m):
    """Launch by launch as prepare plans them (one level, or two in one thread), tg_tree gives the sums that
    codec.ternary.combine_blocks gives level by level, and the max of the maxima."""
    from horovod_terngrad.backends.cuda import tree_plan
    k = HostKernels(grid_limit=4, block=16)
    gen = torch.Generator().manual_seed(m)
    s, q = torch.randn(m, generator=gen, dtype=torch.float64), torch.rand(m, generator=gen, dtype=torch.float64)
    mx = torch.rand(m, generator=gen)
    plan = tree_plan(m)
    levels, x = 0, m
    while x > 1:
        x, levels = -(-x // 8), levels + 1
    assert sum(plan) == levels and all(step in (1, 2) for step in plan)
    prep, flag = torch.empty(2), torch.empty((), dtype=torch.bool)
    for i, step in enumerate(plan):
        size = -(-s.numel() // 8 ** step)
        os_, oq, om = torch.empty(size, dtype=torch.float64), torch.empty(size, dtype=torch.float64), torch.empty(size)
        last = i == len(plan) - 1
        k.launch("tg_tree", size, [s, q, mx, s.numel(), step, os_, oq, om, 10 ** 9, 2.5, 1,
                                   prep if last else None, flag if last else None])
        s, q, mx = os_, oq, om
    assert s.numel() == 1
    gen = torch.Generator().manual_seed(m)
    s0, q0 = torch.randn(m, generator=gen, dtype=torch.float64), torch.rand(m, generator=gen, dtype=torch.float64)
    mx0 = torch.rand(m, generator=gen)
    assert torch.equal(s[0], C.ternary.combine_blocks(s0)) and torch.equal(q[0], C.ternary.combine_blocks(q0))
    assert mx[0] == mx0.max()
    st = C.TensorStats(10 ** 9, s[0], q[0], mx, torch.tensor(False))
    thr = C.clip_threshold(st, 2.5)
    assert torch.equal(prep[0], thr) and torch.equal(prep[1], C.local_scalers(st, thr)[0]) and not flag


@pytest.mark.parametrize("fmt", ["2bit", "base3"])
def test_codes_written_to_an_unaligned_region_are_stored_byte_by_byte(fmt):
    """tg_pack writes each word of codes with one 32-bit store where the region is 4-byte aligned (a payload's
    region always is: header and scalers take multiples of 4 bytes) and byte by byte elsewhere: the same bytes."""
    k = HostKernels()
    n = 1003
    g = sample(n, 8)
    p = REFERENCE.prepare(g, 0, 2.5)
    key = C.stream_key(3, 1, 4, 1)
    want = REFERENCE.encode(g, p.threshold, p.scalers, 0, key, fmt)[packing.codes_offset(1):]
    for shift in (0, 1, 2, 3):
        buf = torch.full((want.numel() + shift + 1,), 0xAB, dtype=torch.uint8)
        k.launch("tg_pack_f32", -(-want.numel() // 4), [g, n, p.threshold.reshape(1), p.scalers, 0, key[0], key[1],
                                                          packing.FORMATS[fmt], buf[shift:]])
        assert torch.equal(buf[shift:shift + want.numel()], want)
        assert (buf[:shift] == 0xAB).all() and buf[-1] == 0xAB             # nothing written outside the region


@pytest.mark.parametrize("cfg", [dict(), dict(packing="base3", bucket_size=50), dict(shared_scaler=False)])
def test_engine_hands_bf16_gradients_to_the_kernels_without_an_fp32_copy(host, monkeypatch, cfg):
    """bf16 gradients (fused group and alone, 2 thread-ranks) go to a backend with BF16_INPUT as they are: the
    averages are those of their fp32 copies through the fused CPU backend, in bf16, and no ticket of the default
    path made an fp32 copy."""
    import horovod_terngrad.backends as B
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.exchange import Engine, run_ranks
    config = TernGradConfig(seed=9, min_numel=0, **cfg)
    shapes = [(30, 7), (5,), (333,)]

    def grads(rank, dtype):
        return [sample(int(torch.Size(s).numel()), 10 * rank + i).reshape(s).to(torch.bfloat16).to(dtype)
                for i, s in enumerate(shapes)]

    def run(dtype):
        def body(c):
            ex = Engine(c, config)
            tickets = ex.start_group([(g, f"k{i}") for i, g in enumerate(grads(c.rank, dtype))], "grp")
            outs = [ex.finish(t) for t in tickets]
            return outs, [t._g32 is None for t in tickets]
        return run_ranks(2, body)

    want = run(torch.float32)
    monkeypatch.setattr(B, "for_device", lambda device: host)
    got = run(torch.bfloat16)
    monkeypatch.undo()
    for r in range(2):
        assert all(o.dtype == torch.bfloat16 for o in got[r][0])
        assert all(torch.equal(o, w.to(torch.bfloat16)) for o, w in zip(got[r][0], want[r][0]))
        assert all(got[r][1]), "a ticket converted its bf16 gradient to fp32"


@pytest.mark.parametrize("N", [2, 3, 5, 64, 200])      # sum widths 3, 3, 4, 8 and 9 bits
@pytest.mark.parametrize("m", [1, 7, 8, 9, 1283])
@pytest.mark.parametrize("fmt", ["2bit", "base3"])
def test_host_built_owner_sums_and_their_decode_match_the_fused_cpu(host, N, m, fmt):
    """tg_owner_sums and tg_decode_sums (SHARDED_SUMS) give the fused CPU codec's bytes and floats, and the torch
    reference's, for every sum width, shards of any length and bucketed scalers."""
    from horovod_terngrad.exchange import sharded
    fused = cpu_fused()
    gen = torch.Generator().manual_seed(N * 1000 + m)
    chunks = [C.pack(torch.randint(-1, 2, (m,), generator=gen, dtype=torch.int8), fmt) for _ in range(N)]
    received = torch.cat(chunks)
    bits = sharded.sum_bits(N)
    want = sharded.owner_sums_reference(received, N, m, chunks[0].numel(), fmt)
    assert torch.equal(fused.owner_sums(received, N, m, fmt, bits), want)
    assert torch.equal(host.owner_sums(received, N, m, fmt, bits), want)
    n = N * m - (m // 2)
    bounds = sharded.shard_bounds(n, N)
    gathered = torch.cat([sharded.pack_bits(torch.randint(0, 2 * N + 1, (hi - lo,), generator=gen), bits)
                          for lo, hi in bounds])
    for scalers, bucket in ((torch.tensor([0.3]), 0), (torch.rand(-(-n // 7), generator=gen) + 0.1, 7),
                            (torch.rand(-(-n // 1500), generator=gen) + 0.1, 1500)):
        ref = C.decode_sums(sharded.gathered_sums(gathered, n, N), scalers, bucket, float(N))
        for be in (fused, host):
            out, off = torch.full((n,), 9.0), 0
            for (lo, hi), nbytes in zip(bounds, C.sizes.shard_sum_bytes(n, N)):
                be.decode_sums(gathered[off:off + nbytes], hi - lo, N, bits, scalers, bucket, lo, float(N), out[lo:hi])
                off += nbytes
            assert torch.equal(out, ref), (be.name, bucket)


def test_kernel_driver_in_the_sharded_exchange(host, monkeypatch):
    """exchange="sharded" on 3 thread-ranks with the host-built kernels doing compress, owner sums and the decode
    of the gathered sums: the fused CPU backend's averages bit for bit (bucketed and not, both packings)."""
    import horovod_terngrad.backends as B
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.exchange import Engine, run_ranks
    shapes = [(30, 7), (1001,), (333,)]
    for cfg in (dict(), dict(packing="base3", bucket_size=40)):
        config = TernGradConfig(seed=2, min_numel=0, exchange="sharded", **cfg)

        def body(c):
            ex = Engine(c, config)
            grads = [sample(int(torch.Size(s).numel()), 10 * c.rank + i).reshape(s) for i, s in enumerate(shapes)]
            return [ex.finish(t) for t in ex.start_group([(g, f"k{i}") for i, g in enumerate(grads)], "grp")]

        want = run_ranks(3, body)
        launched = []
        real_launch = host.k.launch
        monkeypatch.setattr(host.k, "launch", lambda name, work, args: (launched.append(name),
                                                                        real_launch(name, work, args)))
        monkeypatch.setattr(B, "for_device", lambda device: host)
        got = run_ranks(3, body)
        monkeypatch.undo()
        assert {"tg_owner_sums", "tg_decode_sums", "tg_pack_f32"} <= set(launched)
        for r in range(3):
            assert all(torch.equal(a, b) for a, b in zip(got[r], want[r])), (cfg, r)


REQUANT_SIZES = [0, 1, 2, 7, 8, 9, 127, 128, 129, 255, 257, 1023, 1025, 2049, 5000]


@pytest.mark.parametrize("m", REQUANT_SIZES)
@pytest.mark.parametrize("with_noise", [False, True], ids=["plain", "noise"])
def test_host_built_requant_kernels_give_the_reference_bytes_and_bits(host, m, with_noise):
    """tg_requant_encode / tg_requant_decode (REQUANT): codec/requant.py's payload and decoded values exactly, for
    short groups, odd counts, 0 and 1 elements, starts across 2^32, from a buffer at unaligned offsets."""
    from test_requant_kernel import decode_both, same_bits, shard
    from horovod_terngrad.codec import requant
    for seed, start, flags in ((0, 0, 0), (1, 40, 1), (2, (1 << 32) - 700, 0)):
        a, nu = shard(m, 31 * m + seed)
        keys = requant.keys(seed, 7 + seed, f"layer{seed}", seed % 3)
        noise = nu if with_noise else None
        want = requant.encode(a, keys, start, noise, flags=flags)
        got = host.requant_encode(a, keys, start, noise, flags=flags)
        assert torch.equal(got, want), (m, seed, (got != want).nonzero().flatten()[:8].tolist())
        (ro, rn), (ho, hn) = decode_both(host, want, m, with_noise, pad=1 + seed)
        assert same_bits(ho, ro) and same_bits(hn, rn)


@pytest.mark.parametrize("case", EXTREME_CASES)
def test_host_built_requant_kernels_on_non_finite_and_extreme_shards(host, case):
    check_extreme_shard(host, case)


@pytest.mark.parametrize("N", [2, 3])
def test_kernel_driver_in_the_requantized_exchange(host, monkeypatch, N):
    """exchange="requantized" on thread ranks with the host-built kernels doing every codec step (compress, the
    owner payload's encode and decode): the payloads, averages and noise estimates of the torch reference."""
    import horovod_terngrad.backends as B
    from test_requant_kernel import _run, same_bits
    from horovod_terngrad.codec import requant
    cfg = TernGradConfig(exchange="requantized", packing="base3", bucket_size=64, seed=4)
    calls = []
    monkeypatch.setattr(requant, "encode", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(B, "for_device", lambda device: host)
    got = _run(N, cfg)
    monkeypatch.undo()
    assert not calls                                       # the kernels took the owner payload
    monkeypatch.setenv("HOROVOD_TERNGRAD_BACKEND", "torch")
    want = _run(N, cfg)
    for r in range(N):
        assert len(got[r][2]) == len(want[r][2]) > 0
        assert all(torch.equal(p, q) for p, q in zip(got[r][2], want[r][2]))
        for step in range(2):
            for o, w in zip(got[r][0][step], want[r][0][step]):
                assert same_bits(o, w)
            for o, w in zip(got[r][1][step], want[r][1][step]):
                assert (o is None) == (w is None) and (o is None or same_bits(o, w))
