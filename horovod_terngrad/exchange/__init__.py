"""Layer 3: how packed payloads travel between ranks, over a small collectives interface.

Words, one meaning each: *exchange* is this package and, in prose, averaging one group of gradients across the
ranks; the *setting* is what the user passes as ``TernGradConfig(exchange=...)`` ("default", "auto" or a
transport's name), which only ``policy`` turns into a plan; a *transport* is how one group's payloads travel
(a module below each); the ``Engine`` drives tickets through a transport; a *method* is what ``cost`` prices
(``"fp32"``, ``"terngrad_allgather"``, ...: ``cost.method_cost``).  ``names`` holds every method, transport and
setting name in one table, with the labels the performance model prints.

* ``collectives``: the interface; ``hvd_collectives`` (Horovod), ``dist_collectives`` (torch.distributed, for
  the DDP frontend) and ``thread_collectives`` (ranks in one process, for tests and the simulator) implement it;
  ``world_groups`` runs a group's collectives as world alltoalls (the node-aware exchange without process sets).
* ``engine``: ``Engine``, tickets and queues: the one place a gradient's path is driven.
* ``handshake``: the shared-scaler handshake vector, built and read in one place.
* the transports, one module each: ``allgather``, ``sharded``, ``reternarized`` and ``requantized`` (one of them
  per group), and ``joined`` (the one used while a rank is in hvd.join()); ``precision``: what an exchange did with each
  parameter's gradient, for the optimizers.
* ``policy``: for a group, the transport, whether it goes node-aware and across nodes by which transport, from the
  user's ``exchange=`` and ``hierarchical=`` settings (the one module that knows their names).
* ``cost``: the runtime cost model (pure pricing of the transports), which the policy and the performance model
  price with; ``network_env``: the configured network it prices where none was measured (read from the
  environment); ``link``: the measured link.
* ``hierarchical``: the node-aware (three-stage) exchange; ``node_wire``: its bf16 intra-node wire and reused
  buffers; ``topology``: which ranks share a node, and each group's shard plan.
* ``fusion``: the fusion cut (a pure function, shared with the performance model).
* ``stats``: counters and per-tensor inspection.
"""
from .collectives import CollectiveError, Collectives
from .dist_collectives import DistCollectiveError, DistCollectives
from .engine import Engine, Ticket, check_gradient, settle_full_precision
from .hvd_collectives import HorovodCollectives
from .stats import ExchangeStats, Inspection, LayerRecord
from .thread_collectives import ThreadCollectives, ThreadWorld, run_ranks

__all__ = ["Engine", "Ticket", "ExchangeStats", "Inspection", "LayerRecord", "check_gradient", "settle_full_precision",
           "CollectiveError", "Collectives", "DistCollectives", "DistCollectiveError", "HorovodCollectives", "ThreadCollectives", "ThreadWorld", "run_ranks"]
