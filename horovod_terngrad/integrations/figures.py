"""Per-step figures of a TernGrad exchange, computed from the counters the frontends keep.

Every frontend state (the DDP hook's ``TernGradState``, the FSDP frontend's ``TernGradFSDPState``, the Horovod
``TernGradCompressor``) holds one ``ExchangeStats`` (``.stats``) whose counters only grow.  ``StepFigures``
remembers them at its last ``read()`` and turns the difference into figures per step:

``terngrad/bits_per_element``  bits this rank handed to collectives per ternarized element (payload and
                               handshake over elements: 2.03 for 2-bit packing with one scaler per tensor)
``terngrad/bytes_sent``        those bytes, per step
``terngrad/bytes_saved_vs_fp32``  4 bytes per ternarized element minus the bytes sent, per step: what sending the
                               same gradients at full precision through the same collective would have added
``terngrad/bytes_saved_vs_bf16``  the same against 2 bytes per element
``terngrad/codec_ms``          time in encode and decode, per step
``terngrad/wait_ms``           time waiting for the handshake and payload collectives, per step

The figures are one rank's (every rank sends alike; frameworks log rank 0's).  Tensors the policy keeps at full
precision (``min_numel``, ``exclude``) are in none of them: they travel as without TernGrad.
"""
from __future__ import annotations

from ..exchange.stats import ExchangeStats

FIGURE_KEYS = ("terngrad/bits_per_element", "terngrad/bytes_sent", "terngrad/bytes_saved_vs_fp32",
               "terngrad/bytes_saved_vs_bf16", "terngrad/codec_ms", "terngrad/wait_ms")
FP32_BYTES, BF16_BYTES = 4, 2


def find_state(obj):
    """The TernGrad DDP hook's state registered on the ``DistributedDataParallel`` model inside ``obj`` (a Lightning
    trainer or module, a transformers ``Trainer``, a model Accelerate prepared, the DDP model itself), or None when
    that model carries no TernGrad hook.  Raises ``TypeError`` (``find_ddp``'s) when ``obj`` holds no DDP model."""
    from ..frontends.ddp import TernGradState, find_ddp
    ddp = find_ddp(obj)
    # (hook, state) pairs DDP keeps for the hooks registered on it; TernGrad's state is the one that is a TernGradState
    for _, state in getattr(ddp, "_comm_hooks", ()):
        if isinstance(state, TernGradState):
            return state
    return None


def stats_of(source) -> ExchangeStats | None:
    """The ``ExchangeStats`` of ``source``: the stats themselves, or anything with ``.stats`` (every frontend
    state, the Horovod compressor); None when ``source`` is None."""
    if source is None or isinstance(source, ExchangeStats):
        return source
    stats = getattr(source, "stats", None)
    if not isinstance(stats, ExchangeStats):
        raise TypeError(f"TernGrad figures: {type(source).__name__} has no TernGrad counters (.stats of type "
                        f"ExchangeStats); pass a TernGradState, TernGradFSDPState or TernGradCompressor")
    return stats


class StepFigures:
    """Figures per step of one stats object since the last ``read()`` (the first read counts from construction,
    or from zero with ``since_start=True``)."""

    def __init__(self, source, since_start: bool = False):
        self.stats = stats_of(source)
        self._last = None if self.stats is None else ({} if since_start else self._counters())

    def bind(self, source) -> None:
        """Start reading ``source`` (a frontend state found after construction), counting from now."""
        self.stats = stats_of(source)
        self._last = self._counters()

    def _counters(self) -> dict:
        st = self.stats
        return {"elements": st.elements, "sent": st.bytes_sent, "codec_s": st.codec_s,
                "wait_s": st.handshake_wait_s + st.gather_wait_s}

    def read(self, steps: int = 1) -> dict:
        """The figures of what was exchanged since the last read, per step over ``steps`` steps; {} when nothing
        was ternarized since (no exchange yet, an accumulation step, compression off)."""
        if self.stats is None:
            return {}
        now = self._counters()
        delta = {k: v - self._last.get(k, 0) for k, v in now.items()}
        self._last = now
        if delta["elements"] <= 0:
            return {}
        steps = max(int(steps), 1)
        elements, sent = delta["elements"], delta["sent"]
        return {"terngrad/bits_per_element": 8.0 * sent / elements,
                "terngrad/bytes_sent": sent / steps,
                "terngrad/bytes_saved_vs_fp32": (FP32_BYTES * elements - sent) / steps,
                "terngrad/bytes_saved_vs_bf16": (BF16_BYTES * elements - sent) / steps,
                "terngrad/codec_ms": 1000.0 * delta["codec_s"] / steps,
                "terngrad/wait_ms": 1000.0 * delta["wait_s"] / steps}
