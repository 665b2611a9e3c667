"""Optimizers that know what TernGrad's exchange did with each gradient (layer 4, beside the frontends).

``Adam`` and ``AdamW`` are drop-in replacements for ``torch.optim.Adam`` / ``torch.optim.AdamW`` (same
signature and defaults, plus ``refresh`` and ``v_floor``): with a TernGrad exchange on any frontend, they keep the
ternary noise out of Adam's second moment (adam.py says how and why; docs/adam.md what it measured); without one,
they are torch's, bit for bit.
"""
from ..codec.schedule import RefreshSchedule
from .adam import Adam, AdamW

__all__ = ["Adam", "AdamW", "RefreshSchedule"]
