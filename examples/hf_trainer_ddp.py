"""TernGrad's DDP hook under the `transformers` Trainer, through a ``TrainerCallback``: a GPT-2 from a config
(no weights to download) trained on Python's reference docs read as bytes (examples/transformers_lm.py's corpus
and model).

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_ddp.py
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_ddp.py --packing base3 --max-steps 100
    torchrun --standalone --nproc_per_node 8 examples/hf_trainer_ddp.py --device cuda     # 8 GPUs, NCCL

The Trainer has no option for a communication hook, and its callbacks are handed the unwrapped model; the DDP
object is ``trainer.model_wrapped`` once training has begun.  So ``TernGradCallback`` keeps the trainer and, at
``on_train_begin`` (after the Trainer has wrapped the model, before the first step), registers the hook there.
``TernGradTrainerCallback`` (horovod_terngrad.integrations.transformers) adds TernGrad's figures to every log of
the Trainer (``terngrad/bits_per_element``, bytes sent and saved against fp32 and bf16, codec and wait
milliseconds): in ``trainer.state.log_history`` and in what its reporting callbacks (``--report-to``) receive.
The Trainer's optimizer is ``horovod_terngrad.optim.AdamW`` (``optimizer_cls_and_kwargs``; ``--optim adamw``: the
Trainer's own torch AdamW).

Every rank prints one ``result: {...}`` JSON line: the Trainer's losses, TernGrad's counters and a checksum of the
parameters (equal on every rank).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from horovod_terngrad import ddp as tg_ddp
from horovod_terngrad.integrations.transformers import TernGradTrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformers_lm import checksum, load_corpus, make_model, shutdown, windows  # noqa: E402


class TernGradCallback(TrainerCallback):
    """Registers TernGrad's DDP hook on ``trainer.model_wrapped`` when training begins (on every rank; nothing
    to do in a single process, where the Trainer wraps nothing).  ``settings``: TernGradConfig's."""

    def __init__(self, trainer: Trainer, **settings):
        self.trainer, self.settings, self.state = trainer, settings, None

    def on_train_begin(self, args, state, control, **kwargs):
        if args.world_size > 1 and self.state is None:
            self.state = tg_ddp.register(self.trainer, **self.settings)


class ByteWindows(torch.utils.data.Dataset):
    """``n`` windows of ``seq_len`` bytes, the same on every rank (the Trainer's sampler shards them)."""

    def __init__(self, ids, n, seq_len, seed=0):
        self.x = windows(ids, n, seq_len, torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Losses(TrainerCallback):
    """The losses the Trainer logs, and the TernGrad figures that reached this callback with them."""

    def __init__(self):
        self.losses, self.terngrad = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])
            self.terngrad.append({k: v for k, v in logs.items() if k.startswith("terngrad/")})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--packing", choices=["2bit", "base3"], default="2bit")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--optim", choices=["tg-adamw", "adamw"], default="tg-adamw",
                   help="horovod_terngrad.optim.AdamW (default) or the Trainer's torch AdamW")
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--report-to", default="none", help="the Trainer's report_to (tensorboard, wandb, ...)")
    p.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: a temporary one)")
    from horovod_terngrad.operations.devices import add_device_argument, setup_device
    add_device_argument(p)
    args = p.parse_args(argv)
    placement = setup_device(args.device)   # the Trainer then takes cuda:LOCAL_RANK with NCCL, or the CPU with gloo
    torch.set_num_threads(1)
    torch.manual_seed(0)                          # the same initial weights on every rank
    train, _, what = load_corpus()
    model = make_model(args)
    out = args.output_dir or tempfile.mkdtemp(prefix="hf_trainer_terngrad_")
    targs = TrainingArguments(output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
                              learning_rate=2e-3, logging_steps=args.logging_steps, save_strategy="no",
                              report_to=args.report_to,
                              use_cpu=not placement.is_cuda, ddp_backend=placement.backend, disable_tqdm=True,
                              seed=0, dataloader_num_workers=0)
    losses = Losses()
    optimizer = None
    if args.optim == "tg-adamw":       # the Trainer's adamw_torch settings, TernGrad's AdamW
        from horovod_terngrad.optim import AdamW
        optimizer = (AdamW, {"lr": targs.learning_rate, "betas": (targs.adam_beta1, targs.adam_beta2),
                             "eps": targs.adam_epsilon})
    trainer = Trainer(model=model, args=targs, callbacks=[losses], optimizer_cls_and_kwargs=optimizer,
                      train_dataset=ByteWindows(train, args.batch_size * 2 * args.max_steps, args.seq_len))
    hook = TernGradCallback(trainer, packing=args.packing, seed=5)
    trainer.add_callback(hook)
    TernGradTrainerCallback.attach(trainer)       # first in line, so the reporting callbacks see the figures too
    trainer.train()
    st = hook.state
    result = {"rank": targs.process_index, "ranks": targs.world_size, "wrapped": type(trainer.model_wrapped).__name__,
              "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                                else trainer.optimizer).__module__,
              "losses": losses.losses, "terngrad_seen_by_callback": losses.terngrad,
              "log_history": [e for e in trainer.state.log_history if "loss" in e], "global_step": trainer.state.global_step, "checksum": checksum(model)}
    if st is not None:
        result.update(tensors=st.stats.tensors, elements=st.stats.elements,
                      bits_per_element=st.stats.bits_per_element(),
                      uncompressed_elements=st.state.uncompressed_elements,
                      stream_steps=sorted(set(st.steps.values())))
    if targs.process_index == 0:
        print(f"GPT-2 on {what}: Trainer, {targs.world_size} ranks, {trainer.state.global_step} steps, "
              f"logged losses {[round(x, 3) for x in losses.losses]}; TernGrad "
              f"{result.get('tensors', 0)} tensors at {result.get('bits_per_element', 32.0):.2f} bits/element",
              flush=True)
        if st is not None:
            sent, fp32 = st.stats.bytes_sent, 4 * st.stats.elements
            print(f"TernGrad sent {sent / 1e6:.2f} MB against {fp32 / 1e6:.2f} MB in fp32 for the same gradients: "
                  f"{(fp32 - sent) / 1e6:.2f} MB saved ({fp32 / max(sent, 1):.1f}x fewer)", flush=True)
    print("result: " + json.dumps(result), flush=True)
    del trainer, hook


if __name__ == "__main__":
    main()
    shutdown()
