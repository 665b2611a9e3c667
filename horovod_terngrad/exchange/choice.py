"""Which exchange a tensor should use: the alpha-beta cost of each, for N ranks and n elements.

    allgather: (N-1)·alpha + (N-1)·P·beta                      P = payload bytes of one rank
    sharded:   2(N-1)·alpha + (N-1)/N·n·(b + L)/8·beta          b = 2 or 1.6, L = ceil(log2(2N+1))

(ring algorithms; the scaler handshake is common to both and left out).  alpha (s per message) and
beta (s per byte) default to a 1 Gbit/s Ethernet link; set HOROVOD_TERNGRAD_ALPHA_US and
HOROVOD_TERNGRAD_GBPS (the launcher's network profiles do) to describe another network.
"""
from __future__ import annotations

import os

from ..codec.packing import payload_size
from .sharded import sum_bits

BITS = {"2bit": 2.0, "base3": 1.6}


def network() -> tuple[float, float]:
    alpha = float(os.environ.get("HOROVOD_TERNGRAD_ALPHA_US", "50")) * 1e-6
    gbps = float(os.environ.get("HOROVOD_TERNGRAD_GBPS", "1"))
    return alpha, 8.0 / (gbps * 1e9)


def exchange_costs(n: int, n_ranks: int, fmt: str, alpha: float, beta: float) -> dict:
    N = n_ranks
    allgather = (N - 1) * alpha + (N - 1) * payload_size(n, fmt, 0) * beta
    sharded = 2 * (N - 1) * alpha + (N - 1) / N * n * (BITS[fmt] + sum_bits(N)) / 8 * beta
    return {"allgather": allgather, "sharded": sharded}


def choose_exchange(n: int, n_ranks: int, fmt: str, alpha: float | None = None, beta: float | None = None) -> str:
    """'allgather' or 'sharded', whichever the model predicts to be faster (ties: allgather)."""
    if n_ranks <= 2:
        return "allgather"   # sharding cannot receive less than one payload from the other rank
    if alpha is None or beta is None:
        alpha, beta = network()
    costs = exchange_costs(n, n_ranks, fmt, alpha, beta)
    return "sharded" if costs["sharded"] < costs["allgather"] else "allgather"
