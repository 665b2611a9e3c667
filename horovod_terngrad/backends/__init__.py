"""Layer 2: device backends of the codec, all producing the same bytes as ``codec`` (the reference).

Every backend implements ``Backend`` (``base.py``: prepare / encode / decode) and declares its optional
capabilities, e.g. ``SHARDED_SUMS``; ask with ``has_capability``.  ``for_device(device)`` picks one by itself:

* CPU tensors -> the fused C path (``cpu.py``, ``kernels/terngrad_cpu.c``) when it builds, else the torch
  reference (``reference.py``);
* CUDA tensors -> the CuPy kernels of ``kernels/terngrad.cu`` (``cuda.py``) when CuPy imports and works,
  else (with one warning) the torch reference, which runs on the GPU with plain torch ops.

``clipped_square_sums`` and ``encode_nearest`` run a codec function on its tensor's backend: the capability's one pass
(``SQUARE_SUMS``, ``NEAREST``) where the backend has it, else the reference's torch ops, the same bits either way.

``HOROVOD_TERNGRAD_BACKEND=torch`` forces the reference everywhere (for comparisons).  The fused C codec
and the host build of the kernels (``host_build.py``, for tests without a GPU) are compiled at run time
into the cache of ``compile_cache.py``.
"""
from __future__ import annotations

import logging
import os
import threading

from .base import (ADAM_CORRECTED, BF16_INPUT, NEAREST, NOISE_DECODE, REQUANT, SHARDED_SUMS, SQUARE_SUMS,
                   AdamCorrectedBackend, Backend, NearestBackend, NoiseDecodeBackend, RequantBackend, ShardedSumsBackend,
                   SquareSumsBackend, has_capability)
from .reference import ReferenceBackend

__all__ = ["Backend", "ShardedSumsBackend", "SHARDED_SUMS", "NoiseDecodeBackend", "NOISE_DECODE",
           "AdamCorrectedBackend", "ADAM_CORRECTED", "RequantBackend", "REQUANT", "NearestBackend", "NEAREST",
           "SquareSumsBackend", "SQUARE_SUMS", "BF16_INPUT", "clipped_square_sums", "encode_nearest",
           "has_capability", "REFERENCE", "for_device",
           "cpu_fused", "cuda_kernels"]

log = logging.getLogger("horovod_terngrad")
_lock = threading.Lock()
_cache: dict = {}
REFERENCE = ReferenceBackend()


def cpu_fused() -> Backend | None:
    """The fused CPU backend (built on first use) or None when unavailable."""
    with _lock:
        if "cpu" not in _cache:
            from . import cpu
            _cache["cpu"] = cpu.load()
        return _cache["cpu"]


def cuda_kernels() -> Backend | None:
    """The CuPy kernel backend, or None (warned once) when CuPy or CUDA is unavailable."""
    with _lock:
        if "cuda" not in _cache:
            try:
                from .cuda import CupyKernels, KernelBackend
                _cache["cuda"] = KernelBackend(CupyKernels())
            except Exception as e:  # noqa: BLE001 - ImportError, no driver, NVRTC failure: all mean fallback
                log.warning("TernGrad: CUDA kernels unavailable (%s: %s); CUDA tensors use the torch "
                            "reference path (correct, slower). bash scripts/setup.sh --cuda, or pip install "
                            "cupy-cuda12x / cupy-cuda13x (torch's CUDA major), enables them.",
                            type(e).__name__, e)
                _cache["cuda"] = None
        return _cache["cuda"]


def for_device(device) -> Backend:
    """The backend for tensors on ``device`` (a ``torch.device`` or its name; see the module docstring)."""
    if os.environ.get("HOROVOD_TERNGRAD_BACKEND", "") == "torch":
        return REFERENCE
    kind = getattr(device, "type", str(device))
    if kind == "cpu":
        return cpu_fused() or REFERENCE
    if kind == "cuda":
        return cuda_kernels() or REFERENCE
    return REFERENCE


# -- codec functions that a capability speeds up: the backend's one pass where it has it, else the reference ------
def clipped_square_sums(g, threshold, bounds: list):
    """codec/squares.py's ``clipped_square_sums`` on ``g``'s backend (the ``SQUARE_SUMS`` capability's one pass
    where it has it): the same bits either way."""
    from ..codec import squares
    backend = for_device(g.device)
    if has_capability(backend, SQUARE_SUMS):
        return backend.clipped_square_sums(g, threshold, bounds)
    return squares.clipped_square_sums(g, threshold, bounds)


def encode_nearest(d, fmt: str, bucket_size: int = 0):
    """codec/nearest.py's ``encode_nearest(d, fmt, bucket_size)`` on ``d``'s backend (the ``NEAREST`` capability's
    one pass where it has it): the same bytes either way."""
    from ..codec import nearest
    backend = for_device(d.device)
    if has_capability(backend, NEAREST):
        return backend.encode_nearest(d, fmt, bucket_size)
    return nearest.encode_nearest(d, fmt, bucket_size)
