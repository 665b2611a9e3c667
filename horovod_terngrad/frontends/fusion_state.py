"""Tensor fusion state of one optimizer in the Horovod frontend.

The first step runs unfused and records which parameters were compressed; from the second step the
optimizer's parameters that were compressed in the previous step (so parameters Horovod never hands over,
sparse or frozen ones, stay out) are cut by ``exchange.fusion.cut`` in reverse registration order, the cut
is checked once across ranks (one small blocking allreduce: ranks that cut different groups turn fusion
off together instead of waiting on each other's collectives), and it is redone whenever the set changes.
``compress`` of a group member only records the tensor; the member that completes the group starts one
handshake and one exchange for all of them (``Exchange.start_group``).  Horovod calls every compress of a
step before the first decompress, so a group is normally complete by then; groups with members missing
are all started at the first decompress, in group order, as smaller groups.
"""
from __future__ import annotations

import torch

from ..config import TernGradConfig
from ..exchange import fusion


class FusedBatch:
    """One step's worth of a fused group: the tensors that arrived, then the tickets."""

    __slots__ = ("fusion", "group", "arrived", "tickets", "engine", "average")

    def __init__(self, fusion_state: "OptimizerFusion", group: int):
        self.fusion = fusion_state
        self.group = group
        self.arrived: dict[str, torch.Tensor] = {}
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
        name = f"terngrad.fused{self.group}" + (f".partial{len(order)}" if partial else "")
        tickets = self.engine.start_group([(self.arrived[n], n) for n in order], name, average=self.average,
                                          in_place=True)
        self.tickets = dict(zip(order, tickets))
        self.arrived = {}
        self.fusion.batches[self.group] = FusedBatch(self.fusion, self.group)


class FusedMember:
    """ctx of a tensor that travels in a fused group."""

    __slots__ = ("batch", "name")

    def __init__(self, batch: FusedBatch, name: str):
        self.batch = batch
        self.name = name


class OptimizerFusion:
    """The names compressed this step and last step, the cut built from them, and this step's batches."""

    __slots__ = ("current", "last", "seen_decompress", "plan", "planned_from", "group_of", "batches", "generation",
                 "disabled")

    def __init__(self, decompress_count: int):
        self.current: list[str] = []
        self.last: frozenset | None = None
        self.seen_decompress = decompress_count
        self.plan: fusion.FusionPlan | None = None
        self.planned_from: frozenset | None = None
        self.group_of: dict[str, int] = {}
        self.batches: list[FusedBatch] = []
        self.generation = 0
        self.disabled = False

    def new_step(self) -> None:
        if self.current:
            self.last = frozenset(self.current)
        self.current = []
        if self.plan is not None:          # a step abandoned before its groups went out
            self._fresh_batches()

    def replan(self, optimizer, config: TernGradConfig) -> float:
        """Cut the parameters compressed last step; returns the cut's checksum (for the ranks to agree)."""
        names = optimizer._parameter_names
        params = [p for g in optimizer.param_groups for p in g["params"] if p in names and names[p] in self.last]
        specs = [fusion.TensorSpec(names[p], p.numel(), str(p.device)) for p in reversed(params)]
        self.plan = fusion.cut(specs, config)
        self.planned_from = self.last
        self.group_of = {n: g for g, members in enumerate(self.plan.fused) for n in members}
        self._fresh_batches()
        self.generation += 1
        return self.plan.checksum()

    def _fresh_batches(self) -> None:
        self.batches = [FusedBatch(self, g) for g in range(len(self.plan.fused))]

    def planned_with(self, seen: frozenset) -> bool:
        return self.plan is not None and self.planned_from == seen

    def batch_for(self, name: str, numel: int) -> FusedBatch | None:
        g = self.group_of.get(name)
        if g is None or self.plan.numel[name] != numel:
            return None
        return self.batches[g]

    def start_incomplete(self) -> list:
        """Start, in group order, every group of this step with members missing (called at the first
        decompress, when all of this step's compress calls have been made); returns the missing names."""
        missing = []
        for batch in list(self.batches):
            if batch.arrived and batch.tickets is None:
                missing += [n for n in batch.members if n not in batch.arrived]
                batch.start(partial=True)
        return missing
