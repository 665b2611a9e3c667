"""Which exchange a tensor should use, by the alpha-beta cost model of ``horovod_terngrad.operations.perfmodel``.

The network is described by HOROVOD_TERNGRAD_GBPS (default 1) and HOROVOD_TERNGRAD_ALPHA_US (default
50), which the launcher's profiles set (1 Gbit/s Ethernet, 100 Gbit/s InfiniBand).
"""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=8)
def _network(gbps: float, alpha_us: float):
    from ..operations.perfmodel import Network
    return Network.from_gbps("configured", gbps, alpha_us)


def network():
    return _network(float(os.environ.get("HOROVOD_TERNGRAD_GBPS", "1")),
                    float(os.environ.get("HOROVOD_TERNGRAD_ALPHA_US", "50")))


def choose_exchange(n, n_ranks: int, fmt: str, net=None) -> str:
    """'allgather' or 'sharded', whichever the model predicts to be faster for one n-element tensor
    (or a fused group: n = the members' element counts)."""
    if n_ranks <= 2:
        return "allgather"   # with two ranks sharding cannot receive less, and costs one more collective
    from ..operations.perfmodel import choose_exchange as model_choice
    method = model_choice(n, n_ranks, net or network(), packing=fmt).method
    return "sharded" if method == "terngrad_sharded" else "allgather"
