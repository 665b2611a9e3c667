"""horovod-terngrad: TernGrad (Wen et al., NeurIPS 2017) gradient compression for stock Horovod.

    from horovod_terngrad import TernGrad
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=TernGrad)

Layers: ``codec`` (math on one tensor), ``exchange`` (how payloads travel), ``frontends`` (Horovod).
"""
from .config import (NonFiniteGradientError, RankMismatchError, TernGradConfig, TernGradError)
from .frontends.horovod import TernGradCompressor

__version__ = "0.1.0"

#: Ready compressor with the paper's defaults (c = 2.5, 2-bit packing, layer-wise shared scaler).
TernGrad = TernGradCompressor()

_functional: dict = {}


def _functional_engine(config: TernGradConfig | None, process_set=None):
    key = (config or TernGrad.config, id(process_set) if process_set is not None else None)
    eng = _functional.get(key)
    if eng is None:
        comp = TernGrad if config is None else TernGradCompressor(config)
        eng = _functional[key] = comp.engine(process_set)
    return eng


def allreduce_async(tensor, name: str, config: TernGradConfig | None = None, average: bool = True,
                    process_set=None):
    """Start a TernGrad average of ``tensor`` across ranks; returns a handle for ``synchronize``.

    Every rank must call it with the same ``name`` (and shape).  Uses Horovod's collectives.
    """
    return _functional_engine(config, process_set).start(tensor, name, average=average)


def synchronize(handle):
    """Wait for an ``allreduce_async`` handle and return the averaged tensor."""
    return handle.owner.finish(handle)


def allreduce(tensor, name: str, config: TernGradConfig | None = None, average: bool = True,
              process_set=None):
    """TernGrad average (or sum, with average=False) of ``tensor`` across ranks, blocking.

    For custom training loops: ``g = horovod_terngrad.allreduce(p.grad, name='layer1.weight')``.
    """
    return synchronize(allreduce_async(tensor, name, config, average, process_set))


__all__ = ["TernGrad", "TernGradCompressor", "TernGradConfig", "TernGradError", "NonFiniteGradientError",
           "RankMismatchError", "allreduce", "allreduce_async", "synchronize"]
