"""LeNet on real MNIST with PyTorch DistributedDataParallel; gradients exchanged by a DDP communication hook:
TernGrad (horovod_terngrad.ddp), or PyTorch's own fp16_compress_hook / PowerSGD, or none (fp32 allreduce).

    torchrun --standalone --nproc_per_node 2 examples/ddp_mnist.py --hook terngrad
    launch/ddp-torchrun --nproc 2 -- examples/ddp_mnist.py --hook terngrad          # the same, from the repo's venv
    launch/ddp-torchrun --netns tg --nproc 1 -- examples/ddp_mnist.py --hook terngrad  # one torchrun per emulated host

Ranks find each other through torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
Started by ``srun`` without torchrun (slurm/ddp-terngrad.sbatch, LAUNCHER=srun), the same variables are taken
from Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID); MASTER_ADDR and MASTER_PORT must then be exported.

The network is Caffe's LeNet the paper trains (431k parameters: conv1 20x1x5x5, conv2 50x20x5x5, fc1 500x800,
fc2 10x500 and their biases).  With TernGrad's defaults (min_numel=4096) the three large weights and fc2's weight
are ternarized; conv1's weight and the biases (1,030 elements) travel uncompressed.  Each rank trains on its 1/N
shard of the 50k training images (gloo on CPU, NCCL when a GPU is used; PowerSGD on gloo
runs its buckets one after another, see horovod_terngrad/operations/ddp_hooks.py).  Rank 0 prints the loss every
``--log-every`` steps, test accuracy per epoch, and at the end one ``result: {...}`` JSON line (also written to
``--json``) with the first and last losses, the accuracy, ms per step, whether every rank holds bit-identical
parameters (checked with an all_gather of their checksums), and TernGrad's counters (elements ternarized, bits per
element sent, elements sent uncompressed).

``--amp fp16`` runs forward and loss under ``torch.autocast`` in fp16 with a ``torch.amp.GradScaler``
(``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``; examples/mixed_precision.py) and prints beside
the loss the steps the scaler skipped so far and the loss scale (``--init-scale`` sets its first one); ``--amp
bf16``: autocast in bf16, no scaler.  Works with every ``--hook``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optimizers  # noqa: E402 (--optim)
import mixed_precision  # noqa: E402 (--amp: autocast, GradScaler's recipe, skipped steps)
from mnist_lenet import LeNet  # noqa: E402 (the Horovod example's model: the same network on both frontends)

HOOKS = ("terngrad", "fp16", "powersgd", "none")     # horovod_terngrad/operations/ddp_hooks.py


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hook", choices=HOOKS, default="terngrad")
    p.add_argument("--packing", choices=["2bit", "base3"], default="2bit", help="TernGrad's packing")
    p.add_argument("--exchange", choices=["allgather", "sharded", "reternarized", "auto"], default="allgather",
                   help="TernGrad's exchange")
    p.add_argument("--on-nonfinite", choices=["propagate", "raise", "zero"], default=None,
                   help="TernGrad's on_nonfinite (default: the library's, 'propagate')")
    p.add_argument("--powersgd-rank", type=int, default=1, help="PowerSGD's matrix_approximation_rank")
    p.add_argument("--powersgd-start", type=int, default=10,
                   help="PowerSGD's start_powerSGD_iter (plain allreduce before it; must be > 1)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=None, help="default: 0.01 for sgd, 0.001 for the Adams")
    optimizers.add_arguments(p)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    p.add_argument("--test-limit", type=int, default=0, help="evaluate on the first N test images (0: all)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    from horovod_terngrad.operations.devices import add_device_argument
    add_device_argument(p)
    p.add_argument("--json", default="", help="write rank 0's result to this file")
    mixed_precision.add_arguments(p)
    return p.parse_args(argv)


def env_from_slurm() -> None:
    """Under ``srun`` without torchrun: RANK/WORLD_SIZE/LOCAL_RANK from Slurm's task variables."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise SystemExit(f"ddp_mnist: started by srun without torchrun, but {var} is not set "
                             "(slurm/ddp-terngrad.sbatch exports it)")


def identical_across_ranks(model) -> bool:
    """Every rank holds bit-identical parameters: all_gather of a checksum of their bytes."""
    import zlib
    code = 0
    for p in model.parameters():
        code = zlib.crc32(p.detach().cpu().contiguous().numpy().tobytes(), code)
    mine = torch.tensor([code], dtype=torch.int64, device=next(model.parameters()).device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return len({int(t.item()) for t in everyone}) == 1


def main(argv=None):
    args = parse_args(argv)
    env_from_slurm()
    from horovod_terngrad.operations import ddp_hooks
    from horovod_terngrad.operations.datasets import load_mnist
    from horovod_terngrad.operations.metrics import accuracy

    from horovod_terngrad.operations.devices import setup_device

    placement = setup_device(args.device)        # cuda:LOCAL_RANK with NCCL, or the CPU with gloo
    dist.init_process_group(placement.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    device = placement.device
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)                # identical initial weights (DDP also broadcasts rank 0's)

    data = load_mnist()
    xtr, ytr = data["train"]
    xte, yte = data["test"]
    if args.test_limit:
        xte, yte = xte[:args.test_limit], yte[:args.test_limit]
    xtr, ytr = xtr[rank::size].to(device), ytr[rank::size].to(device)

    module = LeNet().to(device)
    nparams = sum(p.numel() for p in module.parameters())
    model = nn.parallel.DistributedDataParallel(module, device_ids=placement.device_ids)
    state = ddp_hooks.install(model, args.hook, powersgd_rank=args.powersgd_rank, powersgd_start=args.powersgd_start,
                              seed=args.seed, **({"packing": args.packing, "exchange": args.exchange}
                                                 | ({"on_nonfinite": args.on_nonfinite} if args.on_nonfinite else {})
                                                 if args.hook == "terngrad" else {}))
    tg_state = state if args.hook == "terngrad" else None
    opt = optimizers.make(args, model.parameters())
    amp = mixed_precision.MixedPrecision(args.amp, device.type, args.init_scale)
    steps_per_epoch = len(xtr) // args.batch_size
    if args.max_steps:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    if rank == 0:
        print(f"LeNet ({nparams} parameters) on MNIST, DDP ({dist.get_backend()}), {size} ranks, "
              f"batch {args.batch_size}/rank, hook={args.hook}" + (f" ({tg_state.config})" if tg_state else "")
              + (f", amp {args.amp}" + (f" (initial loss scale {args.init_scale:g})" if args.amp == "fp16" else "")
                 if amp.enabled else ""), flush=True)
    g = torch.Generator().manual_seed(args.seed + rank)
    losses, accs = [], []
    t_train = 0.0
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(len(xtr), generator=g).to(device)
        model.train()
        t0 = time.perf_counter()
        for step in range(steps_per_epoch):
            idx = perm[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            with amp.autocast():
                loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            amp.step(loss, opt)                 # loss.backward(); opt.step() (with --amp fp16: GradScaler's recipe)
            losses.append(loss.item())
            if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
                k = args.log_every
                print(f"epoch {epoch} step {step + 1}/{steps_per_epoch}: loss {sum(losses[-k:]) / k:.4f}"
                      + (f"  {amp.summary()}" if amp.enabled else ""), flush=True)
        t_train += time.perf_counter() - t0
        accs.append(accuracy(model.module, xte.to(device), yte.to(device)))
        if rank == 0:
            print(f"epoch {epoch}: test accuracy {100 * accs[-1]:.2f}%" + (f"  {amp.summary()}" if amp.enabled else ""),
                  flush=True)
    same = identical_across_ranks(model.module)
    k = max(1, min(20, len(losses) // 4))
    result = {"hook": args.hook, "ranks": size, "steps": len(losses), "loss_first": sum(losses[:k]) / k,
              "loss_last": sum(losses[-k:]) / k, "test_acc": accs[-1] if accs else None,
              "ms_per_step": 1000 * t_train / max(1, len(losses)), "params_identical": same, "params": nparams,
              "host": os.uname().nodename, **amp.record()}
    if tg_state is not None:
        st = tg_state.stats
        result["terngrad"] = {"elements": st.elements, "tensors": st.tensors,
                              "bits_per_element": st.bits_per_element(),
                              "uncompressed_elements": tg_state.state.uncompressed_elements,
                              "nonfinite_propagated": st.nonfinite_propagated,     # ternarized tensors averaged to NaN
                              "nonfinite_zeroed": st.nonfinite_zeroed,             # ... or zeroed (on_nonfinite='zero')
                              "collectives": st.collectives}
    hosts = [None] * size
    dist.all_gather_object(hosts, result["host"])
    result["hosts"] = hosts
    if amp.scaler is not None:
        # every rank saw the same averaged gradients, so every rank skipped the same steps
        per_rank = [None] * size
        dist.all_gather_object(per_rank, amp.skipped)
        result["skipped_steps_per_rank"] = per_rank
        if rank == 0:
            print(f"{amp.summary()} (initial {args.init_scale:g}); steps skipped on each rank: {per_rank}", flush=True)
    if rank == 0:
        if tg_state is not None:
            st = tg_state.stats
            print(f"TernGrad on rank 0: sent {st.bytes_sent / 1e6:.2f} MB for {st.elements} ternarized elements against "
                  f"{4 * st.elements / 1e6:.2f} MB in fp32: {(4 * st.elements - st.bytes_sent) / 1e6:.2f} MB saved "
                  f"({4 * st.elements / max(st.bytes_sent, 1):.1f}x fewer)", flush=True)
        print("result: " + json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if tg_state is not None:
        tg_state.close()
    return result


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
    # torch.distributed ends after main's DDP model is gone: destroyed under a live one, gloo aborts the process
    # now and then at exit ("terminate called without an active exception"; a CI run saw it with --hook none)
    from transformers_lm import shutdown
    shutdown()
