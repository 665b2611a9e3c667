"""Layer 2: device backends of the codec, all producing the same bytes as ``codec`` (the reference).

``for_device(device)`` picks one: CPU tensors -> the fused C path (``cpu.py``) when it builds, else the
torch reference; CUDA tensors -> the torch reference.  ``HOROVOD_TERNGRAD_BACKEND=torch`` forces the
reference everywhere (for comparisons).
"""
from __future__ import annotations

import os
import threading

from .reference import ReferenceBackend

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


def for_device(device) -> object:
    if os.environ.get("HOROVOD_TERNGRAD_BACKEND", "") == "torch":
        return REFERENCE
    if getattr(device, "type", str(device)) == "cpu":
        return cpu_fused() or REFERENCE
    return REFERENCE
