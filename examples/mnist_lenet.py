"""LeNet on real MNIST with Horovod, gradients exchanged by TernGrad (or fp32 / fp16 for comparison).

    horovodrun -np 2 -H localhost:2 python examples/mnist_lenet.py --compression terngrad

The network is Caffe's LeNet that the paper trains (conv 20 -> pool -> conv 50 -> pool -> fc 500 ->
fc 10, 431k parameters).  Each rank trains on its 1/N shard of the 50k training images; accuracy is
measured on the 10k test images.  Per epoch rank 0 prints test accuracy, throughput (images/s over all
ranks) and the bytes one rank sends per step on the wire (ring allgather: N-1 payloads), beside what
fp32 ring-allreduce sends (2·(N-1)/N·4 bytes per element), and the bits per element it hands to
collectives.

    horovodrun -np 2 -H localhost:2 python examples/mnist_lenet.py --amp fp16     # mixed precision (fp16, GradScaler)

``--amp fp16`` runs forward and loss under ``torch.autocast`` in fp16 with a ``torch.amp.GradScaler`` and Horovod's
AMP recipe (examples/mixed_precision.py); each epoch's line then also shows the steps the scaler skipped so far and
the loss scale.  ``--amp bf16``: autocast in bf16, no scaler.

``--device auto`` (the default) trains on each rank's local GPU, ``cuda:hvd.local_rank()``, when torch sees one and
Horovod was built with CUDA (``scripts/setup.sh --cuda``), else on the CPU; ``--device cpu`` / ``cuda`` force it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optimizers  # noqa: E402 (--optim)
import mixed_precision  # noqa: E402 (examples/mixed_precision.py: --amp, autocast, GradScaler's recipes)


class LeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        self.fc1 = nn.Linear(800, 500)
        self.fc2 = nn.Linear(500, 10)

    def forward(self, x):
        x = F.max_pool2d(self.conv1(x), 2)
        x = F.max_pool2d(self.conv2(x), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compression", choices=["terngrad", "none", "fp16"], default="terngrad")
    p.add_argument("--packing", choices=["2bit", "base3"], default="2bit")
    p.add_argument("--on-nonfinite", choices=["propagate", "raise", "zero"], default=None,
                   help="TernGrad's on_nonfinite (default: the library's, 'propagate')")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per rank (paper: 64 in total)")
    p.add_argument("--lr", type=float, default=None, help="default: 0.01 for sgd, 0.001 for the Adams")
    optimizers.add_arguments(p)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    p.add_argument("--test-limit", type=int, default=0, help="evaluate on the first N test images (0: all)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default="", help="write per-epoch metrics of rank 0 to this file")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="tqdm progress bar on rank 0, with the per-step traffic under TernGrad (default: when "
                        "stderr is a terminal)")
    p.add_argument("--tensorboard", default="", help="log scalars and gradient histograms here (needs tensorboard)")
    mixed_precision.add_arguments(p)
    from horovod_terngrad.operations.devices import add_device_argument
    add_device_argument(p)
    return p.parse_args(argv)


def evaluate(model, x, y, batch=1000):
    from horovod_terngrad.operations.metrics import accuracy
    return accuracy(model, x, y, batch)


def main(argv=None):
    args = parse_args(argv)
    import horovod.torch as hvd

    from horovod_terngrad import TernGrad
    from horovod_terngrad.operations.datasets import load_mnist
    from horovod_terngrad.operations.devices import setup_device
    from horovod_terngrad.operations.metrics import epoch_report, wire_bytes

    hvd.init()
    placement = setup_device(args.device, hvd.local_rank(), horovod=hvd)     # cuda:local_rank, or the CPU
    device = placement.device
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)          # identical initial weights on every rank
    rank, size = hvd.rank(), hvd.size()
    data = load_mnist()
    xtr, ytr = data["train"]
    xte, yte = data["test"]
    if args.test_limit:
        xte, yte = xte[:args.test_limit], yte[:args.test_limit]
    xtr, ytr = xtr[rank::size].to(device), ytr[rank::size].to(device)

    model = LeNet().to(device)
    nparams = sum(p.numel() for p in model.parameters())
    opt = optimizers.make(args, model.parameters())
    nonfinite = {"on_nonfinite": args.on_nonfinite} if args.on_nonfinite else {}
    compressor = {"terngrad": TernGrad.configure(packing=args.packing, seed=args.seed, **nonfinite),
                  "none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[args.compression]
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compressor)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    amp = mixed_precision.MixedPrecision(args.amp, device.type, args.init_scale, horovod=True)

    fp32_ring_bytes = wire_bytes(size, 0, 0, nparams)
    steps_per_epoch = len(xtr) // args.batch_size
    if args.max_steps:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    if rank == 0 and placement.note:
        print(placement.note, flush=True)
    if rank == 0:
        print(f"LeNet ({nparams} parameters) on MNIST, {size} ranks, batch {args.batch_size}/rank, "
              f"compression={args.compression}" + (f" ({args.packing})" if args.compression == "terngrad" else "")
              + (f", amp {args.amp}" + (f" (initial loss scale {args.init_scale:g})" if args.amp == "fp16" else "")
                 if amp.enabled else ""), flush=True)
    g = torch.Generator().manual_seed(args.seed + rank)
    history = []
    metrics = writer = None
    from horovod_terngrad.operations.metrics import TernGradMetrics, progress_bar, tensorboard_writer
    if args.compression == "terngrad":
        metrics = TernGradMetrics(compressor, size, log_layers=bool(args.tensorboard),
                                  capture=("conv2.weight", "fc1.weight") if args.tensorboard else ())
        if args.tensorboard and rank == 0:
            writer = tensorboard_writer(args.tensorboard)
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(xtr), generator=g).to(device)
        if args.compression == "terngrad":
            compressor.stats.reset()
        t0 = time.perf_counter()
        loss_sum = 0.0
        bar = progress_bar(steps_per_epoch, f"epoch {epoch}", rank=rank, enabled=args.progress)
        for step in range(steps_per_epoch):
            idx = perm[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            with amp.autocast():
                loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            amp.step(loss, opt)                 # loss.backward(); opt.step() (with --amp fp16: GradScaler's recipe)
            loss_sum += loss.item()
            bar.update(1)
            if metrics:
                row = metrics.step()
                if not bar.disable:
                    bar.set_postfix_str(f"loss {loss.item():.3f} " + metrics.summary(row), refresh=False)
                if writer is not None and step % 50 == 0:
                    metrics.to_tensorboard(writer, (epoch - 1) * steps_per_epoch + step, row)
        bar.close()
        elapsed = time.perf_counter() - t0
        acc = evaluate(model, xte, yte)
        step_ms = 1000 * elapsed / steps_per_epoch
        ips = steps_per_epoch * args.batch_size * size / elapsed
        if args.compression == "terngrad":
            sent, bits, timing = epoch_report(compressor.stats, size, steps_per_epoch)
        elif args.compression == "fp16":
            sent, bits, timing = fp32_ring_bytes / 2, 16.0, ""
        else:
            sent, bits, timing = fp32_ring_bytes, 32.0, ""
        rec = {"epoch": epoch, "test_acc": acc, "loss": loss_sum / steps_per_epoch, "images_per_s": ips,
               "step_ms": step_ms, "bytes_sent_per_step": sent, "fp32_allreduce_bytes_per_step": fp32_ring_bytes,
               "bits_per_element": bits, "ranks": size, "compression": args.compression, **amp.record()}
        if args.compression == "terngrad":      # this epoch's ternarized tensors whose average was NaN (fp16 overflow)
            rec["nonfinite_propagated"] = compressor.stats.nonfinite_propagated
            rec["nonfinite_zeroed"] = compressor.stats.nonfinite_zeroed
        if metrics and compressor.inspection.layers:
            rec["layers"] = {n: vars(r) for n, r in compressor.inspection.layers.items()}
        history.append(rec)
        if rank == 0:
            ratio = fp32_ring_bytes / sent if sent else math.inf
            print(f"epoch {epoch}: test acc {100 * acc:.2f}%  loss {rec['loss']:.4f}  {ips:.0f} images/s  "
                  f"{step_ms:.1f} ms/step  sends {sent / 1024:.1f} KiB/step on the wire vs fp32 allreduce "
                  f"{fp32_ring_bytes / 1024:.1f} KiB/step ({ratio:.1f}x less, {bits:.2f} bits/element){timing}"
                  + (f"  {amp.summary()}" if amp.enabled else ""), flush=True)
            for name, layer in rec.get("layers", {}).items():
                print(f"  {name:14s} {layer['elements']:7d} elements: {100 * layer['zero_fraction']:5.1f}% zeros, "
                      f"scaler {layer['scaler']:.3e}", flush=True)
    if writer is not None:
        writer.close()
    if amp.scaler is not None:
        # every rank saw the same averaged gradients, so every rank skipped the same steps
        per_rank = hvd.allgather_object(amp.skipped)
        if history:
            history[-1]["skipped_steps_per_rank"] = per_rank
        if rank == 0:
            print(f"{amp.summary()} (initial {args.init_scale:g}); steps skipped on each rank: {per_rank}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(history, f, indent=1)
    hvd.shutdown()
    return history


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
