"""A `transformers` causal LM (GPT-2 built from a GPT2Config: no weights to download) trained on real text with
TernGrad, through Horovod or through PyTorch DDP's communication hook.

    horovodrun --gloo -np 2 -H localhost:2 python examples/transformers_lm.py --frontend horovod
    torchrun --standalone --nproc_per_node 2 examples/transformers_lm.py --frontend ddp
    torchrun --nnodes 2 --nproc_per_node 2 ... examples/transformers_lm.py --frontend fsdp
    ... --compression none                       # the fp32 baseline (Horovod's allreduce / DDP's own / native HSDP)

``--frontend fsdp`` is HSDP with FSDP2: a (replicate, shard) mesh of (nodes, ranks per node) (``--replicas``
overrides the node count torchrun gives), every GPT2Block and the root an FSDP unit sharded inside the node, and
the shards averaged across nodes by TernGrad (``horovod_terngrad.fsdp.register``); ``--compression none`` is
native HSDP (``fully_shard`` on the 2-D mesh, fp32 all-reduce across nodes), ``--compression bf16`` native HSDP
with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``.  "Parameters identical" then compares the replicas
of every shard.

The corpus is Python's reference documentation as CPython ships it (``pydoc_data.topics``: 79 topics, about
465 KB of English prose with code, in every Python install; ``--corpus FILE`` takes any text file instead),
read as bytes: the vocabulary is the 256 byte values, so no tokenizer is downloaded either.  Every 20th block
of 4 KB is held out.  Each rank draws its own random windows of ``--seq-len`` bytes.

Rank 0 prints every ``--log-every`` steps the training loss, tokens/s (all ranks together) and the bits per
gradient element handed to collectives: over the ternarized elements (2.0 for 2bit, 1.6 for base3, plus the
headers) and over every gradient element (the small tensors under ``min_numel`` travel in fp32).  At the end:
the held-out loss, whether every rank holds bit-identical parameters, and one ``result: {...}`` JSON line (also
written to ``--json``).

``--eval-every K`` (default 0: off) adds a learning curve: every K steps and after the last one the held-out loss
(the same ``held_out_loss`` as at the end), with ``train_s``, the training wall time so far without the
evaluations' own time, recorded in the result as ``"curve": [{"step", "train_s", "held_out_loss"}, ...]``
(examples/time_to_quality.py reads it).  Every rank evaluates (on DDP and Horovod without a collective), so the
ranks pause alike and go on in step; ``tokens_per_s`` then leaves the evaluations out too.

``--amp fp16`` runs forward and loss under ``torch.autocast`` in fp16 with a ``torch.amp.GradScaler``, in each
frontend's recipe (Horovod: ``synchronize``, ``unscale_``, ``step`` under ``skip_synchronize``; DDP: ``step``; see
examples/mixed_precision.py); the log lines then show the steps the scaler skipped so far and the loss scale
(``--init-scale`` sets its first one), and the result gives both and every rank's count.  ``--amp bf16``: autocast
in bf16, no scaler.  ``--compression none`` takes them too (the baseline).  The held-out loss is computed in fp32.

``--device auto`` (the default) runs each rank on its local GPU when torch sees one: ``cuda:LOCAL_RANK`` with NCCL
for DDP and FSDP (the mesh on CUDA), ``cuda:hvd.local_rank()`` for Horovod (built with CUDA: ``scripts/setup.sh
--cuda``); else the CPU with gloo.  ``--device cpu`` / ``cuda`` force it.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
import sys
import zlib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mixed_precision  # noqa: E402 (--amp: autocast, GradScaler's recipes, skipped steps)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frontend", choices=["horovod", "ddp", "fsdp"], default="horovod")
    p.add_argument("--compression", choices=["terngrad", "none", "bf16", "fp16", "powersgd"], default="terngrad",
                   help="bf16: --frontend fsdp only (native HSDP, bf16 reduce); fp16, powersgd: --frontend ddp only "
                        "(PyTorch's fp16_compress_hook, PowerSGD with error feedback)")
    p.add_argument("--optim", choices=["adamw", "tg-adamw"], default="tg-adamw",
                   help="horovod_terngrad.optim.AdamW (default: the ternary noise kept out of the second moment; "
                        "the same as torch's without TernGrad), or torch.optim.AdamW")
    p.add_argument("--refresh", default=None, metavar="W,I,K,M",
                   help="tg-adamw in its refresh mode (v from full-precision refreshes only), RefreshSchedule: "
                        "warm-up W, first interval I, K refreshes per interval, max interval M (default: the "
                        "noise-corrected mode, no refreshes)")
    p.add_argument("--recipe", choices=["plain", "nanogpt"], default="plain",
                   help="nanogpt: betas (0.9, 0.95), weight decay 0.1 on matrices, 100 warm-up steps then cosine "
                        "decay to lr/10, gradient-norm clip 1.0, 16 sequences per rank (flags given override)")
    p.add_argument("--beta2", type=float, default=None)
    p.add_argument("--weight-decay", type=float, default=None, help="AdamW's, on parameters of 2+ dimensions")
    p.add_argument("--warmup", type=int, default=None, help="linear lr warm-up steps")
    p.add_argument("--cosine", action="store_true", default=None, help="cosine lr decay to lr/10 after warm-up")
    p.add_argument("--clip-grad", type=float, default=None, help="gradient-norm clip (0: none)")
    p.add_argument("--min-numel", type=int, default=None, help="TernGrad's min_numel (default: the library's)")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--powersgd-start", type=int, default=10, help="PowerSGD's start_powerSGD_iter")
    p.add_argument("--replicas", type=int, default=0,
                   help="fsdp: the mesh's replicate size (default: torchrun's nodes, WORLD_SIZE / LOCAL_WORLD_SIZE)")
    p.add_argument("--packing", choices=["2bit", "base3"], default="2bit")
    p.add_argument("--bucket-size", type=int, default=0, help="TernGrad's bucket_size (0: one scaler per tensor)")
    p.add_argument("--intra-node-dtype", choices=["bfloat16", "float32"], default=None,
                   help="what the node-aware exchange sends inside a node (default: the library's, bfloat16)")
    p.add_argument("--exchange", choices=["default", "allgather", "sharded", "reternarized", "requantized", "auto"],
                   default=None,
                   help="TernGrad's exchange (default: the frontend's)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=None, help="sequences per rank and step (default 8)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256, help="the model's vocabulary (the data are bytes: 256)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out loss every K steps and at the end, into the result's 'curve' with the training "
                        "time so far without the evaluations (0: only at the end)")
    p.add_argument("--corpus", default=None,
                   help="a text file, or 'stdlib' (the top-level modules of Python's standard library, ~4.7 MB "
                        "of code); default: Python's pydoc_data.topics")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", default=None, help="write the result here (rank 0)")
    mixed_precision.add_arguments(p)
    from horovod_terngrad.operations.devices import add_device_argument
    add_device_argument(p)
    args = p.parse_args(argv)
    recipe = RECIPES[args.recipe]
    for k, v in recipe.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


RECIPES = {"plain": dict(batch_size=8, beta2=0.999, weight_decay=0.0, warmup=0, cosine=False, clip_grad=0.0),
           # nanoGPT's (Karpathy's train_shakespeare_char, scaled): what users train small GPTs with
           "nanogpt": dict(batch_size=16, beta2=0.95, weight_decay=0.1, warmup=100, cosine=True, clip_grad=1.0)}


def lr_at(args, step: int) -> float:
    """The learning rate of step ``step`` (1-based): linear warm-up, then constant or cosine to lr/10."""
    if args.warmup and step <= args.warmup:
        return args.lr * step / args.warmup
    if not args.cosine:
        return args.lr
    done = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr / 10 + 0.5 * (args.lr - args.lr / 10) * (1 + math.cos(math.pi * min(1.0, done)))


def make_optimizer(args, model):
    """AdamW (torch's or TernGrad's) with weight decay on matrices only, as nanoGPT does."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    kw = dict(lr=args.lr, betas=(0.9, args.beta2))
    if args.optim == "adamw":
        return torch.optim.AdamW(groups, **kw)
    from horovod_terngrad.optim import AdamW, RefreshSchedule
    if args.refresh:
        w, i, k, m = (int(x) for x in args.refresh.split(","))
        kw["refresh"] = RefreshSchedule(warmup=w, interval=i, per_phase=k, max_interval=m)
    return AdamW(groups, **kw)


def terngrad_settings(args) -> dict:
    kw = dict(packing=args.packing, seed=args.seed, bucket_size=args.bucket_size)
    if args.min_numel is not None:
        kw["min_numel"] = args.min_numel
    if getattr(args, "exchange", None) is not None:
        kw["exchange"] = args.exchange
    if getattr(args, "intra_node_dtype", None) is not None:
        kw["intra_node_dtype"] = args.intra_node_dtype
    return kw


def load_corpus(path: str | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train bytes, held-out bytes, description) as uint8 tensors."""
    if path == "stdlib":
        import glob
        import sysconfig
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        data = b"".join(open(f, "rb").read() for f in files)
        what = f"Python's standard library source ({len(files)} top-level modules)"
    elif path:
        with open(path, "rb") as f:
            data, what = f.read(), os.path.basename(path)
    else:
        from pydoc_data.topics import topics
        data = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
        what = "Python's reference docs (pydoc_data.topics)"
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    blocks = list(ids.split(4096))          # every 20th block of 4 KB held out: a sample of the whole corpus
    held = [b for i, b in enumerate(blocks) if i % 20 == 19]
    kept = [b for i, b in enumerate(blocks) if i % 20 != 19]
    return torch.cat(kept), torch.cat(held), f"{what}, {len(data) / 1e3:.0f} KB"


def make_model(args, seq_len: int | None = None):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=getattr(args, "vocab", 256), n_positions=seq_len or args.seq_len, n_embd=args.n_embd,
                     n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"        # what transformers picks anyway, without its warning
    return model


def windows(ids: torch.Tensor, n: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - seq_len, (n,), generator=gen)
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()]).long()


def held_out_loss(model, held_out: torch.Tensor, seq_len: int, batch: int = 64) -> float:
    """Mean loss over every non-overlapping window of the held-out bytes (the same on every rank and run)."""
    n = len(held_out) // seq_len
    data = held_out[:n * seq_len].view(n, seq_len).long()
    device = next(model.parameters()).device
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, batch):
            w = data[i:i + batch].to(device)
            total += model(input_ids=w, labels=w).loss.item() * len(w)
    return total / n


def checksum(model) -> int:
    """Of this rank's parameters (under FSDP, of its local shards)."""
    code = 0
    for p in model.parameters():
        p = p.to_local() if hasattr(p, "to_local") else p
        code = zlib.crc32(p.detach().cpu().contiguous().float().numpy().tobytes(), code)
    return code


def replicas_identical(front, model) -> bool:
    """Every rank's parameters equal every other's; under FSDP, every shard's replicas equal each other."""
    codes = front.gather(checksum(model))
    if front.kind != "fsdp":
        return len(set(codes)) == 1
    shard_of = front.gather(front.mesh.get_coordinate()[1])
    return all(len({c for c, s in zip(codes, shard_of) if s == k}) == 1 for k in set(shard_of))


class Frontend:
    """Horovod's DistributedOptimizer with TernGrad, or DDP with TernGrad's hook: rank, size, the module to call,
    the optimizer, the compressor's counters, and a way to compare every rank's checksum."""

    def __init__(self, args, model, placement=None):
        from horovod_terngrad.operations.devices import resolve_device
        self.placement = placement or resolve_device("cpu")
        self.kind = args.frontend
        self.counters = None
        if self.kind == "fsdp":
            self._fsdp(args, model)
            return
        if args.compression == "bf16":
            raise SystemExit("--compression bf16 is native HSDP's bf16 reduce: --frontend fsdp only")
        if args.compression in ("fp16", "powersgd") and self.kind != "ddp":
            raise SystemExit(f"--compression {args.compression} is a DDP communication hook: --frontend ddp only")
        opt = make_optimizer(args, model)
        if self.kind == "horovod":
            import horovod.torch as hvd

            from horovod_terngrad import TernGrad
            self.hvd = hvd
            self.rank, self.size = hvd.rank(), hvd.size()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            comp = hvd.Compression.none
            if args.compression == "terngrad":
                comp = self.counters = TernGrad.configure(**terngrad_settings(args))
            self.opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
            self.forward = model
        else:
            import torch.distributed as dist

            from horovod_terngrad import ddp as tg_ddp
            self.dist = dist
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self.forward = torch.nn.parallel.DistributedDataParallel(   # broadcasts rank 0's weights
                model, device_ids=self.placement.device_ids)
            if args.compression == "terngrad":
                self.counters = tg_ddp.register(self.forward, **terngrad_settings(args))
            elif args.compression in ("fp16", "powersgd"):
                from horovod_terngrad.operations import ddp_hooks
                ddp_hooks.install(self.forward, args.compression, powersgd_rank=args.powersgd_rank,
                                  powersgd_start=args.powersgd_start, seed=args.seed)
            self.opt = opt

    def _fsdp(self, args, model):
        """HSDP: every GPT2Block and the root sharded inside the node; across nodes TernGrad or native HSDP."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from horovod_terngrad import fsdp as tg_fsdp
        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        replicas = args.replicas or self.size // int(os.environ.get("LOCAL_WORLD_SIZE", self.size))
        if replicas < 1 or self.size % replicas:
            raise SystemExit(f"--replicas {replicas} does not divide the {self.size} ranks")
        self.mesh = init_device_mesh(self.placement.device.type, (replicas, self.size // replicas),
                                     mesh_dim_names=("replicate", "shard"))
        kw = {"mesh": self.mesh["shard"] if args.compression == "terngrad" else self.mesh}
        if args.compression == "bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
        for block in model.transformer.h:
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        if args.compression == "terngrad":
            self.counters = tg_fsdp.register(model, self.mesh, **terngrad_settings(args))
        self.opt = make_optimizer(args, model)
        self.forward = model

    def uncompressed(self) -> int:
        c = self.counters
        return c.uncompressed_elements if self.kind == "horovod" else c.state.uncompressed_elements

    def gather(self, value: int) -> list[int]:
        if self.kind == "horovod":
            return self.hvd.allgather_object(value)
        out = [None] * self.size
        self.dist.all_gather_object(out, value)
        return out


def bits(front, args=None, model=None, steps: int = 0) -> tuple[float, float]:
    """(bits per ternarized element, bits per gradient element) handed to collectives so far (full-precision
    refreshes of tg-adamw count 32 bits per element; fp16's hook 16; PowerSGD 32 before its start, then its
    factors' share)."""
    if front.counters is None:
        if args is not None and args.compression == "fp16":
            return 16.0, 16.0
        if args is not None and args.compression == "powersgd" and steps:
            from horovod_terngrad.operations.ddp_hooks import powersgd_bits
            early = min(steps, args.powersgd_start)
            low = powersgd_bits(model, args.powersgd_rank)
            return low, (32.0 * early + low * (steps - early)) / steps
        return 32.0, 32.0
    st = front.counters.stats
    plain = front.uncompressed()
    total = st.elements + plain
    return st.bits_per_element(), (8.0 * st.bytes_sent + 32.0 * plain) / total if total else 0.0


def train_step(args, step: int, forward, opt, amp, clip, train: torch.Tensor, gen: torch.Generator,
               device: torch.device | None = None) -> torch.Tensor:
    """One training step of the recipe: a batch of random windows (drawn on the CPU, moved to ``device``), the
    step's lr, forward (under ``amp``'s autocast), backward, ``clip``, the optimizer's step (``amp.step``: with
    --amp fp16, GradScaler's recipe).  Returns the loss.  Also examples/time_to_quality.py's compute-alone step."""
    x = windows(train, args.batch_size, args.seq_len, gen)
    if device is not None:
        x = x.to(device)
    for group in opt.param_groups:
        group["lr"] = lr_at(args, step)
    opt.zero_grad()
    with amp.autocast():
        loss = forward(input_ids=x, labels=x).loss
    amp.step(loss, opt, clip=clip)
    return loss


def main(argv=None):
    args = parse_args(argv)
    from horovod_terngrad.operations.devices import setup_device
    torch.set_num_threads(args.threads)
    if args.frontend == "horovod":
        import horovod.torch as hvd
        hvd.init()
        placement = setup_device(args.device, hvd.local_rank(), horovod=hvd)   # cuda:local_rank, or the CPU
    else:      # ddp, fsdp
        import torch.distributed as dist
        placement = setup_device(args.device)       # cuda:LOCAL_RANK with NCCL, or the CPU with gloo
        dist.init_process_group(placement.backend)
    torch.manual_seed(args.seed)                 # the same initial weights on every rank
    train, held_out, what = load_corpus(args.corpus)
    model = make_model(args).to(placement.device)
    front = Frontend(args, model, placement)
    amp = mixed_precision.MixedPrecision(args.amp, placement.device.type, args.init_scale,
                                         horovod=args.frontend == "horovod")
    rank, size = front.rank, front.size
    # rank 0 shows TernGrad's one-time INFO lines: the links it measured and the exchange the defaults chose
    logging.basicConfig(format="%(message)s")
    logging.getLogger("horovod_terngrad").setLevel(logging.INFO if rank == 0 else logging.WARNING)
    nparams = sum(p.numel() for p in model.parameters())
    if rank == 0 and placement.note:
        print(placement.note, flush=True)
    if rank == 0:
        print(f"GPT-2 ({args.n_layer} layers, {args.n_embd} wide, {nparams} parameters, byte vocabulary) on {what}; "
              f"{size} ranks, {args.frontend} frontend, compression={args.compression}"
              + (f" ({args.packing})" if args.compression == "terngrad" else "")
              + (f", amp {args.amp}" + (f" (initial loss scale {args.init_scale:g})" if args.amp == "fp16" else "")
                 if amp.enabled else ""), flush=True)
    gen = torch.Generator().manual_seed(1000 + args.seed + rank)
    tokens_per_step = args.batch_size * args.seq_len * size
    clip = None
    if args.clip_grad:
        def clip():
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
    losses, t_start, t_log, last_log = [], time.perf_counter(), time.perf_counter(), 0
    curve, eval_s = [], 0.0          # --eval-every: the learning curve; seconds spent evaluating so far
    model.train()
    for step in range(1, args.steps + 1):
        loss = train_step(args, step, front.forward, front.opt, amp, clip, train, gen, placement.device)
        losses.append(loss.item())
        if rank == 0 and args.log_every and (step % args.log_every == 0 or step == args.steps):
            now = time.perf_counter()
            tern, overall = bits(front, args, model, step)
            print(f"step {step}: loss {sum(losses[last_log:]) / (step - last_log):.3f}  "
                  f"{tokens_per_step * (step - last_log) / (now - t_log):.0f} tokens/s  "
                  f"{tern:.2f} bits/element ternarized, {overall:.2f} over all gradient elements"
                  + (f"  {amp.summary()}" if amp.enabled else ""), flush=True)
            t_log, last_log = now, step
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            # EVERY rank evaluates, not rank 0 alone.  On DDP and Horovod evaluation runs no collective, and
            # were rank 0 alone to evaluate, the others would run ahead into the next step and wait for it
            # inside a collective, so the pause would leak into the next step's time (and its overlap of
            # compute and exchange); on FSDP the forward all-gathers shards, so every rank must run it anyway.
            # With every rank doing the same work on the same parameters, all pause alike and go on in step;
            # rank 0's clock, less its own evaluations, is the training time.  No barrier is needed.
            t_eval = time.perf_counter()
            model.eval()                             # the bare module: DDP's forward would sync buffers
            curve_loss = held_out_loss(model, held_out, args.seq_len)
            model.train()
            now = time.perf_counter()
            eval_s += now - t_eval
            t_log += now - t_eval                    # the log's tokens/s leaves the evaluation out as well
            curve.append({"step": step, "train_s": now - t_start - eval_s, "held_out_loss": curve_loss})
            if rank == 0:
                print(f"eval step {step}: held-out loss {curve_loss:.4f} after {curve[-1]['train_s']:.1f} s of "
                      f"training", flush=True)
    elapsed = time.perf_counter() - t_start - eval_s
    model.eval()
    # with --eval-every the curve's last point is this very loss (same parameters, same function): not twice
    held = curve[-1]["held_out_loss"] if curve and curve[-1]["step"] == len(losses) else \
        held_out_loss(model, held_out, args.seq_len)
    same = replicas_identical(front, model)
    tern, overall = bits(front, args, model, len(losses))
    k = max(1, min(20, len(losses) // 4))
    result = {"frontend": args.frontend, "compression": args.compression, "optim": args.optim, "recipe": args.recipe,
              "seed": args.seed, "lr": args.lr, "ranks": size, "steps": len(losses),
              # what a comparison of held-out losses must hold equal (examples/adam_study_table.py checks it)
              "batch_size": args.batch_size, "seq_len": args.seq_len, "global_batch": args.batch_size * size,
              "params": nparams, "loss_first": sum(losses[:k]) / k, "loss_last": sum(losses[-k:]) / k,
              "held_out_loss": held, "held_out_bits_per_byte": held / math.log(2),
              "tokens_per_s": tokens_per_step * len(losses) / elapsed, "bits_per_element_ternarized": tern,
              "bits_per_element_overall": overall, "params_identical": same, **amp.record()}
    if args.eval_every:
        result["eval_every"], result["curve"] = args.eval_every, curve
    if args.frontend == "fsdp":
        result["replicas"] = front.mesh.size(0)          # the (replicate, shard) mesh's replicate size
    if amp.scaler is not None:       # every rank saw the same averaged gradients, so every rank skipped the same steps
        result["skipped_steps_per_rank"] = front.gather(amp.skipped)
    if front.counters is not None:
        result["elements_ternarized"] = front.counters.stats.elements
        result["elements_uncompressed"] = front.uncompressed()
        result["nonfinite_propagated"] = front.counters.stats.nonfinite_propagated   # ternarized, averaged to NaN
        result["bytes_sent"] = front.counters.stats.bytes_sent
        result["bytes_saved_vs_fp32"] = 4 * front.counters.stats.elements - front.counters.stats.bytes_sent
    if rank == 0:
        print(f"held-out loss {held:.3f} ({held / math.log(2):.2f} bits/byte); {result['tokens_per_s']:.0f} tokens/s; "
              f"parameters identical on every rank: {same}", flush=True)
        if amp.scaler is not None:
            print(f"{amp.summary()} (initial {args.init_scale:g}); steps skipped on each rank: "
                  f"{result['skipped_steps_per_rank']}", flush=True)
        if front.counters is not None:
            sent, fp32 = result["bytes_sent"], 4 * result["elements_ternarized"]
            print(f"TernGrad on rank 0: sent {sent / 1e6:.2f} MB for {result['elements_ternarized']} ternarized "
                  f"elements against {fp32 / 1e6:.2f} MB in fp32: {result['bytes_saved_vs_fp32'] / 1e6:.2f} MB saved "
                  f"({fp32 / max(sent, 1):.1f}x fewer); {result['elements_uncompressed']} elements at full "
                  f"precision", flush=True)
        print("result: " + json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    return result


def shutdown() -> None:
    """End torch.distributed after main()'s DDP model is gone: destroying the process group under a live DDP
    model aborts the process now and then at exit (torch 2.13, gloo: "terminate called without an active
    exception")."""
    import gc

    import torch.distributed as dist
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()                            # no rank tears gloo down while another still talks
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    shutdown()
