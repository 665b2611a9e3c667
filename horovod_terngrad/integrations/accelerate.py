"""TernGrad's per-step figures through Accelerate's trackers (``accelerator.log``).

    from horovod_terngrad.integrations.accelerate import TernGradAccelerateLogger
    accelerator = Accelerator(log_with="tensorboard", project_dir="runs"); accelerator.init_trackers("lm")
    model, opt = accelerator.prepare(model, opt)
    state = horovod_terngrad.ddp.register(model)
    tg_log = TernGradAccelerateLogger(accelerator, state)
    for step ...:
        ...; opt.step()
        tg_log.log(step)            # accelerator.log({"terngrad/bits_per_element": ..., ...}, step=step)

``source``: the frontend state, or the model ``prepare`` returned (its DDP model's TernGrad hook state).  Every
rank must call ``log`` (each reads its own counters); Accelerate writes on the main process only.  This module
does not import Accelerate: it only calls ``accelerator.log``.
"""
from __future__ import annotations

from .figures import StepFigures, find_state


class TernGradAccelerateLogger:
    def __init__(self, accelerator, source):
        if not hasattr(source, "stats"):
            found = find_state(source)
            if found is None:
                raise RuntimeError("TernGradAccelerateLogger: the prepared model's DDP object has no TernGrad hook; "
                                   "call horovod_terngrad.ddp.register(model) first or pass its state")
            source = found
        self.accelerator = accelerator
        self.figures = StepFigures(source)

    def log(self, step: int | None = None, steps: int = 1) -> dict:
        """Hand the figures since the last call (per step over ``steps`` steps) to ``accelerator.log``; returns
        them ({} when nothing was ternarized since)."""
        figures = self.figures.read(steps)
        if figures:
            self.accelerator.log(figures, step=step)
        return figures
