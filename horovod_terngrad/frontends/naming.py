"""How the Horovod frontend learns a tensor's name and reduction op: Horovod does not pass them to a
compressor, so they are read from the calling ``DistributedOptimizer`` (its ``_parameter_names``, ``op``
and ``process_set``) or from the arguments of a direct ``hvd.allreduce(..., compression=...)`` or
``hvd.grouped_allreduce(..., compression=...)`` call."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ..errors import TernGradError


@dataclass
class Caller:
    """What compress() learned about the Horovod code that called it."""

    name: str | None = None
    optimizer: object = None          # the DistributedOptimizer, if it called
    call: dict | None = None          # the arguments of a direct hvd.allreduce / hvd.grouped_allreduce
    group: list | None = None         # hvd.grouped_allreduce's tensors (its members are named <name>.<i>)


def horovod_caller(tensor: torch.Tensor, depth: int = 2) -> Caller:
    """The Horovod code that called compress().  ``depth``: frames between this function and
    compress()'s caller."""
    f = sys._getframe(depth)
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
            return Caller(names.get(param), optimizer=owner)
        if "compression" in loc and "op" in loc:       # hvd.allreduce(...) or hvd.grouped_allreduce(...)
            name = loc["name"] if isinstance(loc.get("name"), str) else None
            tensors = loc.get("tensors")
            return Caller(name, call=dict(loc), group=tensors if isinstance(tensors, (list, tuple)) else None)
        f = f.f_back
    return Caller()


def reduction(caller: Caller, name: str) -> tuple:
    """How the calling code reduces the tensor: (average, process set, prescale·postscale).  A direct
    hvd.allreduce / grouped_allreduce: its arguments; a DistributedOptimizer: its op and process set (its
    gradient_predivide_factor needs nothing: Horovod's pre- and postscale multiply to 1 for Average); else an
    average over the global set."""
    if caller.call is not None:
        return averages(op_of_call(caller.call), name), caller.call.get("process_set"), scale_of_call(caller.call)
    if caller.optimizer is not None:
        return averages(optimizer_op(caller.optimizer, name), name), getattr(caller.optimizer, "process_set", None), 1.0
    return True, None, 1.0


def op_of_call(args: dict):
    """The reduction op of a direct hvd.allreduce call (its ``op``, else ``average``)."""
    import horovod.torch as hvd
    if args.get("op") is not None:
        return args["op"]
    return hvd.Sum if args.get("average") is False else hvd.Average


def scale_of_call(args: dict) -> float:
    """prescale_factor * postscale_factor of a direct call (TernGrad's average is linear in them)."""
    return float(args.get("prescale_factor", 1.0) or 1.0) * float(args.get("postscale_factor", 1.0) or 1.0)


def optimizer_op(optimizer, name: str):
    """The op of a DistributedOptimizer; Horovod's Adasum optimizer (no ``op``; it reduces parameter deltas
    with Adasum's nonlinear rule) is refused."""
    import horovod.torch as hvd
    if hasattr(optimizer, "_starting_models") and not hasattr(optimizer, "op"):
        raise TernGradError(f"TernGrad: gradient '{name}': DistributedOptimizer(op=hvd.Adasum) is not supported "
                            "with TernGrad compression (Adasum combines full-precision deltas by a nonlinear "
                            "rule; ternary values cannot be combined that way). Use op=hvd.Average or "
                            "compression=hvd.Compression.none")
    return getattr(optimizer, "op", hvd.Average)


def averages(op, name: str) -> bool:
    """True for Average, False for Sum; other ops are refused, naming the tensor."""
    import horovod.torch as hvd
    if op == hvd.Average:
        return True
    if op == hvd.Sum:
        return False
    what = {hvd.Adasum: "Adasum", hvd.Min: "Min", hvd.Max: "Max", hvd.Product: "Product"}.get(op, op)
    raise TernGradError(f"TernGrad: gradient '{name}': op={what} is not supported (TernGrad averages or sums; "
                        "use op=hvd.Average or hvd.Sum, or compression=hvd.Compression.none for this op)")
