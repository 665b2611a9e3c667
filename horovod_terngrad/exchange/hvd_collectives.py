"""The exchange's collectives on Horovod (``horovod.torch``): asynchronous ops, an optional process set.

A failed Horovod op surfaces as ``HorovodCollectiveError``: a ``CollectiveError`` (so TernGrad can say which
tensor failed) that is also Horovod's own ``HorovodInternalError``, the exception elastic training
(``hvd.elastic.run``) catches to restore its state and re-form the world.
"""
from __future__ import annotations

import torch

from .collectives import CollectiveError

_error_class = None
_mpi_ops = None


def horovod_error_class():
    """``HorovodCollectiveError``, made on first use (horovod is imported only when it runs)."""
    global _error_class
    if _error_class is None:
        from horovod.common.exceptions import HorovodInternalError

        class HorovodCollectiveError(CollectiveError, HorovodInternalError):
            """A Horovod collective issued by TernGrad failed (Horovod's message follows TernGrad's)."""

        _error_class = HorovodCollectiveError
    return _error_class


def horovod_world():
    """An object that changes whenever Horovod is (re)initialized: ``horovod.torch.mpi_ops.init`` makes a
    new handle table each time, as elastic training does after every reset.  Handles of the old world
    are dead then, so TernGrad drops its exchanges in flight and its fusion state (frontends/horovod.py)."""
    global _mpi_ops
    if _mpi_ops is None:          # (compress calls this per tensor: import once)
        from horovod.torch import mpi_ops as _mpi_ops
    return _mpi_ops._handle_map


class HorovodCollectives:
    """Horovod's asynchronous torch ops.  The global set's rank and size are read per call (elastic
    changes them); a process set's are read once (its members are fixed; and Horovod 0.28.1 sometimes
    answered "Process set does not exist" to ps.rank() of a registered dynamic set late in a run)."""

    def __init__(self, process_set=None):
        import horovod.torch as hvd
        self._hvd = hvd
        self._ps = process_set
        self._ps_rank_size = None if process_set is None else (process_set.rank(), process_set.size())

    @property
    def rank(self) -> int:
        return self._hvd.rank() if self._ps is None else self._ps_rank_size[0]

    @property
    def size(self) -> int:
        return self._hvd.size() if self._ps is None else self._ps_rank_size[1]

    def _kw(self):
        return {} if self._ps is None else {"process_set": self._ps}

    def allreduce_max_async(self, tensor, name):
        return self._hvd.allreduce_async(tensor, name=name, op=self._hvd.Max, **self._kw())

    def allreduce_sum_async(self, tensor, name):
        return self._hvd.allreduce_async(tensor, name=name, op=self._hvd.Sum, **self._kw())

    def allgather_async(self, tensor, name):
        return self._hvd.allgather_async(tensor, name=name, **self._kw())

    def alltoall_async(self, tensor, splits, name):
        return self._hvd.alltoall_async(tensor, splits=torch.tensor(splits, dtype=torch.int32), name=name,
                                        **self._kw())

    def poll(self, handle):
        try:
            return self._hvd.poll(handle)
        except Exception:     # a handle Horovod no longer knows (shut down): synchronize reports it
            return True

    def synchronize(self, handle):
        try:
            out = self._hvd.synchronize(handle)
        except Exception as e:  # Horovod raises HorovodInternalError (ranks disagree, a peer is gone, ...)
            raise horovod_error_class()(str(e)) from e
        return out[0] if isinstance(out, tuple) else out   # alltoall: (output, received splits)
