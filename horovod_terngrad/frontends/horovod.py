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

Tensor fusion (``fusion_numel``): the optimizer's compressed parameters are cut once into groups of
consecutive tensors (reverse registration order, so a group's members come out of backward together;
every rank builds the same groups from the same model).  ``compress`` of a group member only records
the tensor; the member that completes the group starts one handshake and one allgather for all of
them (``AllgatherExchange.start_group``).  Horovod calls every compress of a step before the first
decompress, so a group is always complete by then; if a member never came (a parameter frozen
mid-training), the members that came are sent as a smaller group, and the plan is rebuilt next step.

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


class _FusionPlan:
    """Which compressed parameters of one optimizer share collectives (see module docstring)."""

    def __init__(self, optimizer, config: TernGradConfig, mode_of):
        names = optimizer._parameter_names
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad and p in names]
        self.group_of: dict[str, int] = {}
        self.members: list[list[str]] = []
        self.numel: dict[str, int] = {}
        current, total = [], 0
        for p in reversed(params):
            name, n = names[p], p.numel()
            if not config.compresses(name, n) or mode_of(n) != "allgather":   # sharded tensors go alone
                continue
            if current and total + n > config.fusion_numel:
                self._close(current)
                current, total = [], 0
            current.append(name)
            self.numel[name] = n
            total += n
        self._close(current)
        self.batches = [_FusedBatch(self, g) for g in range(len(self.members))]
        self.stale = False

    def _close(self, names: list) -> None:
        if len(names) > 1:                       # a lone tensor travels under its own name
            for n in names:
                self.group_of[n] = len(self.members)
            self.members.append(names)


class _FusedBatch:
    """One step's worth of a fused group: the tensors that arrived, then the tickets."""

    def __init__(self, plan: _FusionPlan, group: int):
        self.plan = plan
        self.group = group
        self.arrived: dict[str, torch.Tensor] = {}
        self.tickets: dict[str, Ticket] | None = None
        self.engine = None
        self.average = True

    def start(self, partial: bool = False) -> None:
        order = [n for n in self.plan.members[self.group] if n in self.arrived]
        name = f"terngrad.fused{self.group}" + (f".partial{len(order)}" if partial else "")
        tickets = self.engine.start_group([(self.arrived[n], n) for n in order], name, average=self.average,
                                          in_place=True)
        self.tickets = dict(zip(order, tickets))
        self.arrived = {}


class _FusedMember:
    """ctx of a tensor that travels in a fused group."""
    __slots__ = ("batch", "name")

    def __init__(self, batch: _FusedBatch, name: str):
        self.batch = batch
        self.name = name


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
        self._plans: dict = {}          # id(optimizer) -> _FusionPlan
        self._warned_partial = False

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
            empty = torch.empty(0, dtype=torch.float32, device=tensor.device)
            batch = self._fused_batch(optimizer, name, tensor)
            if batch is not None:
                if name in batch.arrived:
                    raise TernGradError(f"TernGrad: gradient '{name}' was submitted twice in one step before "
                                        f"its fused group was exchanged")
                batch.arrived[name] = tensor
                batch.engine, batch.average = self.engine(process_set), average
                if len(batch.arrived) == len(batch.plan.members[batch.group]):
                    batch.start()
                    batch.plan.batches[batch.group] = _FusedBatch(batch.plan, batch.group)
                return empty, _FusedMember(batch, name)
            # Only the optimizer replaces the gradient with the result, so only then may the result be
            # written into the gradient's memory; a direct hvd.allreduce(compression=...) keeps its input.
            ticket = self.engine(process_set).start(tensor, name, average=average, in_place=optimizer is not None)
        return empty, ticket

    def _fused_batch(self, optimizer, name: str, tensor: torch.Tensor):
        """The fused group this optimizer's tensor joins this step, or None if it travels alone."""
        if optimizer is None or not self.config.fusion_numel:
            return None
        plan = self._plans.get(id(optimizer))
        if plan is None or plan.stale:
            engine = self.engine(getattr(optimizer, "process_set", None))
            plan = self._plans[id(optimizer)] = _FusionPlan(optimizer, self.config, engine._mode)
        g = plan.group_of.get(name)
        if g is None or plan.numel[name] != tensor.numel():
            return None
        return plan.batches[g]

    def decompress(self, tensor: torch.Tensor, ctx):
        if isinstance(ctx, _Passthrough):
            return tensor.to(ctx.dtype) if tensor.dtype != ctx.dtype else tensor
        if isinstance(ctx, _FusedMember):
            with self._lock:
                batch = ctx.batch
                if batch.tickets is None:      # a member never arrived this step
                    missing = [n for n in batch.plan.members[batch.group] if n not in batch.arrived]
                    if not self._warned_partial:
                        self._warned_partial = True
                        log.warning("TernGrad: fused group %d is missing %s this step (frozen or unused "
                                    "parameters?); sending the rest as a smaller group and re-planning "
                                    "fusion", batch.group, missing)
                    batch.start(partial=True)
                    batch.plan.batches[batch.group] = _FusedBatch(batch.plan, batch.group)
                    batch.plan.stale = True
                ctx = batch.tickets[ctx.name]
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
