"""The exchange's collectives on ``torch.distributed`` (gloo on CPU, NCCL on GPU), for the DDP frontend.

``DistCollectives(group)`` runs the five operations of collectives.py on a process group (default: WORLD)
with ``async_op=True``; ``poll`` is ``Work.is_completed()`` and ``synchronize`` is ``Work.wait()``.
torch.distributed ignores names and matches collectives by the order in which each rank issues them on a
group, so every rank must issue the same collectives in the same order: the exchange engine does
(``Engine(ordered=True)``: its collectives are a pure function of the calls made to it).  A process
group of its own (the DDP frontend makes one) keeps them apart from DDP's own collectives.

The math of each operation, and its cost per call for a tensor of b bytes on N ranks (ring algorithms;
gloo and NCCL pick their own, the byte counts are what each rank hands over and receives):

* ``allreduce_max_async`` / ``allreduce_sum_async``: elementwise max (exact in any order) / sum (int32, exact):
  ``all_reduce`` of a copy (the input is left as it was); about 2·(N-1)/N·b sent and received.
* ``allgather_async``: the ranks' 1-D tensors concatenated in rank order; (N-1)·max_r b_r received.
  torch.distributed gathers equal sizes only, so every rank must know every rank's length first:
  - given by the caller (``sizes=``; the sharded exchange knows its owners' sums, the last may be short):
    each tensor is padded to the longest, ``all_gather_single`` runs, ``synchronize`` cuts the padding out;
  - ``equal_sizes=True``: the caller promises that every rank hands as many elements as this one (the DDP
    frontend can: DDP checks the parameters' shapes across ranks at construction, the frontend checks the
    TernGrad settings across ranks, and payload sizes are a function of those alone, codec/sizes.py);
  - otherwise the lengths travel first: a blocking ``all_gather`` of one int64 per rank (one round trip).
  A broken promise is not caught here: gloo aborts the process on a size mismatch ("Received data size
  doesn't match expected size"), NCCL may hang.
* ``alltoall_async(tensor, splits)``: chunk j of ``splits`` goes to rank j; each rank receives the chunks
  addressed to it in sender order (``all_to_all_single``); sends and receives sum(splits) - own chunk.
  Receivers must know what each sender sends them: ``received=`` from the caller (the sharded exchange's
  shards depend on the receiver only), or with ``equal_sizes=True`` every sender is taken to send rank j
  ``splits[j]`` elements, or else the split vectors travel first (a blocking ``all_gather`` of N int64).

A failed collective raises ``DistCollectiveError`` (a ``CollectiveError``), with torch's error as its
``__cause__``.
"""
from __future__ import annotations

import torch

from .collectives import CollectiveError


class DistCollectiveError(CollectiveError):
    """A torch.distributed collective issued by TernGrad failed (torch's message follows TernGrad's)."""


def _dist():
    import torch.distributed as dist
    return dist


def _gather_single(dist):
    """``all_gather_single`` (torch >= 2.13), else its older name ``all_gather_into_tensor``."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Pending:
    """An asynchronous collective: torch's work handle, and how to turn its output into the result."""

    __slots__ = ("work", "output", "finish", "error")

    def __init__(self, work, output, finish=None, error=None):
        self.work, self.output, self.finish, self.error = work, output, finish, error


class DistCollectives:
    """The ``Collectives`` of collectives.py on a ``torch.distributed`` process group (see module docstring).
    Rank and size are the group's, read once (a process group's members are fixed)."""

    takes_sizes = True      # allgather_async(..., sizes=) and alltoall_async(..., received=): see collectives.py
    joins = False           # no hvd.join() here: per-rank scalers need no presence check (collectives.py)

    def __init__(self, group=None, equal_sizes: bool = False):
        dist = _dist()
        if not dist.is_available() or not dist.is_initialized():
            raise CollectiveError("TernGrad: torch.distributed is not initialized "
                                  "(call torch.distributed.init_process_group first)")
        self._dist = dist
        self._gather = _gather_single(dist)
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        if self.rank < 0:
            raise CollectiveError("TernGrad: this process is not a member of the process group")
        self.equal_sizes = bool(equal_sizes)

    def __repr__(self):
        return f"DistCollectives(rank={self.rank}, size={self.size}, equal_sizes={self.equal_sizes})"

    # -- the operations -------------------------------------------------------------------------
    def allreduce_max_async(self, tensor, name):
        return self._allreduce(tensor, self._dist.ReduceOp.MAX, name)

    def allreduce_sum_async(self, tensor, name):
        return self._allreduce(tensor, self._dist.ReduceOp.SUM, name)

    def allgather_async(self, tensor, name, sizes=None):
        t = tensor.reshape(-1).contiguous()
        n = t.numel()
        if sizes is not None:
            lengths = [int(x) for x in sizes]
            if len(lengths) != self.size or lengths[self.rank] != n:
                return self._refused(f"allgather '{name}': sizes {lengths} do not fit {n} elements on rank "
                                     f"{self.rank} of {self.size}")
        elif self.equal_sizes or self.size == 1:
            lengths = [n] * self.size
        else:
            lengths = self._exchange_sizes(torch.tensor([n], dtype=torch.int64), name)[:, 0].tolist()
        longest = max(lengths)
        if longest == min(lengths):      # the usual case: no padding to cut
            out = t.new_empty(self.size * n)
            return self._start(name, "allgather", lambda: self._gather(out, t, group=self.group, async_op=True), out)
        padded = t if n == longest else torch.cat([t, t.new_zeros(longest - n)])
        out = t.new_empty(self.size * longest)

        def cut(o):
            return torch.cat([o[r * longest:r * longest + lengths[r]] for r in range(self.size)])

        return self._start(name, "allgather", lambda: self._gather(out, padded, group=self.group, async_op=True),
                           out, cut)

    def alltoall_async(self, tensor, splits, name, received=None):
        t = tensor.reshape(-1).contiguous()
        splits = [int(s) for s in splits]
        if len(splits) != self.size or sum(splits) != t.numel():
            return self._refused(f"alltoall '{name}': splits {splits} do not fit {t.numel()} elements "
                                 f"on {self.size} ranks")
        if received is not None:
            received = [int(x) for x in received]
            if len(received) != self.size or received[self.rank] != splits[self.rank]:
                return self._refused(f"alltoall '{name}': received sizes {received} do not fit splits {splits} "
                                     f"on rank {self.rank}")
        elif self.equal_sizes:
            received = [splits[self.rank]] * self.size
        else:       # column ``rank`` of the senders' split vectors: what each sends this rank
            received = self._exchange_sizes(torch.tensor(splits, dtype=torch.int64), name)[:, self.rank].tolist()
        out = t.new_empty(sum(received))
        return self._start(name, "alltoall", lambda: self._dist.all_to_all_single(
            out, t, output_split_sizes=received, input_split_sizes=splits, group=self.group, async_op=True), out)

    def poll(self, handle):
        if handle.work is None:
            return True
        try:
            return handle.work.is_completed()
        except Exception:     # a broken group: synchronize reports it
            return True

    def synchronize(self, handle):
        if handle.error is not None:
            raise handle.error
        try:
            if handle.work is not None:
                handle.work.wait()
        except Exception as e:  # torch raises RuntimeError / DistError (a peer is gone, a timeout, ...)
            raise self._error(e, "failed") from e
        out = handle.output
        return handle.finish(out) if handle.finish is not None else out

    # -- internals -----------------------------------------------------------------------------
    def _allreduce(self, tensor, op, name):
        out = tensor.detach().clone()
        return self._start(name, "allreduce", lambda: self._dist.all_reduce(out, op=op, group=self.group,
                                                                             async_op=True), out)

    def _start(self, name, kind, issue, out, finish=None) -> _Pending:
        """Issue a collective; a failure to issue it is reported by ``synchronize`` (as Horovod's are)."""
        try:
            return _Pending(issue(), out, finish)
        except Exception as e:  # noqa: BLE001 - reported at synchronize, like a failed asynchronous op
            err = self._error(e, f"{kind} '{name}' could not start")
            err.__cause__ = e
            return _Pending(None, out, finish, err)

    @staticmethod
    def _refused(message: str) -> _Pending:
        """A collective refused before it started (its error is raised by ``synchronize``)."""
        return _Pending(None, None, None, DistCollectiveError(message))

    def _exchange_sizes(self, sizes: torch.Tensor, name: str) -> torch.Tensor:
        """Every rank's ``sizes`` vector (rows in rank order), by one blocking all_gather."""
        device = self.size_device()
        mine = sizes.to(device)
        out = mine.new_empty(self.size * mine.numel())
        try:
            self._gather(out, mine, group=self.group)
        except Exception as e:
            raise self._error(e, f"exchanging the sizes of '{name}' failed") from e
        return out.view(self.size, -1).cpu()

    def size_device(self):
        """Where small host-made vectors (sizes, checksums) go for a collective: the GPU for NCCL (it handles no host tensors), else the host."""
        backend = str(self._dist.get_backend(self.group)).lower()
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @staticmethod
    def _error(e: Exception, what: str) -> DistCollectiveError:
        return DistCollectiveError(f"torch.distributed collective {what}: {e}")


__all__ = ["DistCollectives", "DistCollectiveError"]
