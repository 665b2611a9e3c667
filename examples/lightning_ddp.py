"""TernGrad's DDP hook under PyTorch Lightning, as Lightning documents communication hooks:
``Trainer(strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=terngrad_hook))``.

    python examples/lightning_ddp.py                          # 2 CPU processes, Lightning's spawn launcher
    python examples/lightning_ddp.py --start-method popen     # Lightning's default launcher (re-runs this script)
    python examples/lightning_ddp.py --log-dir logs           # TernGrad's figures per step in logs/.../metrics.csv
    python examples/lightning_ddp.py --device cuda --devices 8  # 8 GPUs, NCCL (--device auto: GPUs when present)

The state is built before the Trainer starts its processes (no process group exists yet: TernGradState makes
its groups at the first bucket), and the spawn launcher pickles it with the strategy, the callback and the model
(one pickle: the state's parameters stay the model's).  Lightning registers communication hooks only when the
root device is CUDA (``DDPStrategy._register_ddp_hooks``); on CPU it skips them without a word, so the callback
``RegisterOnCPU`` registers the same state and hook there (on CUDA it leaves Lightning's registration alone).

``TernGradLoggingCallback`` (horovod_terngrad.integrations.lightning) logs TernGrad's figures on every step through
Lightning's own logger (here a ``CSVLogger`` with ``--log-dir``): bits per element, bytes sent and saved against
fp32 and bf16, codec and wait milliseconds, as columns ``terngrad/...`` beside the loss.

Every rank writes ``--out/rank<R>.json``: TernGrad's counters (proof that the hook ran), the step counters of
its random streams per parameter name, and a checksum of the trained parameters; rank 0 prints a summary.
"""
from __future__ import annotations

import argparse
import json
import os
import zlib

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy

from horovod_terngrad import ddp as tg_ddp
from horovod_terngrad.integrations.lightning import TernGradLoggingCallback
from horovod_terngrad.operations.devices import add_device_argument, resolve_device


class RegisterOnCPU(pl.Callback):
    """Registers the DDP communication hook that Lightning's DDPStrategy registers on CUDA only."""

    def __init__(self, state, hook=tg_ddp.terngrad_hook):
        self.state, self.hook = state, hook

    def on_fit_start(self, trainer, pl_module):
        if trainer.strategy.root_device.type != "cuda":       # on CUDA, DDPStrategy has registered it already
            tg_ddp.register(trainer, state=self.state)        # finds trainer.strategy.model, the DDP object


class Classifier(pl.LightningModule):
    def __init__(self, lr=0.05):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

    def training_step(self, batch, _):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def dataset(n=4096, seed=0):
    """Ten Gaussian clusters in 32 dimensions (the same on every rank; Lightning's sampler shards it)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(10, 32, generator=g) * 0.3
    y = torch.randint(0, 10, (n,), generator=g)
    return torch.utils.data.TensorDataset(centers[y] + torch.randn(n, 32, generator=g), y)


class Report(pl.Callback):
    """Writes what each rank saw: TernGrad's counters and a checksum of the parameters."""

    def __init__(self, state, out):
        self.state, self.out, self.losses = state, out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):       # the strategy still holds the DDP model here
        st = self.state
        code = 0
        for p in pl_module.parameters():
            code = zlib.crc32(p.detach().cpu().numpy().tobytes(), code)
        ddp = tg_ddp.find_ddp(trainer)
        rec = {"rank": trainer.global_rank, "world": trainer.world_size, "steps": dict(st.steps),
               "tensors": st.stats.tensors, "elements": st.stats.elements,
               "bits_per_element": st.stats.bits_per_element(),
               "uncompressed_elements": st.state.uncompressed_elements, "checksum": code,
               "loss_first": self.losses[0], "loss_last": self.losses[-1],
               "hooks": [getattr(h, "__name__", "?") for h, s in ddp._comm_hooks if s is st],
               "strategy_holds_this_state": trainer.strategy._ddp_comm_state is st, "repr": repr(st)}
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(rec, f, indent=1)
        if trainer.global_rank == 0:
            print(f"rank 0: {len(self.losses)} steps, loss {rec['loss_first']:.3f} -> {rec['loss_last']:.3f}; "
                  f"TernGrad exchanged {rec['tensors']} tensors ({rec['elements']} elements, "
                  f"{rec['bits_per_element']:.2f} bits/element), {rec['uncompressed_elements']} elements in fp32; "
                  f"{st}", flush=True)
            sent = st.stats.bytes_sent
            print(f"rank 0: TernGrad sent {sent / 1e6:.2f} MB for its {st.stats.elements} elements, against "
                  f"{4 * st.stats.elements / 1e6:.2f} MB in fp32: {4 * st.stats.elements - sent} bytes saved "
                  f"({4 * st.stats.elements / max(sent, 1):.1f}x fewer)", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--start-method", choices=["spawn", "popen"], default="spawn")
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--out", default="lightning_terngrad")
    p.add_argument("--log-dir", default=None, help="a CSVLogger here (metrics.csv under it); default: no logger")
    add_device_argument(p)
    args = p.parse_args(argv)
    # Lightning starts the ranks and sets each one's GPU itself: decided here once, for the highest local rank,
    # so that --device cuda with more --devices than GPUs fails before anything starts
    placement = resolve_device(args.device, local_rank=args.devices - 1)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Classifier()
    state = tg_ddp.TernGradState(model, seed=1)       # no process group yet; names are the LightningModule's
    strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=tg_ddp.terngrad_hook,
                           start_method=args.start_method, process_group_backend=placement.backend)
    logger = False
    if args.log_dir:
        from lightning.pytorch.loggers import CSVLogger
        logger = CSVLogger(args.log_dir, name="terngrad")
    trainer = pl.Trainer(accelerator=placement.accelerator, devices=args.devices, strategy=strategy,
                         max_steps=args.max_steps,
                         callbacks=[RegisterOnCPU(state), TernGradLoggingCallback(), Report(state, args.out)],
                         logger=logger, log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=32, shuffle=True)
    trainer.fit(model, loader)


if __name__ == "__main__":
    main()
