"""Optimizers that know what TernGrad's exchange did with each gradient (layer 4, beside the frontends).

``Adam`` and ``AdamW`` are drop-in replacements for ``torch.optim.Adam`` / ``torch.optim.AdamW`` (same
signature and defaults, plus ``refresh`` and ``v_floor``): with a TernGrad exchange on any frontend, they keep the
ternary noise out of Adam's second moment (adam.py says how and why; docs/adam.md what it measured); without one,
they are torch's, bit for bit.

``OwnerStepOptimizer`` wraps one of them (or any optimizer class) so that each rank steps its own shard of the
weights and the ranks exchange ternary gradients and ternary weight differences: 3.2 bits per element received at
any N (owner_step.py).
"""
from ..codec.schedule import RefreshSchedule
from .adam import Adam, AdamW
from .owner_step import OwnerStepOptimizer

__all__ = ["Adam", "AdamW", "OwnerStepOptimizer", "RefreshSchedule"]
