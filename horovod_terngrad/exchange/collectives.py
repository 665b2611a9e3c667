"""The few collectives the exchange needs, behind one small interface.

Implementations: ``HorovodCollectives`` (hvd_collectives.py) runs them on Horovod (``horovod.torch``);
``ThreadCollectives`` (thread_collectives.py) runs N ranks in one process, so the exchange can be tested
and simulated without Horovod.  All give the same results: allreduce-max is exact (max is order
independent), allgather concatenates the ranks' 1-D tensors in rank order (their lengths may differ, as
Horovod's allgather allows), alltoall delivers to each rank the chunks addressed to it in sender order.
"""
from __future__ import annotations

import threading
from typing import Any, Protocol

import torch


class CollectiveError(RuntimeError):
    """A collective failed (mismatched shapes across ranks, a rank that left, ...)."""


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
    def poll(self, handle: Any) -> bool: ...
    def synchronize(self, handle: Any) -> torch.Tensor: ...
