"""The errors TernGrad raises; each names the tensor and the problem, and is raised on every rank together."""


class TernGradError(RuntimeError):
    """Base class of the errors TernGrad raises on every rank together."""


class NonFiniteGradientError(TernGradError, FloatingPointError):
    """A gradient held NaN or Inf on at least one rank (raised on all ranks)."""

    @staticmethod
    def describe(name: str, shape: tuple, first: int, last: int) -> str:
        """The one wording, whichever exchange found it: the lowest and highest rank that held NaN/Inf."""
        return (f"TernGrad: gradient '{name}' (shape {tuple(shape)}) contains NaN or Inf on rank {first}"
                + (f" (and up to rank {last})" if last != first else ""))


class RankMismatchError(TernGradError):
    """Ranks handed TernGrad tensors that disagree (shape, size or dtype) under one name."""
