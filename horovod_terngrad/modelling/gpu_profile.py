"""A GPU profile of the codec for the performance model: measured rates from ``scripts/gpu_check.sh``'s JSON.

``perfmodel.predict_step`` / ``predict_hsdp_step`` charge the codec ``codec_work_elements / codec_elements_per_s``
when given a rate (they treat it as free otherwise).  A GPU profile supplies that rate from what one GPU measured
(``docs/gpu/*.json``, key ``codec_profile``):

* ``compress_elements_per_s``: statistics, clip, ternarize and pack (prepare + encode) of an fp32 gradient, per
  gradient element;
* ``decode_elements_per_s``: the decode of 2 payloads, per element written.

``codec_work_elements`` counts element operations without telling encodes from decodes (an allgather's decode
of N payloads is N·n of them), so the profile charges every one at the slower of the compress rate and the
decode's rate per payload element (twice its rate per element written): an upper bound on the codec's time.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuCodecProfile:
    """Codec rates measured on one GPU (elements per second) and where they come from."""

    device: str
    compress_elements_per_s: float
    decode_elements_per_s: float
    source: str = ""

    def __post_init__(self):
        for name in ("compress_elements_per_s", "decode_elements_per_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"GpuCodecProfile: {name} must be a positive number of elements/s, got {v!r}")

    @property
    def codec_elements_per_s(self) -> float:
        """The rate ``perfmodel`` charges every codec element operation at: the slower of compress per element
        and decode per payload element (2 payloads per element written)."""
        return min(self.compress_elements_per_s, 2.0 * self.decode_elements_per_s)

    @classmethod
    def from_check(cls, check: dict) -> "GpuCodecProfile":
        """The profile of a gpu_check JSON (its ``codec_profile``); ValueError naming what is missing."""
        prof = check.get("codec_profile")
        if not isinstance(prof, dict):
            raise ValueError(f"gpu_check JSON of {check.get('device', 'an unknown device')!r} has no "
                             "'codec_profile' (it ran without a GPU, or its kernel table did not finish)")
        missing = [k for k in ("compress_elements_per_s", "decode_elements_per_s") if k not in prof]
        if missing:
            raise ValueError(f"gpu_check JSON's codec_profile lacks {', '.join(missing)}")
        return cls(str(prof.get("device", check.get("device", ""))), float(prof["compress_elements_per_s"]),
                   float(prof["decode_elements_per_s"]), str(prof.get("source", "")))


__all__ = ["GpuCodecProfile"]
