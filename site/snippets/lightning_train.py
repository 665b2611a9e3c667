# python lightning_train.py        (Lightning starts the 2 processes)
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy

from horovod_terngrad import ddp as tg_ddp
from horovod_terngrad.optim import AdamW          # the Adam recipe; for SGD return torch.optim.SGD below


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return AdamW(self.parameters(), lr=1e-3)


class RegisterOnCPU(pl.Callback):
    """Lightning registers comm hooks only on CUDA and skips them silently on CPU: register the same state there."""
    def __init__(self, state):
        self.state = state

    def on_fit_start(self, trainer, pl_module):
        if trainer.strategy.root_device.type != "cuda":      # on CUDA, DDPStrategy has registered it
            tg_ddp.register(trainer, state=self.state)       # finds trainer.strategy.model


if __name__ == "__main__":
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(640, 784), torch.randint(0, 10, (640,)))
    loader = torch.utils.data.DataLoader(data, batch_size=32)
    model = Net()
    state = tg_ddp.TernGradState(model)                      # no process group yet; any TernGradConfig setting
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=20, callbacks=[RegisterOnCPU(state)],
                         strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=tg_ddp.terngrad_hook,
                                              start_method="spawn"),
                         enable_progress_bar=False, logger=False, enable_checkpointing=False)
    trainer.fit(model, loader)
