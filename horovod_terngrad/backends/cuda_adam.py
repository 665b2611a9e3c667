"""horovod_terngrad.optim's default-mode Adam(W) update of a list of fp32 tensors in one kernel launch
(``kernels/adam.cu``, ``tg_adam_multi``: the formula there is ``tg_adam_corrected``'s, kernels/terngrad_cpu.c).

* ``adam_multi(kernel, ...)`` writes the launch's table (one int64 buffer: the prefix of the tensors' chunk counts,
  then per tensor its pointers, size and two fp32 scalars) on the host, hands it to the device in one copy, and
  launches the kernel once: a handful of host operations per step however many tensors, no synchronization.
* ``CupyAdamKernel`` is the source compiled by CuPy (NVRTC) for the current CUDA device, launched on torch's
  current stream; CuPy is imported only when one is made.
* ``HostAdamKernel`` is the same source built for the host (``kernels/adam_host.cpp`` with
  ``kernels/host_shim.h``), its launch run as loops over blocks and threads: tests compare it byte for byte with
  the fused CPU pass without a GPU.  Slow; tests only.
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

from .compile_cache import kernel_source
from .cuda import NVCC_OPTIONS, CupyStreams
from .host_build import build_host

log = logging.getLogger("horovod_terngrad")

THREADS = 256
CHUNK = 32768          # elements per block: kernels/adam.cu's TG_ADAM_CHUNK
FIELDS = 12            # int64 words per tensor in the table: TG_ADAM_FIELDS


class CupyAdamKernel:
    """``tg_adam_multi`` compiled by CuPy (NVRTC) for the current CUDA device."""

    device = "cuda"

    def __init__(self):
        import cupy
        self.cupy = cupy
        with open(kernel_source("adam.cu")) as f:
            module = cupy.RawModule(code=f.read(), options=NVCC_OPTIONS)
        self.function = module.get_function("tg_adam_multi")
        self.streams = CupyStreams(cupy)

    def launch(self, nchunks: int, buf: torch.Tensor, args: tuple) -> None:
        # the table's address as a numpy integer, as CupyKernels passes pointers: no DLPack wrapper per launch
        with self.streams.current(buf.device):
            self.function((nchunks,), (THREADS,), (np.uint64(buf.data_ptr()), *args))


class HostAdamKernel:
    """``tg_adam_multi`` built for the host (tests and CPU-only verification): tensors on the CPU."""

    device = "cpu"

    def __init__(self, block: int = 32):
        self.block = block        # a small block makes every block-stride loop go round many times
        self.lib = ctypes.CDLL(build_host(launcher="adam_host.cpp", source="adam.cu", name="adam_hostkernel"))
        f = ctypes.c_float
        self.lib.host_tg_adam_multi.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_int, f, f, f,
                                                ctypes.c_double, f, f, f, f, ctypes.c_int]
        self.lib.host_tg_adam_multi.restype = None

    def launch(self, nchunks: int, buf: torch.Tensor, args: tuple) -> None:
        self.lib.host_tg_adam_multi(nchunks, self.block, buf.data_ptr(), *(a.item() for a in args))


_kernels: dict = {}


def kernel_for(device: torch.device):
    """The kernel for tensors on ``device``: CuPy's build on CUDA (one per process); None elsewhere, or where
    CuPy is missing or cannot build it (said once; the caller then takes its foreach ops)."""
    if device.type != "cuda":
        return None
    k = _kernels.get("cuda", False)
    if k is False:
        try:
            k = CupyAdamKernel()
        except ImportError:
            k = None
        except Exception as e:          # NVRTC or the driver refused it: the foreach ops still work
            log.warning("horovod_terngrad.optim: kernels/adam.cu did not build on this GPU (%s: %s); the default "
                        "mode's update takes the foreach ops", type(e).__name__, e)
            k = None
        _kernels["cuda"] = k
    return k


def _ptrs(ts) -> list:
    return [0 if t is None else t.data_ptr() for t in ts]


def adam_multi(kernel, params, exp_avgs, exp_avg_sqs, noise_avgs, grads, noises, max_exp_avg_sqs, grad_norms,
               average_norms, steps, inv_bias2_sqrts, *, beta1: float, beta2: float, eps: float, decay: float,
               l2: float, floor: float, maximize: bool) -> None:
    """The default-mode update of every tensor of the lists (contiguous fp32, on the kernel's device), in one
    launch.  Per tensor: ``noises[i]`` None (no estimate: n = b2·n) or the estimate with ``grad_norms[i]`` and
    ``average_norms[i]`` (0-d fp32 norms of the gradient now and of the exchange's average: the noise's factor is
    their squared ratio, taken on the device); ``max_exp_avg_sqs`` None (not amsgrad) or a list; ``steps[i]`` =
    lr / bias1 and ``inv_bias2_sqrts[i]`` as the host computed them (rounded to fp32 here, as the CPU pass's
    arguments are).  Empty tensors are skipped."""
    keep = [i for i, p in enumerate(params) if p.numel()]
    if not keep:
        return
    if len(keep) != len(params):
        pick = (lambda xs: None if xs is None else [xs[i] for i in keep])        # noqa: E731
        (params, exp_avgs, exp_avg_sqs, noise_avgs, grads, noises, max_exp_avg_sqs, grad_norms, average_norms, steps,
         inv_bias2_sqrts) = map(pick, (params, exp_avgs, exp_avg_sqs, noise_avgs, grads, noises, max_exp_avg_sqs,
                                       grad_norms, average_norms, steps, inv_bias2_sqrts))
    t = len(params)
    sizes = np.fromiter((p.numel() for p in params), dtype=np.int64, count=t)
    chunks = (sizes + (CHUNK - 1)) // CHUNK
    host = torch.empty(t + 1 + t * FIELDS, dtype=torch.int64, pin_memory=kernel.device == "cuda")
    buf = host.numpy()
    buf[0] = 0
    np.cumsum(chunks, out=buf[1:t + 1])
    table = buf[t + 1:].reshape(t, FIELDS)
    table[:, 0] = _ptrs(params)
    table[:, 1] = _ptrs(exp_avgs)
    table[:, 2] = _ptrs(exp_avg_sqs)
    table[:, 3] = _ptrs(noise_avgs)
    table[:, 4] = _ptrs(grads)
    table[:, 5] = _ptrs(noises)
    table[:, 6] = 0 if max_exp_avg_sqs is None else _ptrs(max_exp_avg_sqs)
    table[:, 7] = _ptrs(grad_norms)
    table[:, 8] = _ptrs(average_norms)
    table[:, 9] = sizes
    table[:, 10] = np.asarray(steps, dtype=np.float32).view(np.uint32)
    table[:, 11] = np.asarray(inv_bias2_sqrts, dtype=np.float32).view(np.uint32)
    nchunks = int(buf[t])
    dev = host.to(params[0].device, non_blocking=True) if kernel.device == "cuda" else host
    kernel.launch(nchunks, dev, (np.int32(t), np.float32(1 - beta1), np.float32(beta2), np.float32(1 - beta2),
                                 np.float64(1 - beta2), np.float32(eps), np.float32(decay), np.float32(l2),
                                 np.float32(floor), np.int32(bool(maximize))))
