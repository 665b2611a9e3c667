"""Synthetic-data throughput benchmark with Horovod, fp32 / fp16 / TernGrad gradients (in the spirit of
Horovod's pytorch_synthetic_benchmark.py), on CPU-sized versions of the paper's three networks.

    horovodrun -np 2 -H localhost:2 python examples/synthetic_benchmark.py --model alexnet --compression terngrad

The paper's throughput study (Section 4.2, Figure 5) turns on each network's communication profile:
AlexNet and VggNet-A keep >90% of their parameters in 2-3 huge fully-connected layers (a high
communication-to-computation ratio, where TernGrad helps most); GoogLeNet is convolution-heavy with
~100+ small tensors and a small classifier (low ratio, least to gain).  The three models here are scaled
down to 32x32 images so that one step takes a fraction of a second on one CPU core, keeping that profile:

    alexnet    5 convs (BN) + 3 Linear: 5.66M parameters in 21 tensors, 95% in the Linear layers
               (AlexNet: 61M, 16 tensors, 96%); fc6 alone 63% (AlexNet: 62%)
    vgg        8 3x3 convs (BN) + 3 Linear: 4.14M parameters in 30 tensors, 95% in the Linear layers
               (VGG-A: 133M, 22 tensors, 93%); fc6 alone 76% (VGG-A: 77%)
    googlenet  stem + 9 inception blocks (57 convs with BN, as GoogLeNet's 57) + 1 Linear: 0.44M parameters in 173 small
               tensors, 15% in the Linear layer (GoogLeNet: 6.8M, 116 tensors, 15%)

(The paper trains all three with batch normalization on the convolutions.)  Both the real network's
profile and the scaled one's (parameters, tensors, share in Linear layers, largest tensor, multiply-adds
per image) are printed at start.  What is not kept is the absolute compute per parameter: the scaled
models do 2-13x fewer multiply-adds per parameter than the full-size ones (most for VGG, whose real
convolutions are far too costly for a CPU core), so their exchange weighs more against compute than on
the paper's GPUs; the ordering AlexNet/VGG (communication-heavy) vs GoogLeNet (compute-heavy) holds.

As in Horovod's benchmark the data is one random batch (and random labels) made once and reused, so the
figures measure compute + gradient exchange only.  Each iteration runs --num-batches-per-iter steps;
per iteration rank 0 prints img/s of one rank, then the mean +- 1.96 std over iterations, the total over
all ranks, the loss at the first and last step (it falls as the model memorizes the batch), and for
TernGrad the bits per element it handed to collectives.

``--device auto`` (the default) runs each rank on its local GPU, ``cuda:hvd.local_rank()``, when torch sees one and
Horovod was built with CUDA (``scripts/setup.sh --cuda``), else on the CPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import timeit

import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGE = 32

# The full-size networks (ImageNet, 224x224), for comparison: parameters, tensors (weights and biases,
# no BN), share of parameters in fully-connected layers, multiply-adds per image.
PAPER_PROFILES = {
    "alexnet": dict(name="AlexNet", params=61.1e6, tensors=16, fc_share=0.962, macs=0.72e9),
    "vgg": dict(name="VggNet-A (VGG-11)", params=132.9e6, tensors=22, fc_share=0.930, macs=7.6e9),
    "googlenet": dict(name="GoogLeNet (no aux. heads)", params=6.8e6, tensors=116, fc_share=0.151, macs=1.5e9),
}


def conv_bn(cin, cout, k, stride=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, padding=k // 2, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class AlexNetLike(nn.Module):
    """AlexNet's shape at 32x32: 5 convs (kernels 11/5/3/3/3 -> 5/3/3/3/3), 3 max-pools, then fc6-fc7-fc8
    holding ~63% / 28% / 5% of all parameters (AlexNet: 62% / 27% / 7%), the convs ~5% (AlexNet: 4%)."""

    def __init__(self, num_classes=256):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(3, 32, 5), nn.MaxPool2d(2),                 # 16
            conv_bn(32, 64, 3), nn.MaxPool2d(2),                # 8
            conv_bn(64, 96, 3), conv_bn(96, 96, 3), conv_bn(96, 144, 3),
            nn.MaxPool2d(2))                                    # 4 -> 144*4*4 = 2304
        self.classifier = nn.Sequential(
            nn.Linear(144 * 4 * 4, 1536), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(1536, 1024), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(1024, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class VGGLike(nn.Module):
    """VGG-A's 8 3x3 convs (64, M, 128, M, 256, 256, M, 512, 512, M, 512, 512, M) at 32x32 as
    16, M, 32, M, 64 x 6: widths capped at 64 and the last two pools dropped, so that an 8x8x64 map feeds
    fc6 as VGG-A's 7x7x512 does.  fc6 / fc7 / fc8 hold ~76% / 14% / 5% of all parameters
    (VGG-A: 77% / 13% / 3%), the convs ~5% (VGG-A: 7%)."""

    cfg = (16, "M", 32, "M", 64, 64, 64, 64, 64, 64)

    def __init__(self, num_classes=256):
        super().__init__()
        layers, cin = [], 3
        for v in self.cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers.append(conv_bn(cin, v, 3))
                cin = v
        self.features = nn.Sequential(*layers)                  # 32 -> 8x8x64
        self.classifier = nn.Sequential(
            nn.Linear(64 * 8 * 8, 768), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(768, 768), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(768, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


class Inception(nn.Module):
    """GoogLeNet's block: 1x1 | 1x1 -> 3x3 | 1x1 -> 5x5 | 3x3 max-pool -> 1x1, concatenated."""

    def __init__(self, cin, c1, c3r, c3, c5r, c5, cp):
        super().__init__()
        self.b1 = conv_bn(cin, c1, 1)
        self.b3 = nn.Sequential(conv_bn(cin, c3r, 1), conv_bn(c3r, c3, 3))
        self.b5 = nn.Sequential(conv_bn(cin, c5r, 1), conv_bn(c5r, c5, 5))
        self.bp = nn.Sequential(nn.MaxPool2d(3, 1, padding=1), conv_bn(cin, cp, 1))
        self.out_channels = c1 + c3 + c5 + cp

    def forward(self, x):
        return torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], 1)


class GoogLeNetLike(nn.Module):
    """GoogLeNet's 9 inception blocks (3a-3b, 4a-4e, 5a-5b) with the real branch widths divided by 4, a
    3-conv stem of stride 2 (32x32 -> 16x16 at block 3a, 8x8 at 4a, 4x4 at 5a; GoogLeNet: 28/14/7), max-pools
    between the stages, global average pooling and one Linear (~15% of the parameters, as GoogLeNet's)."""

    blocks = ((64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64), "M",
              (192, 96, 208, 16, 48, 64), (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64),
              (112, 144, 288, 32, 64, 64), (256, 160, 320, 32, 128, 128), "M",
              (256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128))

    def __init__(self, num_classes=256, width_div=4):
        super().__init__()
        # stem: conv1 (stride 2), conv2 1x1, conv2 3x3
        layers = [conv_bn(3, 16, 3, stride=2), conv_bn(16, 16, 1), conv_bn(16, 48, 3)]
        cin = 48
        for b in self.blocks:
            if b == "M":
                layers.append(nn.MaxPool2d(3, 2, padding=1))
                continue
            blk = Inception(cin, *[max(4, c // width_div) for c in b])
            layers.append(blk)
            cin = blk.out_channels
        self.features = nn.Sequential(*layers)                  # 32 -> 16 -> 8 -> 4
        self.dropout = nn.Dropout(0.4)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
        return self.fc(self.dropout(x))


MODELS = {"alexnet": AlexNetLike, "vgg": VGGLike, "googlenet": GoogLeNetLike}
DEFAULT_BATCH = {"alexnet": 32, "vgg": 16, "googlenet": 16}   # the paper's 128 / 32 / 64 per GPU, over 4


def profile(model: nn.Module, image: int = IMAGE) -> dict:
    """Parameters, tensors, share in Linear layers, largest tensor, multiply-adds per image."""
    params = list(model.named_parameters())
    total = sum(p.numel() for _, p in params)
    linear = sum(p.numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters())
    macs = [0]

    def hook(m, inp, out):
        if isinstance(m, nn.Conv2d):
            macs[0] += out.numel() // out.shape[0] * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
        elif isinstance(m, nn.Linear):
            macs[0] += out.numel() // out.shape[0] * m.in_features

    hs = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    was = model.training
    model.eval()
    with torch.no_grad():
        model(torch.zeros(1, 3, image, image))
    model.train(was)
    for h in hs:
        h.remove()
    big = max(params, key=lambda kv: kv[1].numel())
    return dict(params=total, tensors=len(params), fc_share=linear / total, macs=macs[0],
                largest=big[0], largest_share=big[1].numel() / total)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="alexnet")
    p.add_argument("--compression", choices=["none", "fp16", "terngrad"], default="terngrad")
    p.add_argument("--packing", choices=["2bit", "base3"], default="2bit")
    p.add_argument("--fusion-numel", type=int, default=None,
                   help="TernGrad tensor fusion: max elements per fused group (0 = off; default: TernGradConfig's)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="per rank; 0 = the model's default (alexnet 32, vgg 16, googlenet 16)")
    p.add_argument("--num-classes", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--num-warmup-batches", type=int, default=3, help="steps before timing")
    p.add_argument("--num-batches-per-iter", type=int, default=5, help="steps per timed iteration")
    p.add_argument("--num-iters", type=int, default=5, help="timed iterations")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--json", default="", help="write the results of rank 0 to this file")
    from horovod_terngrad.operations.devices import add_device_argument
    add_device_argument(p)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import horovod.torch as hvd

    from horovod_terngrad import TernGrad
    from horovod_terngrad.operations.devices import setup_device

    hvd.init()
    placement = setup_device(args.device, hvd.local_rank(), horovod=hvd)     # cuda:local_rank, or the CPU
    torch.set_num_threads(args.threads)
    rank, size = hvd.rank(), hvd.size()
    batch = args.batch_size or DEFAULT_BATCH[args.model]

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    torch.manual_seed(args.seed)
    model = MODELS[args.model](num_classes=args.num_classes)
    prof = profile(model)
    model.to(placement.device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    fusion = {} if args.fusion_numel is None else {"fusion_numel": args.fusion_numel}
    compressor = {"terngrad": TernGrad.configure(packing=args.packing, seed=args.seed, **fusion),
                  "none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[args.compression]
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compressor)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    g = torch.Generator().manual_seed(args.seed + rank)       # each rank its own (fixed) batch
    data = torch.randn(batch, 3, IMAGE, IMAGE, generator=g).to(placement.device)
    target = torch.randint(0, args.num_classes, (batch,), generator=g).to(placement.device)
    losses = []

    def benchmark_step():
        opt.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())

    pp = PAPER_PROFILES[args.model]
    if placement.note:
        log(placement.note)
    log(f"Model: {args.model}-like, {prof['params']:,} parameters in {prof['tensors']} tensors, "
        f"{100 * prof['fc_share']:.1f}% in Linear layers, largest tensor {prof['largest']} "
        f"({100 * prof['largest_share']:.1f}%), {prof['macs'] / 1e6:.1f}M multiply-adds per {IMAGE}x{IMAGE} image "
        f"({prof['params'] / prof['macs']:.3f} parameters per multiply-add)")
    log(f"  full-size {pp['name']}: {pp['params'] / 1e6:.1f}M parameters in {pp['tensors']} tensors (no BN), "
        f"{100 * pp['fc_share']:.1f}% in fc layers, {pp['macs'] / 1e9:.2f}G multiply-adds per 224x224 image "
        f"({pp['params'] / pp['macs']:.3f} parameters per multiply-add)")
    log(f"Batch size: {batch} per rank, {size} ranks, compression={args.compression}"
        + (f" ({args.packing})" if args.compression == "terngrad" else "")
        + (f", on {placement.device}" if placement.is_cuda else f", {args.threads} thread(s) per rank"))

    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    if args.compression == "terngrad":
        compressor.stats.reset()
    log("Running benchmark...")
    img_secs, iter_times = [], []
    for i in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = batch * args.num_batches_per_iter / t
        img_secs.append(img_sec)
        iter_times.append(t)
        log(f"Iter #{i}: {img_sec:.1f} img/sec per rank, {1000 * t / args.num_batches_per_iter:.1f} ms/step")

    n = len(img_secs)
    mean = sum(img_secs) / n
    conf = 1.96 * math.sqrt(sum((v - mean) ** 2 for v in img_secs) / n)
    # the total is the sum of every rank's own mean (ranks may differ slightly)
    totals = hvd.allgather(torch.tensor([[mean, conf]], dtype=torch.float64), name="bench.img_sec")
    total, total_conf = totals[:, 0].sum().item(), math.sqrt((totals[:, 1] ** 2).sum().item())
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {size} rank(s): {total:.1f} +-{total_conf:.1f}")
    k = min(3, len(losses))
    log(f"Loss on the fixed batch: first {sum(losses[:k]) / k:.4f}, last {sum(losses[-k:]) / k:.4f} "
        f"({len(losses)} steps)")
    steps = args.num_iters * args.num_batches_per_iter
    res = {"model": args.model, "compression": args.compression, "ranks": size, "batch_per_rank": batch,
           "img_sec_per_rank": mean, "img_sec_conf": conf, "img_sec_total": total, "img_sec_total_conf": total_conf,
           "ms_per_step": 1000 * sum(iter_times) / steps, "loss_first": sum(losses[:k]) / k,
           "loss_last": sum(losses[-k:]) / k, **{f"profile_{key}": v for key, v in prof.items()}}
    if args.compression == "terngrad":
        st = compressor.stats
        res["bits_per_element"] = st.bits_per_element()
        res["collectives_per_step"] = st.collectives / steps
        res["fusion_numel"] = compressor.config.fusion_numel
        log(f"TernGrad: {st.bits_per_element():.3f} bits/element handed to collectives "
            f"({st.bytes_sent / steps / 1024:.1f} KiB/step vs fp32 {4 * prof['params'] / 1024:.1f} KiB/step; "
            f"{st.tensors / steps:.0f} tensors in {st.collectives / steps:.0f} collectives/step, fusion_numel "
            f"{compressor.config.fusion_numel}); per step codec {1000 * st.codec_s / steps:.1f} ms, "
            f"waiting for handshakes {1000 * st.handshake_wait_s / steps:.1f} ms, for payloads "
            f"{1000 * st.gather_wait_s / steps:.1f} ms")
    else:
        res["bits_per_element"] = 16.0 if args.compression == "fp16" else 32.0
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    hvd.shutdown()
    return res


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
