"""When a ternarized gradient travels at full precision instead: the refresh schedule of Adam's second moment.

TernGrad's ternary noise inflates Adam's second moment (E[(s·t)^2] = s·|g| >= g^2), so an Adam fed ternary
gradients takes shorter steps than fp32 Adam.  ``horovod_terngrad.optim`` keeps that noise out of v: v is
updated only from exchanges that carried the exact average (0/1 Adam's idea, arXiv 2202.06009), and every
other exchange is ternary and updates the first moment only.  This module says which exchanges those are: a
pure function of how many times the tensor was exchanged before (a count every rank keeps alike), so the
exchange and the optimizer, and every rank, agree on it without a message.

The schedule: the first ``warmup`` exchanges at full precision; then ``per_phase`` refreshes ``interval``
exchanges apart, ``per_phase`` refreshes twice as far apart, and so on, until the spacing reaches
``max_interval``, which it keeps.  ``count(n)`` (refreshes among the first n exchanges) prices a run of
any length exactly, so the bits per element over a run are known in advance (``bits_per_element``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RefreshSchedule:
    warmup: int = 8
    interval: int = 4
    per_phase: int = 4
    max_interval: int = 128

    def __post_init__(self):
        for name in ("warmup", "interval", "per_phase", "max_interval"):
            v = getattr(self, name)
            if int(v) != v or v < (0 if name == "warmup" else 1):
                raise ValueError(f"RefreshSchedule.{name} must be an integer >= {0 if name == 'warmup' else 1}, "
                                 f"got {v!r}")
        if self.max_interval < self.interval:
            raise ValueError(f"RefreshSchedule.max_interval ({self.max_interval}) must be >= interval "
                             f"({self.interval})")

    def _phases(self):
        """(spacing, refreshes) of each phase before the spacing settles at max_interval."""
        gap = self.interval
        while gap < self.max_interval:
            yield gap, self.per_phase
            gap *= 2

    def full_precision(self, step: int) -> bool:
        """Whether the tensor's exchange number ``step`` (0-based) carries the exact average."""
        if step < 0:
            raise ValueError(f"exchange number must be >= 0, got {step}")
        if step < self.warmup:
            return True
        # the last warm-up exchange (or, without a warm-up, exchange 0) anchors the spacing
        offset = step - max(self.warmup - 1, 0)
        if self.warmup == 0 and step == 0:
            return True
        for gap, n in self._phases():
            if offset <= gap * n:
                return offset % gap == 0
            offset -= gap * n
        return offset % self.max_interval == 0

    def count(self, steps: int) -> int:
        """How many of the exchanges 0 .. steps-1 carry the exact average."""
        if steps <= 0:
            return 0
        total = min(steps, max(self.warmup, 1))
        anchor = max(self.warmup - 1, 0)
        left = steps - 1 - anchor              # exchanges after the anchor, up to steps-1
        for gap, n in self._phases():
            if left <= 0:
                return total
            span = gap * n
            total += min(left, span) // gap
            left -= span
        if left > 0:
            total += left // self.max_interval
        return total

    def bits_per_element(self, steps: int, ternary_bits: float, full_bits: float = 32.0) -> float:
        """Bits per element a tensor's exchanges average over its first ``steps`` exchanges, when a ternary
        exchange costs ``ternary_bits`` per element (payload, scalers and header: codec.sizes) and a full-precision
        one ``full_bits``."""
        if steps <= 0:
            raise ValueError(f"steps must be >= 1, got {steps}")
        fp = self.count(steps)
        return (fp * full_bits + (steps - fp) * ternary_bits) / steps

    def steady_bits_per_element(self, ternary_bits: float, full_bits: float = 32.0) -> float:
        """The average once the spacing has settled at ``max_interval`` (the limit of a very long run)."""
        return ternary_bits + (full_bits - ternary_bits) / self.max_interval
