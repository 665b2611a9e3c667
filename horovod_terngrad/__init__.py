"""horovod-terngrad: TernGrad (Wen et al., NeurIPS 2017) gradient compression for stock Horovod.

    from horovod_terngrad import TernGrad
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=TernGrad)

PyTorch DDP (a communication hook; the module ``horovod_terngrad.ddp``, not loaded by this package)::

    from horovod_terngrad.ddp import register
    state = register(ddp_model)              # ddp_model: torch.nn.parallel.DistributedDataParallel

Layers (docs/design.md): ``codec`` (math on one tensor, and every size), ``backends`` (the same bytes,
fast), ``exchange`` (how payloads travel), ``frontends`` (Horovod, DDP), ``operations`` (benchmarks,
models, launch; never imported from here).
"""
from __future__ import annotations

import importlib
import importlib.util
import threading

from .errors import NonFiniteGradientError, RankMismatchError, TernGradError

__version__ = "0.1.0"

# What imports torch (and Horovod) is loaded on first use, so that a command that needs none of it (the launcher,
# terngrad-launch, which only builds a command line) starts without paying torch's import (about 2 s per process).
_LAZY = {"TernGradConfig": "config", "TernGradCompressor": "frontends.horovod"}
_ready_lock = threading.Lock()

#: config -> the compressor (its state: engines, step counters) behind the functional API, least recently used
#: first; at most MAX_FUNCTIONAL_CONFIGS, so a loop that makes a new config per call cannot grow it without bound
_compressors: dict = {}
MAX_FUNCTIONAL_CONFIGS = 16
_said_dropped = False      # the drop is said once per process


def _ready() -> TernGradCompressor:
    """``TernGrad``: the ready compressor with the defaults (c = 2.5, 2-bit packing, layer-wise scalers: per rank
    with the allgather exchange, shared with the sharded one; tensors under 4096 elements at full precision),
    made once, on first use."""
    with _ready_lock:
        if "TernGrad" not in globals():
            from .frontends.horovod import TernGradCompressor
            globals()["TernGrad"] = TernGradCompressor()
    return globals()["TernGrad"]


def _compressor_for(config: TernGradConfig | None) -> TernGradCompressor:
    """The functional API's compressor of ``config`` (the ready ``TernGrad`` for the defaults).  Past
    MAX_FUNCTIONAL_CONFIGS distinct configs the least recently used one is dropped, said once: its step counters
    go with it, so its random streams would start again at step 0 if it came back."""
    ready = _ready()
    if config is None or config == ready.config:
        return ready
    from .frontends.horovod import TernGradCompressor
    comp = _compressors.pop(config, None) or TernGradCompressor(config)
    _compressors[config] = comp
    if len(_compressors) > MAX_FUNCTIONAL_CONFIGS:
        dropped = next(iter(_compressors))
        del _compressors[dropped]
        global _said_dropped
        if not _said_dropped:
            _said_dropped = True
            import logging
            logging.getLogger("horovod_terngrad").warning(
                "TernGrad: more than %d distinct configs passed to allreduce(); the least recently used one's state "
                "(its step counters) is dropped. Keep one TernGradConfig per use.", MAX_FUNCTIONAL_CONFIGS)
    return comp



def _functional_engine(config: TernGradConfig | None, process_set=None):
    return _compressor_for(config).engine(process_set)


def allreduce_async(tensor, name: str, config: TernGradConfig | None = None, average: bool = True,
                    process_set=None):
    """Start a TernGrad average of ``tensor`` across ranks; returns a handle for ``synchronize``.

    Every rank must call it with the same ``name`` (and shape).  Uses Horovod's collectives.
    """
    return _functional_engine(config, process_set).start(tensor, name, average=average)


def synchronize(handle):
    """Wait for an ``allreduce_async`` handle and return the averaged tensor."""
    return handle.engine.finish(handle)


def allreduce(tensor, name: str, config: TernGradConfig | None = None, average: bool = True,
              process_set=None):
    """TernGrad average (or sum, with average=False) of ``tensor`` across ranks, blocking.

    For custom training loops: ``g = horovod_terngrad.allreduce(p.grad, name='layer1.weight')``.
    """
    return synchronize(allreduce_async(tensor, name, config, average, process_set))


def __getattr__(name):
    """The package's names that need torch, loaded on first use: ``TernGrad``, ``TernGradConfig``,
    ``TernGradCompressor``; and the submodules as attributes, e.g. ``horovod_terngrad.ddp`` (``import
    horovod_terngrad as tg; tg.ddp.register(...)``: horovod_terngrad/ddp.py, which ``import horovod_terngrad`` does
    not load)."""
    if name == "TernGrad":
        return _ready()
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")      # a submodule, as the eager imports gave
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = ["TernGrad", "TernGradCompressor", "TernGradConfig", "TernGradError", "NonFiniteGradientError",
           "RankMismatchError", "allreduce", "allreduce_async", "synchronize"]
