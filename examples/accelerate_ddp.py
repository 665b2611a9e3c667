"""TernGrad's DDP hook under Hugging Face Accelerate: a `transformers` GPT-2 (from a config, no weights) trained
with ``accelerator.prepare`` and the hook registered on the prepared model.

    torchrun --standalone --nproc_per_node 2 examples/accelerate_ddp.py
    torchrun --standalone --nproc_per_node 2 examples/accelerate_ddp.py --dynamo eager    # torch.compile'd
    accelerate launch --cpu --num_processes 2 examples/accelerate_ddp.py                  # Accelerate's launcher
    torchrun --standalone --nproc_per_node 2 examples/accelerate_ddp.py --log-jsonl tg.jsonl   # figures per step
    torchrun --standalone --nproc_per_node 8 examples/accelerate_ddp.py --device cuda          # 8 GPUs, NCCL

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its enum of PyTorch's built-in hooks
(a callable is ignored), so the hook goes on the model ``prepare`` returns: a ``DistributedDataParallel``, or,
with a dynamo plugin (``Accelerator(dynamo_backend=...)``), a ``torch.compile`` wrapper around it;
``horovod_terngrad.ddp.register`` finds the DDP object inside either.  The corpus and the model are
examples/transformers_lm.py's (Python's reference docs as bytes, GPT-2 with a 256-byte vocabulary).

The optimizer is ``horovod_terngrad.optim.AdamW`` (``--optim adamw``: torch's).  ``TernGradAccelerateLogger``
(horovod_terngrad.integrations.accelerate) hands TernGrad's figures of every step (bits per element, bytes sent and
saved against fp32 and bf16, codec and wait milliseconds) to ``accelerator.log``, so every tracker of the
Accelerator gets them; ``--log-jsonl FILE`` gives it one (``JsonlTracker``, Accelerate's custom-tracker API: one
JSON line per ``log`` call) in place of TensorBoard or W&B, which this example does not install.

Every rank prints one ``result: {...}`` JSON line: the prepared model's type, the losses, TernGrad's counters and
a checksum of the parameters (equal on every rank).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformers_lm import checksum, load_corpus, make_model, shutdown, windows  # noqa: E402


def jsonl_tracker(path):
    """An Accelerate tracker writing one JSON line per ``accelerator.log`` call: {"step": ..., values...}."""
    from accelerate.tracking import GeneralTracker

    class JsonlTracker(GeneralTracker):
        name = "jsonl"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.path = path

        @property
        def tracker(self):
            return self.path

        def log(self, values, step=None, **kwargs):
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")

    return JsonlTracker()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dynamo", default="no", help="Accelerate's dynamo backend: no, eager, aot_eager, inductor")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--optim", choices=["tg-adamw", "adamw"], default="tg-adamw",
                   help="horovod_terngrad.optim.AdamW (default) or torch.optim.AdamW")
    p.add_argument("--log-jsonl", default=None, help="log TernGrad's figures per step to this file (a tracker)")
    from horovod_terngrad.operations.devices import add_device_argument, setup_device
    add_device_argument(p)
    args = p.parse_args(argv)
    placement = setup_device(args.device)   # Accelerate then takes cuda:LOCAL_RANK with NCCL, or the CPU with gloo
    torch.set_num_threads(1)

    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from horovod_terngrad import ddp as tg_ddp
    from horovod_terngrad.integrations.accelerate import TernGradAccelerateLogger
    from horovod_terngrad.optim import AdamW

    accelerator = Accelerator(cpu=not placement.is_cuda, dynamo_backend=args.dynamo,
                              log_with=[jsonl_tracker(args.log_jsonl)] if args.log_jsonl else None)
    if args.log_jsonl:
        accelerator.init_trackers("terngrad")
    set_seed(0)                                   # the same initial weights on every rank
    train, _, what = load_corpus()
    model = make_model(args)
    opt = (AdamW if args.optim == "tg-adamw" else torch.optim.AdamW)(model.parameters(), lr=args.lr)
    model, opt = accelerator.prepare(model, opt)
    state = tg_ddp.register(model, seed=3)        # DDP, or torch.compile's wrapper of it
    tg_log = TernGradAccelerateLogger(accelerator, state)
    gen = torch.Generator().manual_seed(100 + accelerator.process_index)
    losses = []
    for step in range(args.steps):
        x = windows(train, args.batch_size, args.seq_len, gen).to(accelerator.device)
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        opt.step()
        losses.append(loss.item())
        tg_log.log(step)                          # every rank reads its counters; the main process writes
    st = state.stats
    result = {"rank": accelerator.process_index, "ranks": accelerator.num_processes,
              "distributed_type": str(accelerator.distributed_type), "prepared": type(model).__name__,
              "ddp": type(tg_ddp.find_ddp(model)).__name__, "optim": type(opt.optimizer).__module__, "steps": len(losses), "loss_first": losses[0],
              "loss_last": losses[-1], "tensors": st.tensors, "elements": st.elements,
              "bits_per_element": st.bits_per_element(), "uncompressed_elements": state.state.uncompressed_elements,
              "stream_steps": sorted(set(state.steps.values())), "checksum": checksum(accelerator.unwrap_model(model))}
    accelerator.print(f"GPT-2 on {what}, Accelerate {accelerator.distributed_type}, "
                      f"prepared model {result['prepared']}; loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                      f"TernGrad {st.tensors} tensors at {result['bits_per_element']:.2f} bits/element")
    accelerator.print(f"TernGrad sent {st.bytes_sent / 1e6:.2f} MB for {st.elements} elements against "
                      f"{4 * st.elements / 1e6:.2f} MB in fp32: {(4 * st.elements - st.bytes_sent) / 1e6:.2f} MB saved "
                      f"({4 * st.elements / max(st.bytes_sent, 1):.1f}x fewer)")
    print("result: " + json.dumps(result), flush=True)
    # the trackers' own finish, not accelerator.end_training(): that also destroys the process group, which under a
    # live DDP model can abort the process at exit (transformers_lm.shutdown does it after main)
    for tracker in accelerator.trackers:
        tracker.finish()
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    shutdown()
