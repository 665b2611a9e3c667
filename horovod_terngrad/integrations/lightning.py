"""TernGrad's per-step figures in Lightning's logger: a ``Callback`` that logs them with ``LightningModule.log``.

    from horovod_terngrad.integrations.lightning import TernGradLoggingCallback
    trainer = pl.Trainer(..., strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=terngrad_hook),
                         callbacks=[TernGradLoggingCallback()], logger=CSVLogger("logs"), log_every_n_steps=1)

Each training step's figures (figures.py: bits per element, bytes sent and saved against fp32 and bf16, codec and
wait milliseconds) go to whatever logger the Trainer has (CSV, TensorBoard, W&B, ...) under ``terngrad/...``, on
step, never averaged over the epoch.  ``source``: the frontend state (``TernGradState``, ``TernGradFSDPState``, a
``TernGradCompressor``); None finds the DDP hook's state on the Trainer's DDP model when training starts (a Trainer
without a DDP model, e.g. one process, logs nothing and says so once).  Figures are this rank's; Lightning's
loggers write rank 0's.
"""
from __future__ import annotations

try:
    import lightning.pytorch as pl
except ImportError:          # the standalone package of Lightning < 2.0's name
    import pytorch_lightning as pl

from .figures import StepFigures, find_state

try:
    from lightning.pytorch.utilities import rank_zero_warn
except ImportError:
    from pytorch_lightning.utilities import rank_zero_warn


class TernGradLoggingCallback(pl.Callback):
    def __init__(self, source=None, prog_bar: bool = False):
        super().__init__()
        self.source, self.prog_bar = source, prog_bar
        self.figures = StepFigures(None)

    def on_train_start(self, trainer, pl_module):
        # the hook is registered by now (DDPStrategy on CUDA at setup, a callback's on_fit_start on CPU); counting
        # starts here, so counters restored from a checkpoint are not taken for this run's first step
        source = self.source
        if source is None:
            try:
                source = find_state(trainer)
            except TypeError:            # no DistributedDataParallel model: a single process, or another strategy
                rank_zero_warn("TernGradLoggingCallback: the Trainer has no DDP model (strategy "
                               f"{type(trainer.strategy).__name__}): nothing to log; pass source= for another frontend")
                return
        if source is None:
            raise RuntimeError("TernGradLoggingCallback: the Trainer's DDP model has no TernGrad hook; register it "
                               "(DDPStrategy(ddp_comm_state=..., ddp_comm_hook=terngrad_hook)) or pass source=")
        self.figures.bind(source)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        figures = self.figures.read()       # {} on a step that exchanged nothing (gradient accumulation)
        if figures:
            pl_module.log_dict(figures, on_step=True, on_epoch=False, prog_bar=self.prog_bar, logger=True)
