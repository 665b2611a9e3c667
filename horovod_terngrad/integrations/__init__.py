"""TernGrad's per-step figures where users already look: the training framework's own logger.

* ``StepFigures`` (figures.py): what one rank's exchange did since it was last read, from the counters every
  frontend keeps (``ExchangeStats``): bits per ternarized element, bytes sent, bytes saved against sending the
  same elements as fp32 and as bf16, codec time and time spent waiting for collectives, per step.
* ``TernGradLoggingCallback`` (lightning.py): a Lightning ``Callback`` that logs them with ``LightningModule.log``.
* ``TernGradTrainerCallback`` (transformers.py): a transformers ``TrainerCallback`` that adds them to the
  Trainer's logs (``state.log_history`` and every reporting callback after it).
* ``TernGradAccelerateLogger`` (accelerate.py): hands them to ``accelerator.log`` (Accelerate's trackers).

Each framework module imports its framework; this package imports none of them, and the training path never
imports this package (layer 4.6 of tests/test_layers.py: above the frontends, below operations).
"""
from .figures import FIGURE_KEYS, StepFigures, find_state, stats_of

__all__ = ["FIGURE_KEYS", "StepFigures", "find_state", "stats_of"]
