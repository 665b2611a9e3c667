"""Layer 2: device backends of the codec, all producing the same bytes as ``codec`` (the reference).

``for_device(device)`` picks one by itself:

* CPU tensors -> the fused C path (``cpu.py``) when it builds, else the torch reference;
* CUDA tensors -> the CuPy kernels of ``kernels/terngrad.cu`` (``kernels.py``) when CuPy imports and
  works, else (with one warning) the torch reference, which runs on the GPU with plain torch ops.

``HOROVOD_TERNGRAD_BACKEND=torch`` forces the reference everywhere (for comparisons).
"""
from __future__ import annotations

import logging
import os
import threading

from .reference import ReferenceBackend

log = logging.getLogger("horovod_terngrad")
_lock = threading.Lock()
_cache: dict = {}
REFERENCE = ReferenceBackend()


def cpu_fused():
    """The fused CPU backend (built on first use) or None when unavailable."""
    with _lock:
        if "cpu" not in _cache:
            from . import cpu
            _cache["cpu"] = cpu.load()
        return _cache["cpu"]


def cuda_kernels():
    """The CuPy kernel backend, or None (warned once) when CuPy or CUDA is unavailable."""
    with _lock:
        if "cuda" not in _cache:
            try:
                from .kernels import CupyKernels, KernelBackend
                _cache["cuda"] = KernelBackend(CupyKernels())
            except Exception as e:  # noqa: BLE001 - ImportError, no driver, NVRTC failure: all mean fallback
                log.warning("TernGrad: CUDA kernels unavailable (%s: %s); CUDA tensors use the torch "
                            "reference path (correct, slower). pip install cupy-cuda12x to enable them.",
                            type(e).__name__, e)
                _cache["cuda"] = None
        return _cache["cuda"]


def for_device(device) -> object:
    if os.environ.get("HOROVOD_TERNGRAD_BACKEND", "") == "torch":
        return REFERENCE
    kind = getattr(device, "type", str(device))
    if kind == "cpu":
        return cpu_fused() or REFERENCE
    if kind == "cuda":
        return cuda_kernels() or REFERENCE
    return REFERENCE
