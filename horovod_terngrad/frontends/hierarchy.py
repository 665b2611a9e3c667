"""Turning a flat engine into the node-aware one (exchange/hierarchical.py) where the job allows it.

Both frontends call this once per world, at their first tensor to ternarize (every rank at the same
point): one allgather of host identities (``exchange.hierarchical.discover``) gives every rank the same
topology; then the intra-node and inter-node groups are made, every rank making all of them in the same
order:

* Horovod: process sets.  Sets the user registered at ``hvd.init(process_sets=[...])`` with the same
  ranks are reused; others are added with ``hvd.add_process_set``, which needs
  ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` when ``hvd.init()`` runs.  ``import horovod_terngrad`` sets that
  default before a script's ``hvd.init()`` (and ``terngrad-launch`` and the sbatch scripts export it), so
  ``compression=TernGrad`` stays a one-line change under plain ``horovodrun``/``mpirun``.
* torch.distributed (DDP): ``dist.new_group`` for every node and every cross group, on the hook's backend.

Where the hierarchy cannot apply, the flat engine stays and rank 0 logs why, once per process and reason:
one node, one rank per node, nodes with different rank counts, Horovod elastic (its reset re-initializes
Horovod without process sets), process sets that cannot be added.  Every rank decides from the same
allgathered list and the same environment, so no rank takes the hierarchy while another does not.
"""
from __future__ import annotations

import logging
import os

from ..exchange import Exchange
from ..exchange.hierarchical import HierarchicalExchange, discover

log = logging.getLogger("horovod_terngrad")
_said: set = set()


def _flat(flat: Exchange, reason: str) -> Exchange:
    level = logging.WARNING if flat.config.hierarchical is True else logging.INFO
    if reason not in _said:
        _said.add(reason)
        if flat.coll.rank == 0:
            log.log(level, "TernGrad: node-aware exchange off (hierarchical=%r): %s; every rank exchanges "
                    "with every other (flat)", flat.config.hierarchical, reason)
    return flat


def _said_on(flat, topo) -> None:
    key = ("on", topo.describe())
    if key not in _said:
        _said.add(key)
        if flat.coll.rank == 0:
            log.info("TernGrad: node-aware exchange (hierarchical=%r) on %s", flat.config.hierarchical, topo.describe())


def horovod_engine(flat: Exchange) -> Exchange | HierarchicalExchange:
    """The engine for Horovod's global process set: ``flat`` or the hierarchical one over it."""
    if flat.config.hierarchical is False or flat.coll.size < 2:
        return flat
    if os.environ.get("HOROVOD_ELASTIC", "0") not in ("", "0"):
        return _flat(flat, "Horovod elastic re-initializes Horovod without process sets at every reset")
    topo = discover(flat.coll)
    reason = topo.flat_reason()
    if reason is not None:
        return _flat(flat, reason)
    import horovod.torch as hvd
    from horovod.common import process_sets as ps_mod

    from ..exchange import HorovodCollectives
    existing = {tuple(sorted(r)): i for i, r in hvd.mpi_ops._basics._get_process_set_ids_and_ranks().items()}
    wanted = topo.local_groups() + topo.cross_groups()
    missing = [g for g in wanted if tuple(sorted(g)) not in existing]
    dynamic = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0") not in ("", "0")
    if missing and not dynamic:
        return _flat(flat, f"{len(missing)} process sets of the topology are not registered and "
                           "HOROVOD_DYNAMIC_PROCESS_SETS was not set when hvd.init() ran (import horovod_terngrad "
                           "before hvd.init(), or pass them to hvd.init(process_sets=...))")
    sets = {}
    for g in wanted:              # every rank, in the same order
        key = tuple(sorted(g))
        if key in existing:
            sets[g] = ps_mod._temp_process_set_object(existing[key])
            sets[g].ranks, sets[g].mpi_comm = list(key), None
        else:
            sets[g] = hvd.add_process_set(list(key))
            existing[key] = sets[g].process_set_id
    me = flat.coll.rank
    local = HorovodCollectives(sets[topo.local_ranks_of(me)])
    cross = HorovodCollectives(sets[topo.cross_ranks_of(me)])
    _said_on(flat, topo)
    return HierarchicalExchange(flat, local, cross, topo, end_of_step_sync=True)


def dist_engine(flat: Exchange, make_collectives) -> Exchange | HierarchicalExchange:
    """The DDP hook's engine: ``flat`` or the hierarchical one; ``make_collectives(ranks, intra_node)``
    makes a ``DistCollectives`` on a new subgroup of those ranks of the hook's group (called for every
    group, on every rank, in the same order: ``dist.new_group`` is collective)."""
    if flat.config.hierarchical is False or flat.coll.size < 2:
        return flat
    topo = discover(flat.coll)
    reason = topo.flat_reason()
    if reason is not None:
        return _flat(flat, reason)
    made = {g: make_collectives(list(g), True) for g in topo.local_groups()}
    made.update({g: make_collectives(list(g), False) for g in topo.cross_groups()})
    me = flat.coll.rank
    _said_on(flat, topo)
    return HierarchicalExchange(flat, made[topo.local_ranks_of(me)], made[topo.cross_ranks_of(me)], topo)
