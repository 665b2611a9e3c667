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

Tensor fusion (``fusion_numel``): the optimizer's compressed parameters are cut into groups of
consecutive tensors (reverse registration order, so a group's members come out of backward together).
The first step runs unfused and records which parameters were compressed; from the second step the plan
is built from those (so parameters Horovod never hands over, sparse or frozen ones, stay out), checked
once across ranks with one small blocking allreduce (ranks that cut different groups turn fusion off
together instead of waiting on each other's collectives), and rebuilt whenever the set changes.
``compress`` of a group member only records the tensor; the member that completes the group starts one
handshake and one allgather for all of them (``AllgatherExchange.start_group``).  Horovod calls every
compress of a step before the first decompress, so a group is normally complete by then; groups with
members missing are all started at the first decompress, in group order, as smaller groups.

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
import zlib

import torch

from ..config import TernGradConfig, TernGradError
from ..exchange import AllgatherExchange, ExchangeStats, HorovodCollectives, check_gradient
from ..exchange.allgather import Ticket

log = logging.getLogger("horovod_terngrad")


class _FusionPlan:
    """Which compressed parameters of one optimizer share collectives (see module docstring).

    Built from the names compressed in the previous step (``seen``), in the optimizer's reverse
    registration order: parameters Horovod never hands to the compressor (sparse gradients, frozen
    ones) are left out, and every rank, seeing the same parameters, cuts the same groups."""

    def __init__(self, optimizer, config: TernGradConfig, seen: frozenset):
        names = optimizer._parameter_names
        params = [p for g in optimizer.param_groups for p in g["params"] if p in names and names[p] in seen]
        self.seen = seen
        self.group_of: dict[str, int] = {}
        self.members: list[list[str]] = []
        self.numel: dict[str, int] = {}
        current, total, device = [], 0, None
        for p in reversed(params):
            name, n = names[p], p.numel()
            if not config.compresses(name, n):
                continue
            if current and (total + n > config.fusion_numel or p.device != device):
                self._close(current)
                current, total = [], 0
            current.append(name)
            self.numel[name] = n
            total += n
            device = p.device
        self._close(current)
        self.batches = [_FusedBatch(self, g) for g in range(len(self.members))]

    def _close(self, names: list) -> None:
        if len(names) > 1:                       # a lone tensor travels under its own name
            for n in names:
                self.group_of[n] = len(self.members)
            self.members.append(names)

    def checksum(self) -> float:
        return float(zlib.crc32(repr([(m, [self.numel[n] for n in m]) for m in self.members]).encode()))

    def start_incomplete(self) -> list:
        """Start, in group order, every group of this step with members missing (called at the first
        decompress, when all of this step's compress calls have been made); returns their missing names."""
        missing = []
        for g, batch in enumerate(self.batches):
            if batch.arrived and batch.tickets is None:
                missing += [n for n in self.members[g] if n not in batch.arrived]
                batch.start(partial=True)
                self.batches[g] = _FusedBatch(self, g)
        return missing


class _Fusion:
    """Tensor fusion state of one optimizer: the names compressed this step and last step, the plan."""

    def __init__(self, decompress_count: int):
        self.current: list[str] = []
        self.last: frozenset | None = None
        self.seen_decompress = decompress_count
        self.plan: _FusionPlan | None = None
        self.generation = 0
        self.disabled = False


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
        self._fusions: dict = {}        # id(optimizer) -> _Fusion
        self._decompress_count = 0
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
        """The fused group this optimizer's tensor joins this step, or None if it travels alone.

        The first step runs unfused and records which names were compressed; the plan is (re)built
        from the previous step's names whenever they change, and checked across ranks once (one small
        blocking allreduce): if ranks cut different groups (e.g. they disagree on a size), fusion is
        turned off on every rank and the per-tensor handshake reports the disagreement."""
        if optimizer is None or not self.config.fusion_numel:
            return None
        fus = self._fusions.get(id(optimizer))
        if fus is None:
            fus = self._fusions[id(optimizer)] = _Fusion(self._decompress_count)
        if fus.seen_decompress != self._decompress_count:    # decompress ran since: a new step
            fus.seen_decompress = self._decompress_count
            if fus.current:
                fus.last = frozenset(fus.current)
            fus.current = []
            if fus.plan is not None:                         # a step abandoned before its groups went out
                fus.plan.batches = [_FusedBatch(fus.plan, g) for g in range(len(fus.plan.members))]
        fus.current.append(name)
        if fus.last is None or fus.disabled:
            return None
        if fus.plan is None or fus.plan.seen != fus.last:
            engine = self.engine(getattr(optimizer, "process_set", None))
            fus.plan = _FusionPlan(optimizer, self.config, fus.last)
            fus.generation += 1
            c = fus.plan.checksum()
            v = engine.coll.synchronize(engine.coll.allreduce_max_async(
                torch.tensor([c, -c], dtype=torch.float64), f"terngrad.fusionplan.{fus.generation}"))
            engine.stats.collectives += 1
            if v[0].item() != -v[1].item():
                fus.disabled = True
                log.error("TernGrad: ranks formed different tensor-fusion groups (their parameters differ in "
                          "number or size); tensor fusion is off for this optimizer on every rank")
                return None
        g = fus.plan.group_of.get(name)
        if g is None or fus.plan.numel[name] != tensor.numel():
            return None
        return fus.plan.batches[g]

    def decompress(self, tensor: torch.Tensor, ctx):
        if isinstance(ctx, _Passthrough):
            return tensor.to(ctx.dtype) if tensor.dtype != ctx.dtype else tensor
        with self._lock:
            self._decompress_count += 1
            if isinstance(ctx, _FusedMember):
                batch = ctx.batch
                if batch.tickets is None:      # members never arrived this step: start every such group
                    missing = batch.plan.start_incomplete()
                    if not self._warned_partial:
                        self._warned_partial = True
                        log.warning("TernGrad: fused groups miss %s this step (parameters frozen or without "
                                    "a gradient?); their other members go as smaller groups, and the "
                                    "fusion plan follows from the next step", missing)
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
