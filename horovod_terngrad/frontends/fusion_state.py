"""Tensor fusion state of one optimizer in the Horovod frontend.

The plan is cut once, at the optimizer's first compressed gradient, from what every rank knows alike: the
optimizer's parameters that Horovod reduces (``_requires_update``: those that required a gradient when it
was built), their names and sizes, in reverse registration order (the order backward produces them), by
``exchange.fusion.cut``.  No step's local history enters it, so a worker that joins an elastic job later,
or a rank that ran fewer steps, forms exactly the same groups and names.

``compress`` of a group member only records the tensor; the member that completes the group starts one
handshake and one exchange for all of them (``Engine.start_group``), named ``terngrad.fused<g>.<first member>`` (the
member's name keeps two optimizers' groups apart when both are in flight on one process set).
Horovod calls every compress of a step before the first decompress, so a group is normally complete by
then.  Members Horovod never hands over (sparse gradients without ``sparse_as_dense``; parameters removed
from the update set) leave their group incomplete: at the first decompress every incomplete group starts
with the members that arrived, under the group's name + ``.partial`` (every rank names it alike; if ranks' members
differ, the handshake's layout checksum says so on every rank).  Ranks whose models differ cut different
plans; the handshake of the first group that differs raises ``RankMismatchError`` on every rank.
"""
from __future__ import annotations

import torch

from ..config import TernGradConfig
from ..exchange import fusion


class FusedBatch:
    """One step's worth of a fused group: the tensors that arrived, then the tickets."""

    __slots__ = ("fusion", "group", "arrived", "routes", "tickets", "engine", "average")

    def __init__(self, fusion_state: "OptimizerFusion", group: int):
        self.fusion = fusion_state
        self.group = group
        self.arrived: dict[str, torch.Tensor] = {}
        self.routes: dict = {}           # name -> its precision.Route (exchange/precision.py), from compress
        self.tickets: dict | None = None
        self.engine = None
        self.average = True

    @property
    def members(self) -> tuple:
        return self.fusion.plan.fused[self.group]

    def start(self, partial: bool = False) -> None:
        """Start the group's exchange with the members that arrived, and give the group a fresh batch for
        the next step (the members' ctx keep this one, whose tickets decompress reads)."""
        order = [n for n in self.members if n in self.arrived]
        name = f"terngrad.fused{self.group}.{self.members[0]}" + (".partial" if partial else "")
        tickets = self.engine.start_group([(self.arrived[n], n) for n in order], name, average=self.average,
                                          in_place=True, routes=[self.routes.get(n) for n in order])
        self.tickets = dict(zip(order, tickets))
        self.arrived, self.routes = {}, {}
        self.fusion.batches[self.group] = FusedBatch(self.fusion, self.group)


class FusedMember:
    """ctx of a tensor that travels in a fused group."""

    __slots__ = ("batch", "name")

    def __init__(self, batch: FusedBatch, name: str):
        self.batch = batch
        self.name = name


class OptimizerFusion:
    """The optimizer's fusion plan and this step's batch of every fused group."""

    __slots__ = ("plan", "group_of", "batches", "params")

    def __init__(self, optimizer, config: TernGradConfig):
        names = optimizer._parameter_names
        update = getattr(optimizer, "_requires_update", None) or {
            p for g in optimizer.param_groups for p in g["params"] if p.requires_grad}
        params = [p for g in optimizer.param_groups for p in g["params"] if p in update and p in names]
        specs = [fusion.TensorSpec(names[p], p.numel(), str(p.device)) for p in reversed(params)]
        self.plan = fusion.cut(specs, config)
        self.params = {names[p]: p for p in params}
        self.group_of = {n: g for g, members in enumerate(self.plan.fused) for n in members}
        self.fresh_batches()

    def fresh_batches(self) -> None:
        """Empty batches for every group (also drops what an abandoned step left in them)."""
        self.batches = [FusedBatch(self, g) for g in range(len(self.plan.fused))]

    def batch_for(self, name: str, numel: int) -> FusedBatch | None:
        g = self.group_of.get(name)
        if g is None or self.plan.numel[name] != numel:
            return None
        return self.batches[g]

    def start_incomplete(self) -> list:
        """Start, in group order, every group of this step with members missing (called at the first
        decompress, when all of this step's compress calls have been made); returns the missing names,
        but for sparse gradients (Horovod's sparse allreduce takes those: expected, not worth a warning)."""
        missing = []
        for batch in list(self.batches):
            if batch.arrived and batch.tickets is None:
                missing += [n for n in batch.members if n not in batch.arrived and not self._sparse(n)]
                batch.start(partial=True)
        return missing

    def _sparse(self, name: str) -> bool:
        grad = self.params[name].grad
        return grad is not None and grad.is_sparse
