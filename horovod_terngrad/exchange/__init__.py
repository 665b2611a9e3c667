"""Layer 3: how packed payloads travel between ranks, over a small collective interface."""
from .allgather import AllgatherExchange, ExchangeStats, check_gradient

#: The exchange engine (the stable name; ``AllgatherExchange`` is the old one).
Exchange = AllgatherExchange
from .collectives import (CollectiveError, Collectives, HorovodCollectives, ThreadCollectives,
                          ThreadWorld, run_ranks)

__all__ = ["Exchange", "AllgatherExchange", "ExchangeStats", "check_gradient", "CollectiveError",
           "Collectives", "HorovodCollectives", "ThreadCollectives", "ThreadWorld", "run_ranks"]
