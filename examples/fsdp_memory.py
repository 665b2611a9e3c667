"""Per-rank memory of parameters + gradients + optimizer state: DDP against HSDP (FSDP2 sharded over G ranks
of a node), with TernGrad or native reduction across nodes, on a transformers GPT-2 with AdamW.

    torchrun --standalone --nproc_per_node 4 examples/fsdp_memory.py --replicas 2 --json docs/fsdp/memory.json

Each configuration builds the same model (same seed), trains ``--steps`` steps, and every rank counts the bytes
of the tensors it holds after the optimizer's step (when all three exist): its parameters (under FSDP its local
shards, ``to_local()``), their gradients, and the optimizer's state (AdamW: step, exp_avg, exp_avg_sq).  That
is the persistent part, and where DDP and HSDP differ: DDP keeps every tensor whole on every rank, HSDP 1/G of
it (uneven first dimensions give the lower shards a row more).  Beside it, the transient part FSDP adds during
forward and backward: one unit's parameters all-gathered (and its unsharded gradients), bounded by the largest
unit (two, with FSDP's prefetch of the next); TernGrad adds its fp32 copy of one unit's shard and its payloads
while it exchanges that unit (a few percent of the shard).  Peak = persistent + transient, computed from the
units' sizes; the table shows both.  The CPU has no allocator counters to read a measured peak from; on GPUs
(``--device auto``, the default, takes each rank's local GPU with NCCL when torch sees one) every rank's record
also holds ``cuda_peak_allocated``, the CUDA allocator's peak for that configuration.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from transformers_lm import make_model  # noqa: E402


def nbytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def held(model, opt) -> dict:
    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(p.grad) for p in model.parameters() if p.grad is not None)
    state = sum(nbytes(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"params": params, "grads": grads, "optimizer": state, "persistent": params + grads + state}


def build(kind, args, mesh, placement):
    from torch.distributed.fsdp import fully_shard

    from horovod_terngrad import ddp as tg_ddp
    from horovod_terngrad import fsdp as tg_fsdp
    torch.manual_seed(0)
    model = make_model(args).to(placement.device)
    units = [sum(p.numel() for p in b.parameters()) for b in model.transformer.h]
    root = sum(p.numel() for p in model.parameters()) - sum(units)
    state = None
    if kind == "ddp-terngrad":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=placement.device_ids)
        state = tg_ddp.register(model)
        transient = 0
    else:
        for b in model.transformer.h:
            fully_shard(b, mesh=mesh["shard"] if kind == "hsdp-terngrad" else mesh)
        fully_shard(model, mesh=mesh["shard"] if kind == "hsdp-terngrad" else mesh)
        if kind == "hsdp-terngrad":
            state = tg_fsdp.register(model, mesh)
        # all-gathered parameters and unsharded gradients of the largest unit, and the next one prefetched
        largest = sorted(units + [root])[-2:]
        transient = 4 * (2 * largest[-1] + largest[0])
    return model, transient, state


def make_optimizer(args, model):
    if args.optim == "tg-adamw":
        from horovod_terngrad.optim import AdamW
        return AdamW(model.parameters(), lr=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--optim", choices=["tg-adamw", "adamw"], default="tg-adamw",
                   help="horovod_terngrad.optim.AdamW (default: one more state tensor, the noise estimate's running "
                        "mean, beside every parameter, ternarized or not) or torch.optim.AdamW")
    p.add_argument("--json", default="")
    from horovod_terngrad.operations.devices import add_device_argument, setup_device
    add_device_argument(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    placement = setup_device(args.device)          # cuda:LOCAL_RANK with NCCL, or the CPU with gloo
    dist.init_process_group(placement.backend)
    from torch.distributed.device_mesh import init_device_mesh
    rank, world = dist.get_rank(), dist.get_world_size()
    G = world // args.replicas
    mesh = init_device_mesh(placement.device.type, (args.replicas, G), mesh_dim_names=("replicate", "shard"))
    rows = []
    for kind in ("ddp-terngrad", "hsdp-fp32", "hsdp-terngrad"):
        if placement.is_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(placement.device)
        model, transient, state = build(kind, args, mesh, placement)
        opt = make_optimizer(args, model)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(args.steps):
            x = torch.randint(0, 256, (4, args.seq_len), generator=gen).to(placement.device)
            opt.zero_grad()
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
        mine = held(model, opt)
        if placement.is_cuda:        # on a GPU the allocator's own peak, beside the computed one
            mine["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(placement.device)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        sent = (state.stats.bytes_sent, state.stats.elements) if state is not None else None
        rows.append({"config": kind, "per_rank": everyone, "transient": transient,
                     "max_persistent": max(e["persistent"] for e in everyone), "terngrad_sent_elements": sent})
        del model, opt
    if rank == 0:
        params = sum(p.numel() for p in make_model(args).parameters())
        base = rows[0]["max_persistent"]
        optim = "horovod_terngrad.optim.AdamW" if args.optim == "tg-adamw" else "torch.optim.AdamW"
        print(f"GPT-2 {args.n_layer} layers x {args.n_embd}, {params} parameters, {optim}; {world} ranks = "
              f"{args.replicas} nodes x G={G}")
        print("| configuration | params | grads | optimizer state | persistent (largest rank) | vs DDP | "
              "+ transient (FSDP unit gather) | peak vs DDP |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            e = max(r["per_rank"], key=lambda x: x["persistent"])
            peak = r["max_persistent"] + r["transient"]
            print(f"| {r['config']} | {e['params'] / 1e6:.2f} MB | {e['grads'] / 1e6:.2f} MB | "
                  f"{e['optimizer'] / 1e6:.2f} MB | {r['max_persistent'] / 1e6:.2f} MB | "
                  f"{r['max_persistent'] / base:.3f}x | {r['transient'] / 1e6:.2f} MB | {peak / base:.3f}x |")
        for r in rows:
            if r["terngrad_sent_elements"]:
                sent, elements = r["terngrad_sent_elements"]
                print(f"{r['config']}: TernGrad on rank 0 sent {sent / 1e6:.2f} MB for {elements} ternarized elements "
                      f"in {args.steps} steps, against {4 * elements / 1e6:.2f} MB in fp32 "
                      f"({4 * elements / max(sent, 1):.1f}x fewer)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"params": params, "ranks": world, "G": G, "optim": args.optim, "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
