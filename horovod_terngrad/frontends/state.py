"""All the mutable state of one compressor, in one object that can be saved, restored and reset.

* ``steps``: per process set, per tensor name, the exchanges started so far: the ``step`` word of every
  random stream key.  Saving and restoring it makes a resumed run draw exactly the streams an
  uninterrupted run draws.
* ``engines``: one ``exchange.Engine`` per process set (created on first use), sharing ``steps``,
  ``stats`` and ``inspection``.
* ``fusions``: per optimizer (weakly held), its tensor-fusion state (fusion_state.py).
* ``world``: Horovod's handle table when the engines were made; a new one means Horovod was
  re-initialized (elastic reset), and ``reset_world()`` drops what belonged to the old world.
* ``stats``: what was sent, received and waited for; ``inspection``: per-tensor figures for metrics.
* counters of the frontend: uncompressed elements, unnamed tensors; members of direct grouped calls.

``state_dict()`` holds plain Python values (JSON-able); in-flight exchanges and fusion plans are not
saved: they are rebuilt from the next step on.  ``reset()`` forgets everything but the configuration;
``reset_world()`` only what belongs to one Horovod world (exchanges in flight, fusion plans).

``StateOwner`` is what a frontend that keeps one ``CompressorState`` (the Horovod compressor, the DDP hook's
state) shows of it: the counters, and ``state_dict()`` / ``load_state_dict()`` / ``reset()`` under the
frontend's lock.
"""
from __future__ import annotations

import os
import weakref

from ..config import TernGradConfig
from ..exchange import Engine, ExchangeStats, Inspection

STATE_VERSION = 1


def frontend_config(config, settings: dict):
    """A frontend's ``TernGradConfig``: the one given, or one made from keyword settings (not both)."""
    if config is not None and settings:
        raise TypeError("pass either a TernGradConfig or keyword settings, not both")
    return config if config is not None else TernGradConfig(**settings)


def compression_enabled() -> bool:
    """``HOROVOD_TERNGRAD=0`` (or off/false/no) turns compression off without touching the training script (the
    launcher's --no-terngrad sets it): every tensor then travels as with ``Compression.none``."""
    return os.environ.get("HOROVOD_TERNGRAD", "1").strip().lower() not in ("0", "off", "false", "no")


def process_set_key(process_set) -> str:
    """A key every rank computes alike: 'global', or 'process_set.<id>' (Horovod's process-set id)."""
    if process_set is None or getattr(process_set, "process_set_id", None) == 0:   # 0: hvd.global_process_set
        return "global"
    return f"process_set.{getattr(process_set, 'process_set_id', None)}"


class CompressorState:
    __slots__ = ("stats", "inspection", "steps", "engines", "fusions", "uncompressed_elements", "unnamed",
                 "world", "grouped_calls")

    def __init__(self):
        self.stats = ExchangeStats()
        self.inspection = Inspection()
        self.steps: dict[str, dict[str, int]] = {}
        self.engines: dict[str, Engine] = {}
        self.fusions = weakref.WeakKeyDictionary()     # optimizer -> OptimizerFusion
        self.uncompressed_elements = 0
        self.unnamed = 0                   # tensors named by call order so far
        self.world = None
        self.grouped_calls: dict = {}      # id(tensor list of a grouped call) -> member indices named so far

    def engine(self, process_set, config, make_collectives, hierarchy=None) -> Engine:
        """The engine of a process set, created with ``make_collectives(process_set)`` on first use; on the
        global set ``hierarchy(flat engine)`` may return the node-aware engine over it (hierarchy.py)."""
        key = process_set_key(process_set)
        eng = self.engines.get(key)
        if eng is None:
            eng = Engine(make_collectives(process_set), config, self.stats, self.inspection,
                           self.steps.setdefault(key, {}))
            if hierarchy is not None and key == "global":
                eng = hierarchy(eng)
            self.engines[key] = eng
        return eng

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "steps": {k: dict(v) for k, v in self.steps.items()},
                "stats": self.stats.state_dict(), "uncompressed_elements": self.uncompressed_elements,
                "unnamed": self.unnamed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"TernGrad compressor state of version {state.get('version')!r}; this is "
                             f"version {STATE_VERSION}")
        for key, steps in state["steps"].items():      # in place: the engines share these dicts
            mine = self.steps.setdefault(key, {})
            mine.clear()
            mine.update({str(n): int(s) for n, s in steps.items()})
        for key in set(self.steps) - set(state["steps"]):
            self.steps[key].clear()
        self.stats.load_state_dict(state["stats"])
        self.uncompressed_elements = int(state["uncompressed_elements"])
        self.unnamed = int(state["unnamed"])

    def reset_world(self) -> None:
        """Forget what belongs to one Horovod world: engines (and their exchanges in flight), fusion plans,
        half-named grouped calls.  Step counters and counters stay."""
        for eng in self.engines.values():
            eng.reset()
        self.engines.clear()
        self.fusions.clear()
        self.grouped_calls.clear()

    def reset(self) -> None:
        """Forget engines (and their exchanges in flight), fusion plans, step counters and counters."""
        self.reset_world()
        for steps in self.steps.values():
            steps.clear()
        self.stats.reset()
        self.inspection.clear()
        self.uncompressed_elements = self.unnamed = 0


class StateOwner:
    """The counters and the checkpoint methods of a frontend holding its ``CompressorState`` in ``self.state``,
    guarded by ``self._lock`` (a ``threading.Lock``: the one its exchanges run under).  A frontend that holds
    more in flight than its engines do forgets that in ``_forget_in_flight`` (called by ``reset``)."""

    __slots__ = ()

    @property
    def stats(self) -> ExchangeStats:
        """Bytes this rank handed to collectives and received, seconds waited and spent in the codec."""
        return self.state.stats

    @property
    def inspection(self) -> Inspection:
        """Per-tensor figures for metrics (``exchange.Inspection``)."""
        return self.state.inspection

    @property
    def uncompressed_elements(self) -> int:
        """Elements sent at full precision so far (the policy's small and excluded tensors)."""
        return self.state.uncompressed_elements

    def state_dict(self) -> dict:
        """Step counters of the random streams and counters (plain values): save it with a checkpoint so that
        a resumed run draws the streams an uninterrupted run would.  Taken under the frontend's lock, so after
        the exchange in progress (the DDP hook's worker: the bucket it holds)."""
        with self._lock:
            return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.state.load_state_dict(state)

    def reset(self) -> None:
        """Forget exchanges in flight, fusion plans, step counters and counters (keeps the settings)."""
        with self._lock:
            self._forget_in_flight()
            self.state.reset()

    def _forget_in_flight(self) -> None:
        """What the frontend holds in flight beyond its engines: nothing here."""
