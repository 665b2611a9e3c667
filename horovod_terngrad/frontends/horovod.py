"""Horovod frontend: TernGrad as a ``compression=`` argument of stock Horovod (0.28.1).

    import horovod.torch as hvd
    from horovod_terngrad import TernGrad
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=TernGrad)

How it fits Horovod's Compressor interface (``compress(tensor) -> (tensor, ctx)`` before Horovod's
allreduce, ``decompress(tensor, ctx)`` after it):

* ``compress`` starts TernGrad's own exchange (handshake + payload allgather, asynchronous, named after
  the parameter) and returns a 0-element fp32 tensor: Horovod's allreduce of it is a no-op that costs
  one fused entry in its negotiation.  The ticket of the exchange is the ctx.
* ``decompress`` waits for the exchange and returns the average gradient in the gradient's dtype.
* Tensors kept at full precision by the policy (``min_numel``, ``exclude``) are returned as they are
  (fp16/bf16 sent as fp32) and Horovod allreduces them as usual.

Horovod does not pass the parameter name to a compressor, so it is read from the calling
``DistributedOptimizer`` (its ``_parameter_names``, ``op`` and ``process_set``), or from the ``name``
of a direct ``hvd.allreduce(..., compression=TernGrad)`` call.  Without either, tensors are named by
call order (as Horovod's own unnamed ops are), which needs every rank to call in the same order.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import types

import torch

from ..config import TernGradConfig, TernGradError
from ..exchange import AllgatherExchange, ExchangeStats, HorovodCollectives, check_gradient
from ..exchange.allgather import Ticket

log = logging.getLogger("horovod_terngrad")


class _Passthrough:
    """ctx of a tensor that travels uncompressed."""
    __slots__ = ("dtype", "name")

    def __init__(self, dtype, name):
        self.dtype = dtype
        self.name = name


def _horovod_caller(tensor: torch.Tensor):
    """(name, optimizer or hvd.allreduce's locals or None) of the Horovod code that called compress()."""
    f = sys._getframe(2)
    param = None
    for _ in range(4):
        if f is None:
            break
        loc = f.f_locals
        p = loc.get("p")
        if param is None and isinstance(p, torch.Tensor):
            param = p
        owner = loc.get("self")
        names = getattr(owner, "_parameter_names", None)
        if isinstance(names, dict) and param is not None:
            return names.get(param), owner
        if "compression" in loc and "op" in loc:                         # hvd.allreduce(...)
            return (loc["name"] if isinstance(loc.get("name"), str) else None), dict(loc)
        f = f.f_back
    return None, None


def _op_of(args: dict):
    import horovod.torch as hvd
    if args.get("op") is not None:
        return args["op"]
    return hvd.Sum if args.get("average") is False else hvd.Average


class TernGradCompressor:
    """A Horovod compressor that ternarizes gradients (see module docstring).

    ``TernGrad`` is a ready instance with the paper's defaults; ``TernGrad.configure(**settings)``
    (or ``TernGradCompressor(TernGradConfig(...))``) makes another.  ``stats`` counts the bytes this
    rank handed to collectives and the time spent waiting, for every tensor it compressed.
    """

    def __init__(self, config: TernGradConfig | None = None, **settings):
        if config is not None and settings:
            raise TypeError("pass either a TernGradConfig or keyword settings, not both")
        self.config = config if config is not None else TernGradConfig(**settings)
        # HOROVOD_TERNGRAD=0 turns compression off without touching the training script (the
        # launcher's --no-terngrad sets it): every tensor then travels as with Compression.none.
        self.enabled = os.environ.get("HOROVOD_TERNGRAD", "1").strip().lower() not in ("0", "off", "false", "no")
        self.stats = ExchangeStats()
        self.uncompressed_elements = 0
        self._engines: dict = {}
        self._lock = threading.Lock()
        self._noname = 0
        self._warned_noname = False

    def configure(self, **settings) -> "TernGradCompressor":
        """A new compressor with some settings changed, e.g. ``TernGrad.configure(packing='base3')``."""
        return TernGradCompressor(self.config.replace(**settings))

    def __repr__(self):
        return f"TernGradCompressor({self.config})"

    def engine(self, process_set=None) -> AllgatherExchange:
        key = id(process_set) if process_set is not None else None
        eng = self._engines.get(key)
        if eng is None:
            eng = AllgatherExchange(HorovodCollectives(process_set), self.config, self.stats)
            self._engines[key] = eng
        return eng

    # -- Horovod Compressor interface -----------------------------------------------------------
    def compress(self, tensor: torch.Tensor):
        name, opt = _horovod_caller(tensor)
        with self._lock:
            if name is None:
                name = f"terngrad.noname.{self._noname}"
                self._noname += 1
                if not self._warned_noname:
                    self._warned_noname = True
                    log.warning("TernGrad: no parameter name available; naming tensors by call order, "
                                "which requires every rank to submit them in the same order. Pass "
                                "named_parameters to hvd.DistributedOptimizer.")
            check_gradient(tensor, name)
            average, process_set, optimizer = True, None, None
            if isinstance(opt, dict):      # called by hvd.allreduce: its op/average arguments decide
                average = self._average(types.SimpleNamespace(op=_op_of(opt)), name)
                process_set = opt.get("process_set")
            elif opt is not None:          # called by the DistributedOptimizer
                optimizer = opt
                average = self._average(opt, name)
                process_set = getattr(opt, "process_set", None)
            if not self.enabled or not self.config.compresses(name, tensor.numel()):
                self.uncompressed_elements += tensor.numel()
                if tensor.dtype in (torch.float16, torch.bfloat16):
                    return tensor.to(torch.float32), _Passthrough(tensor.dtype, name)
                return tensor, _Passthrough(tensor.dtype, name)
            # Only the optimizer replaces the gradient with the result, so only then may the result be
            # written into the gradient's memory; a direct hvd.allreduce(compression=...) keeps its input.
            ticket = self.engine(process_set).start(tensor, name, average=average, in_place=optimizer is not None)
        return torch.empty(0, dtype=torch.float32, device=tensor.device), ticket

    def decompress(self, tensor: torch.Tensor, ctx):
        if isinstance(ctx, _Passthrough):
            return tensor.to(ctx.dtype) if tensor.dtype != ctx.dtype else tensor
        if not isinstance(ctx, Ticket):
            raise TernGradError(f"TernGrad.decompress got a ctx of type {type(ctx).__name__}; it must be "
                                "the ctx returned by the same compressor's compress()")
        with self._lock:
            return ctx.owner.finish(ctx)

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _average(opt, name: str) -> bool:
        import horovod.torch as hvd
        op = getattr(opt, "op", hvd.Average)
        if op == hvd.Average:
            return True
        if op == hvd.Sum:
            return False
        raise TernGradError(f"TernGrad: gradient '{name}': op={op} is not supported (use Average or Sum; "
                            "Adasum needs full-precision deltas)")
