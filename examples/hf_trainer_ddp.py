"""TernGrad's DDP hook under the `transformers` Trainer, through a ``TrainerCallback``: a GPT-2 from a config
(no weights to download) trained on Python's reference docs read as bytes (examples/transformers_lm.py's corpus
and model).

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_ddp.py
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_ddp.py --packing base3 --max-steps 100

The Trainer has no option for a communication hook, and its callbacks are handed the unwrapped model; the DDP
object is ``trainer.model_wrapped`` once training has begun.  So ``TernGradCallback`` keeps the trainer and, at
``on_train_begin`` (after the Trainer has wrapped the model, before the first step), registers the hook there.

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
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--packing", choices=["2bit", "base3"], default="2bit")
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--output-dir", default=None, help="the Trainer's output_dir (default: a temporary one)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)                          # the same initial weights on every rank
    train, _, what = load_corpus()
    model = make_model(args)
    out = args.output_dir or tempfile.mkdtemp(prefix="hf_trainer_terngrad_")
    targs = TrainingArguments(output_dir=out, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
                              learning_rate=2e-3, logging_steps=5, save_strategy="no", report_to="none",
                              use_cpu=True, ddp_backend="gloo", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    losses = Losses()
    trainer = Trainer(model=model, args=targs, callbacks=[losses],
                      train_dataset=ByteWindows(train, args.batch_size * 2 * args.max_steps, args.seq_len))
    hook = TernGradCallback(trainer, packing=args.packing, seed=5)
    trainer.add_callback(hook)
    trainer.train()
    st = hook.state
    result = {"rank": targs.process_index, "ranks": targs.world_size, "wrapped": type(trainer.model_wrapped).__name__,
              "losses": losses.losses, "global_step": trainer.state.global_step, "checksum": checksum(model)}
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
    print("result: " + json.dumps(result), flush=True)
    del trainer, hook


if __name__ == "__main__":
    main()
    shutdown()
