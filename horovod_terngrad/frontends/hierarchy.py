"""Turning a flat engine into the node-aware one (exchange/hierarchical.py) where the job allows it.

Both frontends call this once per world, when they make the engine, at their first tensor to ternarize (every
rank at the same point), right before the engine's plan step (``plan_exchange``): one allgather of host identities
(``exchange.topology.discover``) gives every rank the same topology; then the intra-node and inter-node groups
are made, every rank making all of them in the same order:

* Horovod: by default the groups' collectives are carried by world collectives
  (``exchange.world_groups``: one world alltoall with zero splits outside each rank's group).  That needs
  nothing of ``hvd.init()``, so importing TernGrad before or after it makes no difference, it works under
  elastic, and a dead rank ends the survivors with Horovod's ``HorovodInternalError`` as the flat exchange
  does.  ``HOROVOD_TERNGRAD_NODE_GROUPS=process_sets`` uses Horovod process sets instead (those the user
  registered at ``hvd.init(process_sets=[...])`` with the same ranks, others added with
  ``hvd.add_process_set``, which Horovod allows only if ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` was set when
  ``hvd.init()`` ran; whether it was is learned by trying, not from the variable).  A shared scaler or the
  sharded exchange across nodes needs process sets (world_groups carries only the per-rank allgather).
* torch.distributed (DDP): ``dist.new_group`` for every node and every cross group, on the hook's backend.

Where the hierarchy cannot apply, the flat exchange runs, and the flat engine's plan line (rank 0, once) says
why: at INFO where the job is one node or one rank per node (nothing to be node-aware about), else at WARNING,
which Python shows without any logging setup.  Where it applies, the node-aware engine's plan line says what
runs: which group sizes go node-aware on the priced links, and how each side travels.  ``hierarchical=True``
where a multi-node job cannot have it raises ``TernGradError`` on every rank, saying what to do.  Every rank decides from the same allgathered
list, the same settings and the same outcome of Horovod's calls, so no rank takes the hierarchy while
another does not.
"""
from __future__ import annotations

import logging
import os

from ..errors import TernGradError
from ..exchange import Engine, policy
from ..exchange.hierarchical import HierarchicalEngine
from ..exchange.topology import discover
from ..exchange.world_groups import WorldGroupCollectives

log = logging.getLogger("horovod_terngrad")
_said: set = set()

NODE_GROUPS_ENV = "HOROVOD_TERNGRAD_NODE_GROUPS"
NODE_GROUPS = ("world", "process_sets")


def _flat(flat: Engine, reason: str, quiet: bool = False) -> Engine:
    """The flat engine, which its plan's line says why (``Engine.node_aware_off``): at INFO if ``quiet`` (one node, or
    one rank per node), else at WARNING.  ``hierarchical=True`` warns where ``quiet`` (a multi-node script run on one
    machine still runs) and raises elsewhere, on every rank (every rank reaches the same reason)."""
    if flat.config.hierarchical is True and not quiet:
        raise TernGradError(f"TernGrad: hierarchical=True, but the node-aware exchange cannot run here: {reason}. "
                            "Pass hierarchical='auto' (the default) or False to run the flat exchange")
    flat.node_aware_off = (reason, quiet and flat.config.hierarchical is not True)
    return flat


def node_groups_setting() -> str:
    value = os.environ.get(NODE_GROUPS_ENV, "world").strip().lower() or "world"
    if value not in NODE_GROUPS:
        raise ValueError(f"{NODE_GROUPS_ENV}={value!r}: must be one of {NODE_GROUPS}")
    return value


def _horovod_process_sets(topo):
    """The topology's process sets, reused where registered, added where Horovod allows it; a string
    saying why not otherwise.  Every rank makes the same calls in the same order."""
    import horovod.torch as hvd
    from horovod.common import process_sets as ps_mod
    existing = {tuple(sorted(r)): i for i, r in hvd.mpi_ops._basics._get_process_set_ids_and_ranks().items()}
    sets = {}
    for g in topo.local_groups() + topo.cross_groups():              # every rank, in the same order
        key = tuple(sorted(g))
        if key in existing:
            sets[g] = ps_mod._temp_process_set_object(existing[key])
            sets[g].ranks, sets[g].mpi_comm = list(key), None
            continue
        try:
            sets[g] = hvd.add_process_set(list(key))
        except ValueError as e:   # Horovod: dynamic process sets were off at hvd.init() (on every rank alike)
            return (f"Horovod cannot add process sets ({e}); register the topology's groups at "
                    "hvd.init(process_sets=...), or set HOROVOD_DYNAMIC_PROCESS_SETS=1 before hvd.init()")
        existing[key] = sets[g].process_set_id
    return sets


def _topology(flat: Engine):
    """The job's topology where a node-aware exchange may run over ``flat``'s ranks, else None (the flat
    engine stays; where the topology is why, said by ``_flat``).  Every rank gets the same answer: one
    allgather of host identities."""
    if flat.config.hierarchical is False or flat.coll.size < 2:
        return None
    topo = discover(flat.coll)
    reason = topo.flat_reason()
    if reason is not None:
        _flat(flat, reason, quiet=topo.single_node_or_rank())
        return None
    return topo


def horovod_engine(flat: Engine) -> Engine | HierarchicalEngine:
    """The engine for Horovod's global process set: ``flat`` or the hierarchical one over it."""
    topo = _topology(flat)
    if topo is None:
        return flat
    from ..exchange import HorovodCollectives
    me = flat.coll.rank
    use = node_groups_setting()
    if use == "world" and not policy.world_groups_fit(flat.config):
        use = "process_sets"      # a shared scaler or the sharded exchange across nodes
    elastic = os.environ.get("HOROVOD_ELASTIC", "0") not in ("", "0")
    if use == "process_sets":
        if elastic:
            return _flat(flat, "Horovod elastic re-initializes Horovod without process sets at every reset, and "
                               "this configuration (shared_scaler=True or exchange='sharded') needs them")
        sets = _horovod_process_sets(topo)
        if isinstance(sets, str):
            if policy.world_groups_fit(flat.config):
                use = "world"
                if "process_sets.fallback" not in _said:
                    _said.add("process_sets.fallback")
                    if me == 0:
                        log.warning("TernGrad: %s=process_sets: %s; the node-aware exchange runs over world "
                                    "collectives instead", NODE_GROUPS_ENV, sets)
            else:
                return _flat(flat, sets)
    if use == "world":
        world = flat.coll
        local = WorldGroupCollectives(world, topo.local_ranks_of(me))
        cross = WorldGroupCollectives(world, topo.cross_ranks_of(me))
    else:
        local = HorovodCollectives(sets[topo.local_ranks_of(me)])
        cross = HorovodCollectives(sets[topo.cross_ranks_of(me)])
    return HierarchicalEngine(flat, local, cross, topo, end_of_step_sync=True,
                              over="over world collectives" if use == "world" else "over process sets")


def dist_engine(flat: Engine, make_collectives) -> Engine | HierarchicalEngine:
    """The DDP hook's engine: ``flat`` or the hierarchical one; ``make_collectives(ranks, intra_node)``
    makes a ``DistCollectives`` on a new subgroup of those ranks of the hook's group (called for every
    group, on every rank, in the same order: ``dist.new_group`` is collective)."""
    topo = _topology(flat)
    if topo is None:
        return flat
    made = {g: make_collectives(list(g), True) for g in topo.local_groups()}
    made.update({g: make_collectives(list(g), False) for g in topo.cross_groups()})
    me = flat.coll.rank
    return HierarchicalEngine(flat, made[topo.local_ranks_of(me)], made[topo.cross_ranks_of(me)], topo,
                              over="over torch.distributed subgroups")
