"""The few collectives the exchange needs, behind one small interface.

Implementations: ``HorovodCollectives`` (hvd_collectives.py) runs them on Horovod (``horovod.torch``);
``ThreadCollectives`` (thread_collectives.py) runs N ranks in one process, so the exchange can be tested
and simulated without Horovod.  All give the same results: allreduce-max is exact (max is order
independent), allgather concatenates the ranks' 1-D tensors in rank order (their lengths may differ, as
Horovod's allgather allows), alltoall delivers to each rank the chunks addressed to it in sender order,
allreduce-sum adds int32 vectors exactly.

Optional capability ``takes_sizes = True``: the implementation accepts what the exchange knows about sizes
up front, ``allgather_async(..., sizes=[every rank's element count])`` and ``alltoall_async(...,
received=[elements this rank gets from each sender])``, and then needs no exchange of lengths of its own
(torch.distributed, dist_collectives.py, gathers equal sizes only).  The transports pass them only where an
implementation declares it, so the others keep the plain signatures.

Optional ``joins = False``: no rank can be in a join (torch.distributed), so the engine skips per-rank
scalers' presence check (below).

Ranks that called ``join`` (Horovod's ``hvd.join()``: a rank out of data waits for the others) take part
in every allreduce with zeros and in no allgather or alltoall; the engine reads the handshake to notice
them and moves the payloads by allreduce-sum instead (see joined.py).
"""
from __future__ import annotations

import threading
from typing import Any, Protocol

import torch

from ..errors import TernGradError


class CollectiveError(TernGradError):
    """A collective failed (mismatched shapes across ranks, a rank that left, a shutdown, ...).

    Implementations may raise a subclass that is also their framework's own error: on Horovod it is also a
    ``horovod.common.exceptions.HorovodInternalError``, which elastic training catches to recover.
    ``detailed`` keeps that class when the engine adds which tensor failed."""

    def detailed(self, message: str, also: type | None = None) -> "CollectiveError":
        """This error with ``message`` in front, of the same class (and also of class ``also``, e.g.
        ``RankMismatchError`` when the collective failed because ranks handed different shapes)."""
        cls = type(self)
        if also is not None and not issubclass(cls, also):
            cls = _combined(cls, also)
        err = cls(f"{message}: {self}")
        err.__cause__ = self
        return err


_COMBINED: dict = {}


def _combined(cls: type, also: type) -> type:
    if (cls, also) not in _COMBINED:
        _COMBINED[(cls, also)] = type(cls.__name__, (cls, also), {"__module__": cls.__module__})
    return _COMBINED[(cls, also)]


class Collectives(Protocol):
    """One rank's view of the group it exchanges with.  The ``*_async`` calls return a handle at once;
    ``poll`` says whether it completed; ``synchronize`` waits and returns the result (raising
    ``CollectiveError`` when the collective failed).  Every rank must issue the same collectives with the
    same names; the order of completion is free."""

    rank: int
    size: int

    def allreduce_max_async(self, tensor: torch.Tensor, name: str) -> Any: ...
    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any: ...
    def alltoall_async(self, tensor: torch.Tensor, splits: list, name: str) -> Any: ...
    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> Any: ...
    def poll(self, handle: Any) -> bool: ...
    def synchronize(self, handle: Any) -> torch.Tensor: ...
