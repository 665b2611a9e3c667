"""The exchange's collectives on Horovod (``horovod.torch``): asynchronous ops, an optional process set."""
from __future__ import annotations

import torch

from .collectives import CollectiveError


class HorovodCollectives:
    """Horovod's asynchronous torch ops. Rank and size are read per call (elastic-safe)."""

    def __init__(self, process_set=None):
        import horovod.torch as hvd
        self._hvd = hvd
        self._ps = process_set

    @property
    def rank(self) -> int:
        return self._hvd.rank() if self._ps is None else self._ps.rank()

    @property
    def size(self) -> int:
        return self._hvd.size() if self._ps is None else self._ps.size()

    def _kw(self):
        return {} if self._ps is None else {"process_set": self._ps}

    def allreduce_max_async(self, tensor, name):
        return self._hvd.allreduce_async(tensor, name=name, op=self._hvd.Max, **self._kw())

    def allgather_async(self, tensor, name):
        return self._hvd.allgather_async(tensor, name=name, **self._kw())

    def alltoall_async(self, tensor, splits, name):
        return self._hvd.alltoall_async(tensor, splits=torch.tensor(splits, dtype=torch.int32), name=name,
                                        **self._kw())

    def poll(self, handle):
        return self._hvd.poll(handle)

    def synchronize(self, handle):
        try:
            out = self._hvd.synchronize(handle)
        except Exception as e:  # Horovod reports rank disagreements as HorovodInternalError
            raise CollectiveError(str(e)) from e
        return out[0] if isinstance(out, tuple) else out   # alltoall: (output, received splits)
