"""How the Horovod frontend learns a tensor's name and reduction op: Horovod does not pass them to a
compressor, so they are read from the calling ``DistributedOptimizer`` (its ``_parameter_names``, ``op``
and ``process_set``) or from the arguments of a direct ``hvd.allreduce(..., compression=...)`` call."""
from __future__ import annotations

import sys

import torch

from ..errors import TernGradError


def horovod_caller(tensor: torch.Tensor, depth: int = 2):
    """(name, optimizer or hvd.allreduce's arguments or None) of the Horovod code that called compress().
    ``depth``: frames between this function and compress()'s caller."""
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
            return names.get(param), owner
        if "compression" in loc and "op" in loc:                         # hvd.allreduce(...)
            return (loc["name"] if isinstance(loc.get("name"), str) else None), dict(loc)
        f = f.f_back
    return None, None


def op_of_call(args: dict):
    """The reduction op of a direct hvd.allreduce call (its ``op``, else ``average``)."""
    import horovod.torch as hvd
    if args.get("op") is not None:
        return args["op"]
    return hvd.Sum if args.get("average") is False else hvd.Average


def averages(op, name: str) -> bool:
    """True for Average, False for Sum; other ops are refused, naming the tensor."""
    import horovod.torch as hvd
    if op == hvd.Average:
        return True
    if op == hvd.Sum:
        return False
    raise TernGradError(f"TernGrad: gradient '{name}': op={op} is not supported (use Average or Sum; "
                        "Adasum needs full-precision deltas)")
