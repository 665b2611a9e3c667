"""The errors TernGrad raises; each names the tensor and the problem, and is raised on every rank together."""


class TernGradError(RuntimeError):
    """Base class of the errors TernGrad raises on every rank together."""


class NonFiniteGradientError(TernGradError, FloatingPointError):
    """A gradient held NaN or Inf on at least one rank (raised on all ranks)."""


class RankMismatchError(TernGradError):
    """Ranks handed TernGrad tensors that disagree (shape, size or dtype) under one name."""
