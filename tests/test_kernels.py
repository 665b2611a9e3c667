"""kernels/terngrad.cu: compiled by nvcc for the GPUs we support, and checked without a GPU by
building the same source for the host (backends/host_build.py with kernels/host_shim.h) and comparing its
bytes with the reference codec.  The CuPy tests run where CUDA is available."""
import os
import shutil
import subprocess

import pytest
import torch

from horovod_terngrad import codec as C
from horovod_terngrad.backends import REFERENCE, cpu_fused
from horovod_terngrad.backends.cuda import NVCC_OPTIONS, SIGNATURES, SOURCE, KernelBackend
from horovod_terngrad.backends.host_build import HostKernels
from horovod_terngrad.codec import packing

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


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_every_kernel(tmp_path, arch):
    nvcc = _nvcc()
    kernels = sorted(f for f in os.listdir(os.path.dirname(SOURCE)) if f.endswith(".cu"))
    assert kernels == ["terngrad.cu"]
    out = tmp_path / f"terngrad.{arch}.cubin"
    opts = [o for o in NVCC_OPTIONS]
    p = subprocess.run([nvcc, f"-arch={arch}", "-cubin", *opts, "-Werror", "all-warnings", SOURCE, "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert out.stat().st_size > 1000
    names = subprocess.run(["strings", str(out)], capture_output=True, text=True).stdout
    for k in SIGNATURES:
        assert k in names


def sample(n, seed):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if n > 20:
        g[n // 5] = -30.0
    return g


# the bucketed variant runs on the smaller sizes only: host emulation of 4M elements is slow.  Buckets of 3
# and 7 elements straddle packed bytes (4 or 5 elements), and 3 is shorter than one: the kernels find each
# element's bucket per byte, stepping across boundaries
CASES = [(n, 0) for n in SIZES] + [(n, b) for n in SIZES if n < 100_000 for b in (3, 7, 100)]


@pytest.mark.parametrize("n,bucket", CASES)
@pytest.mark.parametrize("fmt", ["2bit", "base3"])
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


def test_kernel_backend_declares_no_capabilities(host):
    from horovod_terngrad.backends import SHARDED_SUMS, Backend, has_capability
    assert isinstance(host, Backend) and host.name == "host-kernels"
    assert host.capabilities == frozenset() and not has_capability(host, SHARDED_SUMS)


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
