"""Layer 3: how packed payloads travel between ranks, over a small collective interface."""
from .allgather import AllgatherExchange, ExchangeStats, check_gradient
from .collectives import (CollectiveError, Collectives, HorovodCollectives, ThreadCollectives,
                          ThreadWorld, run_ranks)

__all__ = ["AllgatherExchange", "ExchangeStats", "check_gradient", "CollectiveError",
           "Collectives", "HorovodCollectives", "ThreadCollectives", "ThreadWorld", "run_ranks"]
