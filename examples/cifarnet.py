"""CifarNet (the paper's ConvNet for CIFAR-10, Section 4.1 / Table 1) with Horovod and TernGrad.

    horovodrun -np 2 -H localhost:2 python examples/cifarnet.py --cifar10 /data/cifar-10-batches-py
    horovodrun -np 2 -H localhost:2 python examples/cifarnet.py            # Fashion-MNIST substitute

The network is TensorFlow-slim's cifarnet: conv 5x5 64 -> maxpool 3x3/2 -> LRN -> conv 5x5 64 -> LRN ->
maxpool 3x3/2 -> fc 384 -> dropout (keep 0.5) -> fc 192 -> fc 10, ReLU after every hidden layer, 'SAME'
padding (so 24x24 inputs give 12x12 then 6x6 maps), LRN with depth radius 4, bias 1, alpha 0.001/9,
beta 0.75, slim's initializers, and L2 weight decay 0.004 on the fc3/fc4 weights only.  1,068,298
parameters for 3-channel input.

Training as in the paper's Table 1: Adam, base LR 0.0002, the mini-batch size fixed per worker (64 per
worker: the paper's 128 in total on 2 workers), with the data augmentation it describes: random 24x24
crops, horizontal flips, random brightness (+-63/255) and contrast (x0.2..1.8), each clamped to [0, 1],
then per-image standardization; at test time only the 24x24 center crop (and standardization).
Not done here: the paper's exponential moving average of parameters (decay 0.9999) for evaluation.

Data: ``--cifar10 PATH`` trains on a local copy of CIFAR-10 (the python version's cifar-10-batches-py
folder; nothing is downloaded).  Without it, the script trains on Fashion-MNIST from the Debian package
dataset-fashion-mnist instead, which is NOT the paper's experiment: 28x28 grey images fed as ONE channel
(conv1 then has 1 input channel, 1,065,098 parameters), random 24x24 crops out of the 28x28 images (center
crop at test), same flips and jitter.  In that case every line printed and every JSON record says
"SUBSTITUTE: Fashion-MNIST (CIFAR-10 not available)".

Each rank trains on its 1/N shard of the training images.  Per epoch rank 0 prints test accuracy,
throughput (training images/s over all ranks), and what the compressor reports: bytes sent per step on
the wire beside fp32 ring-allreduce, bits per element, and TernGrad's codec and wait times.

``--device auto`` (the default) trains on each rank's local GPU, ``cuda:hvd.local_rank()``, when torch sees one and
Horovod was built with CUDA (``scripts/setup.sh --cuda``), else on the CPU; batches are augmented on the CPU.
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

SUBSTITUTE = "SUBSTITUTE: Fashion-MNIST (CIFAR-10 not available)"
CROP = 24
WEIGHT_DECAY = 0.004     # L2 on the fc3 and fc4 weights (slim's CifarNet, the authors' cifar10 script)


class CifarNet(nn.Module):
    """TF-slim cifarnet for 24x24 inputs (see module docstring)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, dropout_keep_prob: float = 0.5):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 5, padding=2)
        self.conv2 = nn.Conv2d(64, 64, 5, padding=2)
        # 3x3 stride 2 with TF 'SAME' padding: ceil_mode pads at the right/bottom only, as TF does.
        self.pool = nn.MaxPool2d(3, 2, ceil_mode=True)
        # tf.nn.lrn(depth_radius=4, bias=1, alpha=0.001/9, beta=0.75): torch divides alpha by the size.
        self.lrn = nn.LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1.0)
        self.fc3 = nn.Linear(64 * 6 * 6, 384)
        self.dropout3 = nn.Dropout(1.0 - dropout_keep_prob)
        self.fc4 = nn.Linear(384, 192)
        self.logits = nn.Linear(192, num_classes)
        self.reset_parameters()

    def reset_parameters(self):
        def trunc(w, std):
            nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)

        trunc(self.conv1.weight, 5e-2)
        trunc(self.conv2.weight, 5e-2)
        nn.init.zeros_(self.conv1.bias)
        nn.init.zeros_(self.conv2.bias)
        for fc in (self.fc3, self.fc4):
            trunc(fc.weight, 0.04)
            nn.init.constant_(fc.bias, 0.1)
        trunc(self.logits.weight, 1 / 192.0)
        nn.init.zeros_(self.logits.bias)

    def decayed_parameters(self):
        """The weights slim regularizes (fc3, fc4); the rest has no weight decay."""
        return [self.fc3.weight, self.fc4.weight]

    def adam(self, lr: float, weight_decay: float = WEIGHT_DECAY) -> torch.optim.Adam:
        """Adam with L2 ``weight_decay`` on decayed_parameters() only, as in every CifarNet run here."""
        decayed = {id(p) for p in self.decayed_parameters()}
        return torch.optim.Adam([{"params": [p for p in self.parameters() if id(p) in decayed], "weight_decay": weight_decay},
                                 {"params": [p for p in self.parameters() if id(p) not in decayed], "weight_decay": 0.0}],
                                lr=lr)

    def forward(self, x):
        x = self.lrn(self.pool(F.relu(self.conv1(x))))
        x = self.pool(self.lrn(F.relu(self.conv2(x))))
        x = self.dropout3(F.relu(self.fc3(x.flatten(1))))
        x = F.relu(self.fc4(x))
        return self.logits(x)


class ParameterEMA:
    """Exponential moving average of the parameters, evaluated instead of the raw ones (paper §4: "We
    maintain the exponential moving average of parameters by employing an exponential decay of 0.9999
    ... The accuracy is evaluated by the final averaged parameters").  As TensorFlow's
    ExponentialMovingAverage with num_updates: the decay at update t is min(decay, (1 + t) / (10 + t)),
    so early averages are not dominated by the initial weights."""

    def __init__(self, model: nn.Module, decay: float = 0.9999):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))
        self.updates += 1
        for n, p in model.named_parameters():
            self.shadow[n].mul_(d).add_(p.detach(), alpha=1.0 - d)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates, "shadow": self.shadow}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if set(state["shadow"]) != set(self.shadow):
            raise ValueError(f"EMA state is of another model: parameters {sorted(state['shadow'])}")
        self.decay, self.updates = state["decay"], state["updates"]
        for n, t in state["shadow"].items():
            self.shadow[n].copy_(t)

    @torch.no_grad()
    def evaluate_with(self, model: nn.Module, fn):
        """fn(model) with the averaged parameters swapped in (the raw ones restored afterwards)."""
        raw = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            for n, p in model.named_parameters():
                p.copy_(self.shadow[n])
            return fn(model)
        finally:
            for n, p in model.named_parameters():
                p.copy_(raw[n])


# -- data pipeline (batched, on uint8 images [B, C, H, W]) ------------------------------------------
def _standardize(x):
    """tf.image.per_image_standardization: zero mean, unit std per image, std floored at 1/sqrt(numel)."""
    flat = x.flatten(1)
    mean = flat.mean(1, keepdim=True)
    std = flat.std(1, unbiased=False, keepdim=True).clamp_min(1.0 / math.sqrt(flat.shape[1]))
    return ((flat - mean) / std).view_as(x)


def crop_flip(xb: torch.Tensor, oy: torch.Tensor, ox: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Per-image 24x24 crops at rows oy.., columns ox.., mirrored where flip; uint8 [B, C, 24, 24]."""
    ar = torch.arange(CROP)
    rows = (oy[:, None] + ar)[:, :, None]                                # [B, 24, 1]
    cols = (ox[:, None] + ar)[:, None, :]                                # [B, 1, 24]
    cols = torch.where(flip[:, None, None], cols.flip(-1), cols)
    b = torch.arange(len(xb))[:, None, None]
    return xb[b, :, rows, cols].permute(0, 3, 1, 2)                      # [B, 24, 24, C] -> [B, C, 24, 24]


def augment(xb: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Training pipeline: random 24x24 crop, horizontal flip, brightness, contrast, standardization."""
    B, C, H, W = xb.shape
    oy = torch.randint(0, H - CROP + 1, (B,), generator=g)
    ox = torch.randint(0, W - CROP + 1, (B,), generator=g)
    flip = torch.rand(B, generator=g) < 0.5
    x = crop_flip(xb, oy, ox, flip).to(torch.float32).div_(255.0)
    delta = (torch.rand(B, 1, 1, 1, generator=g) * 2 - 1) * (63.0 / 255.0)
    x = (x + delta).clamp_(0.0, 1.0)
    factor = 0.2 + 1.6 * torch.rand(B, 1, 1, 1, generator=g)
    mean = x.mean(dim=(2, 3), keepdim=True)                              # per image and channel, as TF
    x = ((x - mean) * factor + mean).clamp_(0.0, 1.0)
    return _standardize(x).contiguous()


def center(xb: torch.Tensor) -> torch.Tensor:
    """Test pipeline: 24x24 center crop, standardization."""
    H, W = xb.shape[-2:]
    t, l = (H - CROP) // 2, (W - CROP) // 2
    x = xb[:, :, t:t + CROP, l:l + CROP].to(torch.float32).div_(255.0)
    return _standardize(x).contiguous()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cifar10", default="", metavar="PATH",
                   help="local CIFAR-10 (python version: cifar-10-batches-py or its parent); "
                        "without it: Fashion-MNIST substitute")
    p.add_argument("--compression", choices=["terngrad", "none", "fp16"], default="terngrad")
    p.add_argument("--packing", choices=["2bit", "base3"], default="2bit")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per rank (paper, Table 1: 128 in total on 2 workers)")
    p.add_argument("--lr", type=float, default=0.0002, help="Adam learning rate (paper: 0.0002)")
    p.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY, help="L2 on fc3/fc4 weights (slim cifarnet)")
    p.add_argument("--dropout-keep", type=float, default=0.5, help="keep probability after fc3 (slim: 0.5)")
    p.add_argument("--ema", type=float, default=0.9999,
                   help="decay of the parameters' moving average that is also evaluated (paper: 0.9999; 0: off)")
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    p.add_argument("--test-limit", type=int, default=0, help="evaluate on the first N test images (0: all)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default="", help="write per-epoch metrics of rank 0 to this file")
    from horovod_terngrad.operations.devices import add_device_argument
    add_device_argument(p)
    return p.parse_args(argv)


def evaluate(model, x, y, batch=500):
    from horovod_terngrad.operations.metrics import accuracy
    return accuracy(model, x, y, batch, transform=center)


def main(argv=None):
    args = parse_args(argv)
    import horovod.torch as hvd

    from horovod_terngrad import TernGrad
    from horovod_terngrad.operations.datasets import load_cifar10, load_fashion_mnist
    from horovod_terngrad.operations.devices import setup_device
    from horovod_terngrad.operations.metrics import epoch_report, wire_bytes

    hvd.init()
    placement = setup_device(args.device, hvd.local_rank(), horovod=hvd)     # cuda:local_rank, or the CPU
    device = placement.device
    torch.set_num_threads(args.threads)
    rank, size = hvd.rank(), hvd.size()
    if args.cifar10:
        data, dataset, tag = load_cifar10(args.cifar10), "CIFAR-10", ""
    else:
        data, dataset, tag = load_fashion_mnist(), SUBSTITUTE, f"[{SUBSTITUTE}] "

    def say(msg):
        if rank == 0:
            for line in str(msg).splitlines():
                print(tag + line, flush=True)

    xtr, ytr = data["train"]
    xte, yte = data["test"]
    if args.test_limit:
        xte, yte = xte[:args.test_limit], yte[:args.test_limit]
    xtr, ytr = xtr[rank::size], ytr[rank::size]
    channels = xtr.shape[1]

    torch.manual_seed(args.seed)          # identical initial weights on every rank
    model = CifarNet(in_channels=channels, dropout_keep_prob=args.dropout_keep).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    opt = model.adam(args.lr, args.weight_decay)
    compressor = {"terngrad": TernGrad.configure(packing=args.packing, seed=args.seed),
                  "none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[args.compression]
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compressor)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    fp32_ring_bytes = wire_bytes(size, 0, 0, nparams)
    steps_per_epoch = len(xtr) // args.batch_size
    if args.max_steps:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    if steps_per_epoch < 1:
        raise SystemExit(f"{len(xtr)} training images per rank are fewer than one batch of {args.batch_size}")
    if placement.note:
        say(placement.note)
    say(f"CifarNet ({nparams} parameters, {channels} input channel{'s' if channels > 1 else ''}, "
        f"{CROP}x{CROP} crops) on {'CIFAR-10' if args.cifar10 else 'Fashion-MNIST'}: {len(data['train'][0])} train / {len(xte)} test images, "
        f"{size} ranks, batch {args.batch_size}/rank, Adam lr {args.lr}, "
        f"compression={args.compression}" + (f" ({args.packing})" if args.compression == "terngrad" else ""))
    g = torch.Generator().manual_seed(args.seed + 1000 * rank)
    ema = ParameterEMA(model, args.ema) if args.ema else None
    history = []
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(xtr), generator=g)
        if args.compression == "terngrad":
            compressor.stats.reset()
        t0 = time.perf_counter()
        losses = []
        for step in range(steps_per_epoch):
            idx = perm[step * args.batch_size:(step + 1) * args.batch_size]
            xb = augment(xtr[idx], g).to(device)      # augmented on the CPU (its generator), trained on the device
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), ytr[idx].to(device))
            loss.backward()
            opt.step()
            if ema is not None:
                ema.update(model)
            losses.append(loss.item())
        elapsed = time.perf_counter() - t0
        acc = evaluate(model, xte, yte)
        acc_ema = ema.evaluate_with(model, lambda m: evaluate(m, xte, yte)) if ema is not None else None
        step_ms = 1000 * elapsed / steps_per_epoch
        ips = steps_per_epoch * args.batch_size * size / elapsed
        k = max(1, min(10, len(losses) // 4))
        loss_first, loss_last = sum(losses[:k]) / k, sum(losses[-k:]) / k
        if args.compression == "terngrad":
            sent, bits, timing = epoch_report(compressor.stats, size, steps_per_epoch)
        elif args.compression == "fp16":
            sent, bits, timing = fp32_ring_bytes / 2, 16.0, ""
        else:
            sent, bits, timing = fp32_ring_bytes, 32.0, ""
        rec = {"epoch": epoch, "dataset": dataset, "substitute": not args.cifar10, "test_acc": acc,
               "test_acc_ema": acc_ema, "ema_decay": args.ema,
               "loss": sum(losses) / len(losses), "loss_first": loss_first, "loss_last": loss_last,
               "images_per_s": ips, "step_ms": step_ms, "steps": steps_per_epoch,
               "bytes_sent_per_step": sent, "fp32_allreduce_bytes_per_step": fp32_ring_bytes,
               "bits_per_element": bits, "ranks": size, "batch_per_rank": args.batch_size,
               "compression": args.compression, "parameters": nparams}
        history.append(rec)
        ratio = fp32_ring_bytes / sent if sent else math.inf
        ema_note = f" (moving average of parameters: {100 * acc_ema:.2f}%)" if acc_ema is not None else ""
        say(f"epoch {epoch}: test acc {100 * acc:.2f}%{ema_note}  loss {rec['loss']:.4f} (first {loss_first:.3f}, "
            f"last {loss_last:.3f})  {ips:.0f} images/s  {step_ms:.1f} ms/step  sends {sent / 1024:.1f} KiB/step "
            f"on the wire vs fp32 allreduce {fp32_ring_bytes / 1024:.1f} KiB/step ({ratio:.1f}x less, "
            f"{bits:.2f} bits/element){timing}")
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(history, f, indent=1)
    hvd.shutdown()
    return history


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
