"""TernGrad's per-step figures in the transformers ``Trainer``'s logs: a ``TrainerCallback``.

    from horovod_terngrad.integrations.transformers import TernGradTrainerCallback
    trainer = Trainer(...)
    TernGradTrainerCallback.attach(trainer)     # first in trainer's callbacks, reading trainer's DDP model

``attach`` needs the ``Trainer``, so it comes after the constructor: ``Trainer(callbacks=[...])`` cannot name the
trainer it is building.  ``trainer.add_callback(TernGradTrainerCallback(trainer))`` works too, but puts the callback
after the reporting ones, which then do not see the figures (``state.log_history`` still gets them).

At every log (``logging_steps``) the figures of the steps since the last one (figures.py: bits per element, and
per step the bytes sent and saved against fp32 and bf16, codec and wait milliseconds) are added to the Trainer's
``logs``, under ``terngrad/...``: to the entry of ``trainer.state.log_history`` and to what every callback after
this one receives.  The Trainer puts its reporting callbacks (TensorBoard, W&B, MLflow, ...) before the ones a user
passes, so ``attach`` puts this one first, where they see the figures too.

``source``: the frontend state, a zero-argument callable returning it, or the ``Trainer`` whose DDP model carries
TernGrad's hook (found at the first step: the Trainer wraps the model in ``train()``).
"""
from __future__ import annotations

from transformers import TrainerCallback

from .figures import StepFigures, find_state


class TernGradTrainerCallback(TrainerCallback):
    def __init__(self, source):
        self.source = source
        self.figures = StepFigures(None)
        self._bound = False
        self._logged_step = 0

    @classmethod
    def attach(cls, trainer, source=None) -> "TernGradTrainerCallback":
        """Put a callback first in ``trainer``'s callbacks (reading ``source``, default the trainer) and return it."""
        callback = cls(trainer if source is None else source)
        trainer.callback_handler.callbacks.insert(0, callback)
        return callback

    def _resolve(self):
        src = self.source
        if hasattr(src, "model_wrapped") and hasattr(src, "callback_handler"):     # a Trainer
            try:
                return find_state(src)
            except TypeError:            # the Trainer wrapped the model in no DDP (one process)
                return None
        if callable(src) and not hasattr(src, "stats"):
            return src()
        return src

    def on_step_begin(self, args, state, control, **kwargs):
        if not self._bound:
            source = self._resolve()
            if source is None:
                if args.world_size > 1:
                    raise RuntimeError("TernGradTrainerCallback: no TernGrad state found at the first step (the "
                                       "Trainer's DDP model has no TernGrad hook); register it first or pass it")
                return          # one process: the Trainer wraps nothing, nothing is exchanged
            self.figures.bind(source)
            self._bound, self._logged_step = True, state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        figures = self.figures.read(state.global_step - self._logged_step)
        self._logged_step = state.global_step
        if not figures:
            return
        entry = state.log_history[-1] if state.log_history else None
        # Trainer.log appended {**logs, "step": global_step} just before calling on_log: that entry gets them too
        is_this_log = (entry is not None and entry.get("step") == state.global_step
                       and all(entry.get(k) == v for k, v in logs.items()))
        logs.update(figures)
        if is_this_log:
            entry.update(figures)
