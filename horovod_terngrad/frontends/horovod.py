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
* Tensors kept at full precision by the policy (``min_numel``, ``exclude``), and every tensor when
  ``exchange="auto"`` measured a link on which ternarizing does not pay (exchange/link.py), are returned
  as they are (fp16/bf16 sent as fp32) and Horovod allreduces them as usual.

One gradient's path through ``compress``: name the tensor (``_name``), read the call's reduction
(``naming.reduction``), route it (``_route``: the settings, the engine's plan, the optimizer's precision ledger),
then start or fuse it (``_start``).  The engine of a process set is made, and its plan made (the plan step,
``Engine.plan_exchange``: any link measurement and the node-aware/flat decision, by every rank at the same point),
at the first tensor to ternarize, before its exchange; every later gradient only reads the plan.

Tensor fusion (``fusion_numel``): the optimizer's compressed parameters are cut into groups of
consecutive tensors (reverse registration order, so a group's members come out of backward together) by
``exchange.fusion.cut``; see fusion_state.py for when the cut is made and checked.

State: everything that changes while training (step counters of the random streams, engines per process
set, fusion state per optimizer, counters) lives in ``compressor.state`` (state.py), with
``state_dict()`` / ``load_state_dict()`` / ``reset()`` on the compressor.

Horovod does not pass the parameter name to a compressor, so it is read from the calling
``DistributedOptimizer`` (its ``_parameter_names``, ``op`` and ``process_set``), or from the ``name``
of a direct ``hvd.allreduce(..., compression=TernGrad)`` call (naming.py).  Without either, tensors are named by
call order (as Horovod's own unnamed ops are), which needs every rank to call in the same order.
"""
from __future__ import annotations

import logging
import threading
import weakref

import torch

from ..config import TernGradConfig
from ..errors import TernGradError
from ..exchange import (Engine, HorovodCollectives, Ticket, check_gradient, precision,
                        settle_full_precision)
from ..exchange.hvd_collectives import horovod_world
from . import naming
from .cpu_threads import warn_if_oversubscribed
from .fusion_state import FusedMember, OptimizerFusion
from .hierarchy import horovod_engine
from .state import CompressorState, StateOwner, compression_enabled, frontend_config

log = logging.getLogger("horovod_terngrad")


class Passthrough:
    """ctx of a tensor that travels uncompressed (``checked``: on_nonfinite applies to its result)."""

    __slots__ = ("dtype", "name", "checked")

    def __init__(self, dtype, name, checked=True):
        self.dtype = dtype
        self.name = name
        self.checked = checked


class Scaled:
    """ctx of a direct hvd.allreduce with prescale/postscale factors: the average times their product."""

    __slots__ = ("ticket", "scale")

    def __init__(self, ticket, scale):
        self.ticket = ticket
        self.scale = scale


class TernGradCompressor(StateOwner):
    """A Horovod compressor that ternarizes gradients (see module docstring).

    ``TernGrad`` is a ready instance with the paper's defaults; ``TernGrad.configure(**settings)``
    (or ``TernGradCompressor(TernGradConfig(...))``) makes another.  ``stats`` counts the bytes this
    rank handed to collectives and the time spent waiting, for every tensor it compressed; ``state``
    holds everything that changes while training.
    """

    def __init__(self, config: TernGradConfig | None = None, **settings):
        self.config = frontend_config(config, settings)
        self.enabled = compression_enabled()
        self.state = CompressorState()
        self._lock = threading.Lock()
        self._warned_noname = False
        self._warned_partial = False
        self._warned_nonfinite: set = set()     # tensors sent at full precision, zeroed and warned about
        self._threads_checked = False
        self._parameters = weakref.WeakKeyDictionary()    # DistributedOptimizer -> {name: parameter}

    def configure(self, **settings) -> "TernGradCompressor":
        """A new compressor with some settings changed, e.g. ``TernGrad.configure(packing='base3')``."""
        return TernGradCompressor(self.config.replace(**settings))

    def __repr__(self):
        return f"TernGradCompressor({self.config})"

    # -- state (stats, inspection, uncompressed_elements, state_dict, load_state_dict, reset: StateOwner) ----
    def engines(self) -> list:
        """The engines created so far (one per process set)."""
        return list(self.state.engines.values())

    def engine(self, process_set=None) -> Engine:
        return self.state.engine(process_set, self.config, HorovodCollectives, hierarchy=horovod_engine)

    # -- Horovod Compressor interface -----------------------------------------------------------
    def compress(self, tensor: torch.Tensor):
        caller = naming.horovod_caller(tensor)
        with self._lock:
            name = self._name(caller, tensor)
            average, process_set, scale = naming.reduction(caller, name)
            engine, verdict = self._route(tensor, name, caller.optimizer, process_set)
            if not verdict.ternary:
                return self._passthrough(tensor, name)
            return self._start(engine, tensor, name, caller.optimizer, average, scale, verdict)

    def _name(self, caller: naming.Caller, tensor: torch.Tensor) -> str:
        """The tensor's name (its parameter's, a direct call's ``name``, ``<name>.<i>`` for a member of a grouped
        call, else by call order), once the tensor is checked: what cannot be ternarized is refused, naming it."""
        name = caller.name
        if caller.group is not None and name is not None:
            name = f"{name}.{self._member_index(caller.group, tensor)}"
        if name is None:
            name = f"terngrad.noname.{self.state.unnamed}"
            self.state.unnamed += 1
            if not self._warned_noname:
                self._warned_noname = True
                log.warning("TernGrad: no parameter name available; naming tensors by call order, "
                            "which requires every rank to submit them in the same order. Pass "
                            "named_parameters to hvd.DistributedOptimizer, or name= to hvd.allreduce.")
        check_gradient(tensor, name)
        if not self._threads_checked and tensor.device.type == "cpu":
            self._threads_checked = True
            self._check_threads()
        return name

    def _route(self, tensor: torch.Tensor, name: str, optimizer, process_set):
        """(engine, ``precision.Route``): a tensor the settings would ternarize goes to the planned engine of its
        process set (``_planned_engine``), ternarized unless the plan found that ternarizing does not pay; the
        decision is recorded for the parameter's optimizer of horovod_terngrad.optim, if any (a scheduled
        full-precision refresh, the noise estimate it wants: exchange/precision.py).  Engine None: full precision
        by the settings, or compression off."""
        engine = None
        if self.enabled and self.config.compresses(name, tensor.numel()):
            engine = self._planned_engine(process_set, tensor.device)
        verdict = precision.route([self._parameter(optimizer, name)], engine is not None and engine.plan.compresses)
        return engine, verdict

    def _planned_engine(self, process_set, device: torch.device) -> Engine:
        """The engine of the process set with its plan made.  Made at the first tensor to ternarize, which every
        rank reaches at the same point: the topology (hierarchy.py), then the plan step (``plan_exchange``: any
        link measurement, the plan, rank 0's one line), whose collectives every rank issues alike.  After an
        elastic reset (a new Horovod world) the old world's exchanges in flight and fusion state are dropped
        first, and the engines are made and planned again."""
        try:
            world = horovod_world()
        except ImportError:
            world = self.state.world
        if world is not self.state.world:
            if self.state.world is not None:
                log.info("TernGrad: Horovod was re-initialized; exchanges in flight and tensor fusion plans are "
                         "dropped, random-stream step counters kept")
                self.state.reset_world()
            self.state.world = world
        engine = self.engine(process_set)
        if not engine.planned:
            engine.plan_exchange(device)
        return engine

    def _passthrough(self, tensor: torch.Tensor, name: str):
        """A tensor that travels at full precision: Horovod allreduces it (fp16/bf16 as fp32).  on_nonfinite covers
        it too (decompress checks the reduced result); with HOROVOD_TERNGRAD=0 every tensor travels exactly as with
        Compression.none, unchecked."""
        self.state.uncompressed_elements += tensor.numel()
        ctx = Passthrough(tensor.dtype, name, checked=self.enabled)
        if tensor.dtype in (torch.float16, torch.bfloat16):
            return tensor.to(torch.float32), ctx
        return tensor, ctx

    def _start(self, engine, tensor: torch.Tensor, name: str, optimizer, average: bool, scale: float, verdict):
        """Start the ternary exchange: the tensor joins its fused group (the last member to arrive starts the
        group), or travels alone; Horovod gets a 0-element placeholder and the ctx.  Only the optimizer replaces
        the gradient with the result, so only then may the result be written into the gradient's memory; a direct
        hvd.allreduce(compression=...) keeps its input."""
        empty = torch.empty(0, dtype=torch.float32, device=tensor.device)
        batch = self._fused_batch(optimizer, name, tensor)
        if batch is not None:
            batch.arrived[name] = tensor
            batch.routes[name] = verdict
            batch.engine, batch.average = engine, average
            if len(batch.arrived) == len(batch.members):
                batch.start()
            return empty, FusedMember(batch, name)
        ticket, = engine.start_group([(tensor, name)], name, average=average, in_place=optimizer is not None,
                                     routes=[verdict])
        return empty, (ticket if scale == 1.0 else Scaled(ticket, scale))

    @staticmethod
    def _check_threads() -> None:
        """CPU training: warn once if this host's ranks run more torch threads than it has cores."""
        try:
            import horovod.torch as hvd
            local_ranks = hvd.local_size()
        except (ImportError, ValueError, RuntimeError):    # Horovod absent or not initialized
            return
        warn_if_oversubscribed(local_ranks)

    def _parameter(self, optimizer, name: str):
        """The parameter a DistributedOptimizer's gradient belongs to (None for a direct hvd.allreduce)."""
        if optimizer is None:
            return None
        by_name = self._parameters.get(optimizer)
        if by_name is None:
            names = getattr(optimizer, "_parameter_names", None) or {}
            by_name = self._parameters[optimizer] = {n: p for p, n in names.items()}
        return by_name.get(name)

    def _member_index(self, tensors, tensor) -> int:
        """Position of ``tensor`` in a direct hvd.grouped_allreduce call (members are named <name>.<i>)."""
        used = self.state.grouped_calls.setdefault(id(tensors), set())
        i = next((i for i, t in enumerate(tensors) if t is tensor and i not in used), None)
        if i is None:
            i = next(i for i in range(len(tensors)) if i not in used)
        used.add(i)
        if len(used) == len(tensors):
            del self.state.grouped_calls[id(tensors)]
        return i

    def _fused_batch(self, optimizer, name: str, tensor: torch.Tensor):
        """The fused group this optimizer's tensor joins this step, or None if it travels alone (see
        fusion_state.py for the plan)."""
        if optimizer is None or not self.config.fusion_numel:
            return None
        fus = self.state.fusions.get(optimizer)
        if fus is None:
            fus = self.state.fusions[optimizer] = OptimizerFusion(optimizer, self.config)
        batch = fus.batch_for(name, tensor.numel())
        if batch is not None and name in batch.arrived:
            # The previous step ended between compress and decompress (an exception in between): its
            # groups never went out.  Every rank that abandoned it starts this step afresh.
            log.warning("TernGrad: gradient '%s' submitted again before its fused group was exchanged (an "
                        "abandoned step?); starting the step's groups afresh", name)
            fus.fresh_batches()
            batch = fus.batch_for(name, tensor.numel())
        return batch

    def decompress(self, tensor: torch.Tensor, ctx):
        if ctx is None:      # Horovod's sparse allreduce (sparse_as_dense=False) passes no ctx: not compressed
            return tensor
        if isinstance(ctx, Passthrough):
            if ctx.checked:
                with self._lock:
                    tensor = settle_full_precision(tensor, ctx.name, self.config, self.state.stats,
                                                   self._warned_nonfinite)
            return tensor.to(ctx.dtype) if tensor.dtype != ctx.dtype else tensor
        scale = 1.0
        if isinstance(ctx, Scaled):
            scale, ctx = ctx.scale, ctx.ticket
        with self._lock:
            if isinstance(ctx, FusedMember):
                batch = ctx.batch
                if batch.tickets is None:      # members never arrived this step: start every such group
                    missing = batch.fusion.start_incomplete()
                    if missing and not self._warned_partial:
                        self._warned_partial = True
                        log.warning("TernGrad: fused groups miss %s this step (sparse gradients without "
                                    "sparse_as_dense, or parameters dropped from the update?); their other "
                                    "members go as smaller groups", missing)
                ctx = batch.tickets[ctx.name]
        if not isinstance(ctx, Ticket):
            raise TernGradError(f"TernGrad.decompress got a ctx of type {type(ctx).__name__}; it must be "
                                "the ctx returned by the same compressor's compress()")
        with self._lock:
            out = ctx.engine.finish(ctx)
        precision.deliver(ctx, out)        # the noise estimate to the parameter's optimizer, where it asked
        return out if scale == 1.0 else out * scale
