"""The exchange's collectives for N ranks inside one process (tests and the simulator; no Horovod)."""
from __future__ import annotations

import threading

import torch

from .collectives import CollectiveError


class _Slot:
    def __init__(self, size):
        self.inputs: list = [None] * size
        self.arrived = 0
        self.result = None
        self.error = None
        self.done = threading.Event()


class ThreadWorld:
    """Shared rendezvous for N ranks of one process: a collective completes when all N ranks posted it.

    The ranks may be threads (``run_ranks``) or be driven one after the other from a single thread, as
    the simulator does: then a rank may only ``synchronize`` collectives every rank has posted.  With
    ``copy=False`` inputs and results are shared, not cloned (the caller promises not to modify them),
    which saves N copies of every gathered buffer when one process plays many ranks.
    """

    def __init__(self, size: int, copy: bool = True):
        self.size = size
        self.copy = copy
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, str], _Slot] = {}
        self.bytes_in: list[int] = [0] * size   # bytes each rank handed to collectives
        self._joined: list[int] = []            # ranks in join() (allreduces count them as zeros)
        self._all_joined = threading.Event()
        self._last_joined = -1

    def post(self, kind: str, name: str, rank: int, tensor: torch.Tensor, splits=None) -> _Slot:
        with self._lock:
            slot = self._slots.setdefault((kind, name), _Slot(self.size))
            if slot.inputs[rank] is not None:
                raise CollectiveError(f"rank {rank} posted {kind} '{name}' twice before it completed")
            kept = tensor.clone() if self.copy else tensor
            slot.inputs[rank] = kept if splits is None else (kept, list(splits))
            slot.arrived += 1
            self.bytes_in[rank] += tensor.numel() * tensor.element_size()
            self._complete_if_ready(kind, name, slot)
        return slot

    def join(self, rank: int, timeout: float) -> int:
        """Horovod's ``join``: ``rank`` has no more data; until every rank joined, it takes part in every
        allreduce with zeros (and allgather/alltoall fail, as in Horovod).  Returns the last rank to join."""
        with self._lock:
            self._joined.append(rank)
            if len(self._joined) == self.size:
                self._last_joined = rank
                self._joined = []
                self._all_joined.set()
                self._all_joined = threading.Event()
                done = None
            else:
                done = self._all_joined
                for (kind, name), slot in list(self._slots.items()):
                    self._complete_if_ready(kind, name, slot)
        if done is not None and not done.wait(timeout):
            raise CollectiveError(f"join timed out after {timeout}s: not all ranks joined")
        return self._last_joined

    def _complete_if_ready(self, kind, name, slot) -> None:
        absent = [r for r in self._joined if slot.inputs[r] is None]
        if slot.arrived + len(absent) < self.size:
            return
        del self._slots[(kind, name)]
        try:
            if absent and kind not in ("max", "sum"):
                raise CollectiveError(f"{kind} '{name}' is not supported with join (ranks {absent} joined)")
            present = next(t for t in slot.inputs if t is not None)
            inputs = [torch.zeros_like(present) if t is None else t for t in slot.inputs]
            slot.result = self._combine(kind, name, inputs)
        except CollectiveError as e:
            slot.error = e
        slot.done.set()

    @staticmethod
    def _combine(kind, name, inputs):
        if kind == "a2a":   # per receiver: the chunks addressed to it, in sender order
            out = []
            for dst in range(len(inputs)):
                parts = []
                for t, splits in inputs:
                    if len(splits) != len(inputs) or sum(splits) != t.numel():
                        raise CollectiveError(f"alltoall '{name}': splits {splits} do not fit {t.numel()} elements")
                    off = sum(splits[:dst])
                    parts.append(t[off:off + splits[dst]])
                out.append(torch.cat(parts))
            return out
        if kind in ("max", "sum"):
            shapes = {tuple(t.shape) for t in inputs}
            if len(shapes) != 1:
                raise CollectiveError(f"Mismatched allreduce tensor shapes for '{name}': {sorted(shapes)}")
            stacked = torch.stack(inputs)
            return stacked.amax(dim=0) if kind == "max" else stacked.sum(dim=0, dtype=inputs[0].dtype)
        return torch.cat(inputs)

    def ranks(self) -> list["ThreadCollectives"]:
        return [ThreadCollectives(self, r) for r in range(self.size)]


class ThreadCollectives:
    """One rank's view of a ``ThreadWorld``."""

    def __init__(self, world: ThreadWorld, rank: int, timeout: float = 60.0):
        self.world = world
        self.rank = rank
        self.size = world.size
        self.timeout = timeout

    def allreduce_max_async(self, tensor, name):
        return self.world.post("max", name, self.rank, tensor)

    def allreduce_sum_async(self, tensor, name):
        return self.world.post("sum", name, self.rank, tensor)

    def join(self) -> int:
        """Horovod's ``hvd.join()`` for this thread-rank (blocks until every rank joined)."""
        return self.world.join(self.rank, self.timeout)

    def allgather_async(self, tensor, name):
        return self.world.post("gather", name, self.rank, tensor)

    def alltoall_async(self, tensor, splits, name):
        return self.world.post("a2a", name, self.rank, tensor, splits)

    def poll(self, handle):
        return handle.done.is_set()

    def synchronize(self, handle):
        if not handle.done.wait(self.timeout):
            raise CollectiveError(f"collective timed out after {self.timeout}s: not all ranks posted it")
        if handle.error is not None:
            raise handle.error
        result = handle.result[self.rank] if isinstance(handle.result, list) else handle.result
        return result.clone() if self.world.copy else result


def run_ranks(world_size: int, fn, *args, timeout: float = 120.0):
    """Run ``fn(collectives, *args)`` on ``world_size`` thread-ranks; returns results in rank order.

    An exception on any rank is re-raised (the first by rank) after all threads ended.
    """
    world = ThreadWorld(world_size)
    results: list = [None] * world_size
    errors: list = [None] * world_size

    def body(c):
        try:
            results[c.rank] = fn(c, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[c.rank] = e

    threads = [threading.Thread(target=body, args=(c,), daemon=True) for c in world.ranks()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise CollectiveError("a thread-rank did not finish in time (hang)")
    for e in errors:
        if e is not None:
            raise e
    return results


def hierarchical_collectives(topo, copy: bool = True) -> list[tuple]:
    """Per global rank of ``topo`` (exchange/topology.py): (its node's collectives, its cross group's), each
    a ``ThreadCollectives`` of a ``ThreadWorld`` of that subgroup, as Horovod's process sets or
    torch.distributed's subgroups give real ranks."""
    out: list = [None] * topo.size
    local_worlds = [ThreadWorld(len(g), copy) for g in topo.local_groups()]
    cross_worlds = [ThreadWorld(len(g), copy) for g in topo.cross_groups()]
    cross = topo.cross_groups()
    for node, ranks in enumerate(topo.local_groups()):
        for j, rank in enumerate(ranks):
            out[rank] = (ThreadCollectives(local_worlds[node], j),
                         ThreadCollectives(cross_worlds[j], cross[j].index(rank)))
    return out
