"""The fusion cut: which tensors share one handshake and one exchange (a pure function).

The Horovod frontend cuts the optimizer's parameters with it, the performance model and the timeline cut
a model's tensor sizes with it, so all three see the same groups.  Rules, applied to the tensors in the
order backward produces them (the reverse of registration order):

* a tensor the policy keeps at full precision (``config.compresses``: ``min_numel``, ``exclude``) travels
  uncompressed through Horovod's own allreduce and is in no group;
* consecutive compressed tensors join one group while its total stays within ``fusion_numel`` elements and
  they live on the same device; a tensor larger than the limit travels alone;
* a group of one (a lone tensor) travels under its own name, not as a fused group;
* ``fusion_numel = 0`` disables fusion: every compressed tensor travels alone;
* ``ramp_numel`` (a caller's choice, 0 by default: off) caps group k at ``ramp_numel · 2^k`` elements below
  ``fusion_numel``, so a list's first payload leaves after a short encode and each later group's encode runs
  while the one before is on the wire (the DDP frontend cuts each bucket so).

Every rank holds the same parameters in the same order, so every rank cuts the same groups; if ranks' models
differ, the handshake of the first group that differs says so on every rank (its layout checksum).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from ..config import TernGradConfig


@dataclass(frozen=True)
class TensorSpec:
    """What the cut needs to know about one tensor."""

    name: str
    numel: int
    device: str = "cpu"


@dataclass(frozen=True)
class FusionPlan:
    """The cut of one list of tensors: ``groups`` are tuples of names (a lone tensor is a group of one),
    in the order given; ``uncompressed`` the names the policy keeps at full precision."""

    groups: tuple
    uncompressed: tuple
    numel: dict

    @cached_property
    def fused(self) -> list:
        """The groups of more than one tensor, in order: the ones that travel as fused group ``i``
        (derived once: the frontend reads it for every tensor it compresses)."""
        return [g for g in self.groups if len(g) > 1]

    def group_sizes(self) -> list:
        """Element counts of every group's members."""
        return [[self.numel[n] for n in g] for g in self.groups]



def cut(tensors: Sequence[TensorSpec], config: TernGradConfig, ramp_numel: int = 0) -> FusionPlan:
    """Cut ``tensors`` (in backward order) into groups by the rules of the module docstring."""
    groups, uncompressed, numel = [], [], {}
    current, total, device = [], 0, None
    fusion = int(config.fusion_numel)
    limit = min(fusion, int(ramp_numel)) if ramp_numel > 0 and fusion else fusion
    for t in tensors:
        if not config.compresses(t.name, t.numel):
            uncompressed.append(t.name)
            continue
        numel[t.name] = int(t.numel)
        if current and (not limit or total + t.numel > limit or t.device != device):
            groups.append(tuple(current))
            current, total = [], 0
            limit = min(fusion, 2 * limit) if ramp_numel > 0 and fusion else limit
        current.append(t.name)
        total += t.numel
        device = t.device
    if current:
        groups.append(tuple(current))
    return FusionPlan(tuple(groups), tuple(uncompressed), numel)


def cut_sizes(sizes: Sequence[int], config: TernGradConfig, names: Sequence[str] | None = None) -> FusionPlan:
    """:func:`cut` of tensors given by their sizes in registration (forward) order, as a model lists its
    parameters; names default to their indices ("0", "1", ...)."""
    names = [str(i) for i in range(len(sizes))] if names is None else list(names)
    specs = [TensorSpec(n, int(s)) for n, s in zip(names, sizes)]
    return cut(specs[::-1], config)


__all__ = ["TensorSpec", "FusionPlan", "cut", "cut_sizes"]
