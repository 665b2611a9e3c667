"""kernels/adam.cu (horovod_terngrad.optim's default-mode update of many tensors in one launch): compiled by nvcc
for the GPUs we support, and checked without a GPU by building the same source for the host
(backends/cuda_adam.HostAdamKernel) and comparing its bytes with the fused CPU pass (kernels/terngrad_cpu.c,
tg_adam_corrected) and, through the optimizer, with its foreach ops.  The CuPy test runs where CUDA is available."""
import os
import re
import shutil
import subprocess

import pytest
import torch

from horovod_terngrad.backends import cpu_fused, cuda_adam
from horovod_terngrad.backends.compile_cache import kernel_source
from horovod_terngrad.exchange import precision
from horovod_terngrad.optim import AdamW, Adam
from horovod_terngrad.optim import adam as adam_module

ARCHS = ["sm_75", "sm_80", "sm_90"]
# around the kernel's chunk (32768 elements), and the sizes a model has: 0, 1, odd, a bias, several chunks
SIZES = [0, 1, 3, 31, 32, 33, 768, 32767, 32768, 32769, 70001]


@pytest.fixture(scope="module")
def host():
    return cuda_adam.HostAdamKernel(block=32)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_the_launchers_constants_are_the_sources():
    src = open(kernel_source("adam.cu")).read()
    assert int(re.search(r"#define TG_ADAM_CHUNK (\d+)", src).group(1)) == cuda_adam.CHUNK
    assert int(re.search(r"#define TG_ADAM_FIELDS (\d+)", src).group(1)) == cuda_adam.FIELDS


@pytest.mark.slow
@pytest.mark.one_process
@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_the_kernel_without_contractions(tmp_path, arch):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc is required in CI to compile kernels/*.cu")
        pytest.skip("nvcc not installed")
    ptx = tmp_path / f"adam.{arch}.ptx"
    p = subprocess.run([nvcc, f"-arch={arch}", "-ptx", *cuda_adam.NVCC_OPTIONS, "-Werror", "all-warnings",
                        kernel_source("adam.cu"), "-o", str(ptx)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    text = ptx.read_text()
    assert ".entry tg_adam_multi" in text
    assert "fma." not in text                                    # no contraction may change a rounding
    assert "sqrt.rn.f32" in text and "div.rn.f32" in text        # IEEE-rounded, as the CPU's


def _operands(sizes, seed, amsgrad):
    gen = torch.Generator().manual_seed(seed)
    r = lambda n, s=1.0: torch.randn(n, generator=gen) * s                # noqa: E731
    ops = []
    for k, n in enumerate(sizes):
        p, g = r(n, 0.1), r(n, 1e-2)
        m, v, nn = r(n, 1e-3), r(n, 1e-4).abs(), r(n, 1e-5).abs()
        noise = None if k % 4 == 3 else torch.rand(n, generator=gen) * 1e-4
        vmax = (v * 1.5) if amsgrad else None
        gnorm = torch.linalg.vector_norm(g, dtype=torch.float32)
        # an average 0.7x the gradient (a clip after the exchange); one tensor's average all zeros (factor 1)
        anorm = torch.zeros(()) if k % 5 == 2 else torch.linalg.vector_norm(g / 0.7, dtype=torch.float32)
        ops.append(dict(p=p, m=m, v=v, n=nn, g=g, noise=noise, vmax=vmax, gnorm=gnorm, anorm=anorm,
                        step=1e-3 / (1 - 0.9 ** (k + 1)), ibs=1 / (1 - 0.95 ** (k + 2)) ** 0.5))
    return ops


@pytest.mark.parametrize("kw", [dict(), dict(amsgrad=True), dict(maximize=True, l2=0.1, decay=1.0, floor=0.01),
                                dict(floor=1.0, decay=1.0), dict(floor=0.0)],
                         ids=["adamw", "amsgrad", "adam-l2-maximize", "floor1", "floor0"])
def test_the_host_built_kernel_is_the_fused_cpu_pass_byte_for_byte(host, kw):
    """Every size around the chunk, with and without an estimate, in one launch; against tg_adam_corrected per
    tensor given the coefficient the host computes (optim/adam.py's arithmetic)."""
    be = cpu_fused()
    if be is None:
        pytest.skip("no C compiler: the fused CPU pass is not built")
    amsgrad = kw.get("amsgrad", False)
    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8, decay=kw.get("decay", 1 - 1e-3 * 0.1), l2=kw.get("l2", 0.0),
                 floor=kw.get("floor", 0.1), maximize=kw.get("maximize", False))
    ours, ref = _operands(SIZES, 0, amsgrad), _operands(SIZES, 0, amsgrad)
    cuda_adam.adam_multi(host, *([o[k] for o in ours] for k in ("p", "m", "v", "n", "g", "noise")),
                         [o["vmax"] for o in ours] if amsgrad else None, [o["gnorm"] for o in ours],
                         [o["anorm"] for o in ours], [o["step"] for o in ours], [o["ibs"] for o in ours], **hyper)
    for o in ref:
        coef = 0.0
        if o["noise"] is not None:
            at = float(o["anorm"].square())
            gn = float(o["gnorm"])
            coef = (1 - hyper["beta2"]) * ((gn * gn) / at if at > 0 else 1.0)
        be.adam_corrected(o["p"], o["m"], o["v"], o["n"], o["g"], o["noise"], o["vmax"], beta1=hyper["beta1"],
                          beta2=hyper["beta2"], step=o["step"], inv_bias2_sqrt=o["ibs"], eps=hyper["eps"],
                          decay=hyper["decay"], l2=hyper["l2"], noise_coef=coef, floor=hyper["floor"],
                          maximize=hyper["maximize"])
    fields = ("p", "m", "v", "n") + (("vmax",) if amsgrad else ())
    for size, a, b in zip(SIZES, ours, ref):
        for f in fields:
            assert _same_bits(a[f], b[f]), (size, f)
    assert not torch.equal(ours[-1]["p"], _operands(SIZES, 0, amsgrad)[-1]["p"])      # it did update


SHAPES = [(0,), (1,), (3,), (257, 129), (768,), (33, 1000), (64, 3, 5)]


def _run(cls, monkeypatch, path, dtype=torch.float32, steps=8, **kw):
    """``steps`` default-mode steps of ``cls`` on SHAPES through ``path``: 'kernel' (the host-built multi-tensor
    kernel), 'fused' (the C pass per tensor) or 'foreach'.  Some steps clip after the exchange, every fourth comes
    without an estimate, some hand the gradient over as the average itself."""
    monkeypatch.setattr(adam_module, "MULTI_TENSOR_KERNEL", cuda_adam.HostAdamKernel() if path == "kernel" else None)
    monkeypatch.setattr(adam_module, "FUSED_CPU", path == "fused")
    gen = torch.Generator().manual_seed(3)
    ws = [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dtype)) for s in SHAPES]
    opt = cls(ws, lr=3e-3, betas=(0.9, 0.95), **kw)
    ledger = opt.precision_ledger
    for k in range(steps):
        for w in ws:
            g = (torch.randn(w.shape, generator=gen) * 1e-2).to(dtype)
            noise = torch.rand(w.shape, generator=gen).to(dtype) * 1e-4
            ledger.set_record(w, precision.TERNARY)
            if k % 2 == 0:                   # the gradient is the average itself
                w.grad = g
                if k % 4 != 2:
                    ledger.put_noise(w, noise, w.grad)
            else:                            # clipped after the exchange
                ledger.put_noise(w, noise, g)
                w.grad = g * 0.7
        opt.step()
    return [w.detach().clone() for w in ws] + [opt.state[w]["exp_avg_noise"].clone() for w in ws if opt.state[w]]


@pytest.mark.parametrize("cls,kw", [(AdamW, {}), (AdamW, dict(amsgrad=True)), (Adam, dict(weight_decay=0.1)),
                                    (AdamW, dict(maximize=True, v_floor=0.01))],
                         ids=["adamw", "amsgrad", "adam-l2", "maximize"])
def test_the_optimizer_through_the_kernel_is_the_fused_cpu_pass_and_the_foreach_ops(cls, kw, monkeypatch):
    """The whole driver (grouping, step counts, the gradient's norm reused or taken, the table): byte for byte the
    fused CPU pass, and the foreach ops within fp32 rounding."""
    if cpu_fused() is None:
        pytest.skip("no C compiler: the fused CPU pass is not built")
    kernel, fused = _run(cls, monkeypatch, "kernel", **kw), _run(cls, monkeypatch, "fused", **kw)
    foreach = _run(cls, monkeypatch, "foreach", **kw)
    for a, b, c in zip(kernel, fused, foreach):
        assert _same_bits(a, b)
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-6)     # v - n cancels: its rounding shows
    assert not torch.equal(kernel[3], _run(cls, monkeypatch, "kernel", steps=0, **kw)[3])


def test_bf16_parameters_take_the_foreach_ops(monkeypatch):
    """The kernel is fp32 only: bf16 parameters go to the foreach ops, whatever kernel is set."""
    a, b = _run(AdamW, monkeypatch, "kernel", torch.bfloat16), _run(AdamW, monkeypatch, "foreach", torch.bfloat16)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[3].dtype == torch.bfloat16


@pytest.mark.parametrize("path", ["kernel", "fused"])
def test_a_clip_through_data_after_the_exchange_scales_the_noise(path, monkeypatch):
    """The gradient handed over as the average itself, then scaled through ``.data`` (a write its version counter
    does not see, as a fused clipping kernel's): the step takes its norm again, so the noise comes in scaled by
    the square, exactly as for a clipped copy."""
    if path == "fused" and cpu_fused() is None:
        pytest.skip("no C compiler: the fused CPU pass is not built")
    monkeypatch.setattr(adam_module, "MULTI_TENSOR_KERNEL", cuda_adam.HostAdamKernel() if path == "kernel" else None)
    monkeypatch.setattr(adam_module, "FUSED_CPU", path == "fused")
    out = []
    for through_data in (True, False):
        w = torch.nn.Parameter(torch.ones(1000))
        opt = AdamW([w], lr=1e-2)
        for k in range(3):
            avg = torch.linspace(-1, 1, 1000) * (k + 1)
            opt.precision_ledger.set_record(w, precision.TERNARY)
            if through_data:
                w.grad = avg
                opt.precision_ledger.put_noise(w, torch.full((1000,), 0.5), w.grad)
                w.grad.data.mul_(0.5)
            else:
                opt.precision_ledger.put_noise(w, torch.full((1000,), 0.5), avg)
                w.grad = avg * 0.5
            opt.step()
        out.append((w.detach().clone(), opt.state[w]["exp_avg_noise"].clone()))
    assert all(_same_bits(a, b) for a, b in zip(*out))
    torch.testing.assert_close(out[0][1], torch.full((1000,), 0.5 * 0.25 * (1 - 0.999 ** 3)), rtol=1e-5, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cupy_kernel_is_the_host_build(host):
    """On a GPU: NVRTC's build of the same source gives the host build's bytes."""
    pytest.importorskip("cupy")
    k = cuda_adam.kernel_for(torch.device("cuda"))
    assert k is not None
    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-8, decay=1 - 1e-4, l2=0.0, floor=0.1, maximize=False)
    cpu, dev = _operands(SIZES, 1, True), _operands(SIZES, 1, True)
    dev = [{f: (x.cuda() if isinstance(x, torch.Tensor) else x) for f, x in o.items()} for o in dev]
    for kernel, ops in ((host, cpu), (k, dev)):
        cuda_adam.adam_multi(kernel, *([o[f] for o in ops] for f in ("p", "m", "v", "n", "g", "noise", "vmax",
                                                                      "gnorm", "anorm", "step", "ibs")), **hyper)
    torch.cuda.synchronize()
    for size, a, b in zip(SIZES, cpu, dev):
        for f in ("p", "m", "v", "n", "vmax"):
            assert _same_bits(a[f], b[f].cpu()), (size, f)


def test_the_groups_cached_view_follows_the_claims():
    """The per-group view of the ledger is rebuilt when a claim moves: another optimizer claiming a parameter,
    a parameter group added, a state loaded."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(5))
    first = AdamW([a])
    view = first._group_view(first.param_groups[0])
    assert set(view.claims) == {id(a)} and first._group_view(first.param_groups[0]) is view     # cached
    second = AdamW([a])                                   # the last to claim a parameter wins it
    assert first._group_view(first.param_groups[0]).claims == {}
    second.add_param_group({"params": [b]})
    assert set(second._group_view(second.param_groups[1]).claims) == {id(b)}
    a.grad = torch.ones(3)
    second.precision_ledger.set_record(a, precision.TERNARY)
    second.precision_ledger.put_noise(a, torch.ones(3), a.grad)
    second.step()
    assert second._group_view(second.param_groups[0]).ternary == {id(a)}      # TernGrad's path for good
    fresh = AdamW([a])
    fresh.add_param_group({"params": [b]})
    fresh.load_state_dict(second.state_dict())
    assert fresh._group_view(fresh.param_groups[0]).ternary == {id(a)}        # read back from the loaded state


def test_a_kernel_that_does_not_build_falls_back_to_the_foreach_ops_said_once(monkeypatch, caplog):
    def refuse():
        raise RuntimeError("NVRTC_ERROR_COMPILATION")
    monkeypatch.setattr(cuda_adam, "CupyAdamKernel", refuse)
    monkeypatch.setattr(cuda_adam, "_kernels", {})
    with caplog.at_level("WARNING", logger="horovod_terngrad"):
        assert cuda_adam.kernel_for(torch.device("cuda")) is None
        assert cuda_adam.kernel_for(torch.device("cuda")) is None
    said = [r.getMessage() for r in caplog.records if "adam.cu did not build" in r.getMessage()]
    assert len(said) == 1 and "NVRTC_ERROR_COMPILATION" in said[0]
    assert cuda_adam.kernel_for(torch.device("cpu")) is None
