"""Collectives of a group of ranks carried by collectives of the whole world: no process set needed.

The node-aware exchange (hierarchical.py) runs collectives inside each node and among the j-th ranks of
every node.  On Horovod those would be process sets, which exist only if they were registered at
``hvd.init(process_sets=...)`` or ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` was set before ``hvd.init()``; a
script that imports TernGrad after ``hvd.init()`` has neither.  Process sets also change how a dead rank
ends the job: under Gloo, Horovod 0.28.1 aborts the survivors from its background thread instead of
raising ``HorovodInternalError``, which elastic recovery needs.

Here the world is cut into disjoint groups (the nodes, or the cross groups) that issue the same sequence of
collectives under the same names at the same time, so that one world alltoall whose splits are zero
outside each rank's group carries every group's collective at once:

* alltoall inside the group: the world alltoall with the group's splits, zeros for the other ranks;
* allgather inside the group: the world alltoall of one copy of the tensor per member (itself included);
  what arrives from the members, in global rank order, is the group's allgather;
* allreduce-max / -sum inside the group: that allgather, reduced here (max and integer sums are exact).

A group's members are in ascending global rank order (as Horovod orders a process set's ranks), which is
the order in which the world alltoall lays out what it sends and receives: no reordering, and the same
rank order (so the same bits) as with process sets.

Cost against the group's own collective: the same bytes leave each rank (an allgather of n bytes in a
group of k sends (k-1)·n either way, here straight to each peer instead of around a ring), plus one copy
of the tensor per member in this rank's memory for an allgather; every collective is negotiated by the
whole world, so a stage starts when every rank has posted it, not only the group.  A failed world
collective raises the world collectives' error class (Horovod's ``HorovodInternalError``), as the flat
exchange does.

Callers must name a collective alike in every group (``spans_world = True`` tells them): the world op's
name is the one name every rank posts.
"""
from __future__ import annotations

from typing import Any

import torch

from .collectives import Collectives


class _Handle:
    __slots__ = ("inner", "reduce", "k")

    def __init__(self, inner, reduce=None, k=0):
        self.inner, self.reduce, self.k = inner, reduce, k


class WorldGroupCollectives:
    """This rank's group ``ranks`` (global ranks; every rank of ``world`` belongs to exactly one group of
    the partition its peers use) over ``world``'s alltoall (see module docstring)."""

    spans_world = True

    def __init__(self, world: Collectives, ranks):
        self.world = world
        self.ranks = sorted(int(r) for r in ranks)
        if world.rank not in self.ranks:
            raise ValueError(f"rank {world.rank} is not in its group {self.ranks}")
        if len(set(self.ranks)) != len(self.ranks) or self.ranks[0] < 0 or self.ranks[-1] >= world.size:
            raise ValueError(f"group {self.ranks} is not a set of ranks of a world of {world.size}")
        self.rank = self.ranks.index(world.rank)
        self.size = len(self.ranks)
        self.joins = False     # (the hierarchical exchange asks the whole world whether a rank joined)

    def _world_splits(self, splits) -> list:
        out = [0] * self.world.size
        for r, n in zip(self.ranks, splits):
            out[r] = int(n)
        return out

    def alltoall_async(self, tensor: torch.Tensor, splits: list, name: str) -> Any:
        if len(splits) != self.size:
            raise ValueError(f"alltoall '{name}': {len(splits)} splits for a group of {self.size}")
        return _Handle(self.world.alltoall_async(tensor, self._world_splits(splits), name))

    def allgather_async(self, tensor: torch.Tensor, name: str) -> Any:
        flat = tensor.reshape(-1)
        copies = flat.repeat(self.size) if self.size > 1 else flat.contiguous()
        return _Handle(self.world.alltoall_async(copies, self._world_splits([flat.numel()] * self.size), name))

    def _allreduce(self, tensor: torch.Tensor, name: str, how: str) -> Any:
        h = self.allgather_async(tensor, name)
        h.reduce, h.k = how, tensor.numel()
        return h

    def allreduce_max_async(self, tensor: torch.Tensor, name: str) -> Any:
        return self._allreduce(tensor, name, "max")

    def allreduce_sum_async(self, tensor: torch.Tensor, name: str) -> Any:
        return self._allreduce(tensor, name, "sum")

    def poll(self, handle: _Handle) -> bool:
        return self.world.poll(handle.inner)

    def synchronize(self, handle: _Handle) -> torch.Tensor:
        out = self.world.synchronize(handle.inner)
        if handle.reduce is None:
            return out
        rows = out.view(self.size, handle.k)
        if handle.reduce == "max":
            return rows.max(dim=0).values
        return rows.sum(dim=0)        # (integers: exact in any order)
