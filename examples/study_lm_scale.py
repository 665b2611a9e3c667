"""AdamW accuracy at scale: a `transformers` LM trained in the simulator (modelling/simulate.py: the real engine for
N ranks in one process, horovod_terngrad.optim.AdamW with its noise estimate) at N = 8-64 workers with a fixed
global batch, flat or in nodes of G ranks (the node-aware exchange), per exchange, against fp32 AdamW.

    python examples/study_lm_scale.py --model llama --corpus vimdoc --workers 8,16,32,64 --seeds 0,1,2 \\
        --exchanges none,allgather,requantized,reternarized --out docs/study/lm_scale/llama
    python examples/study_lm_scale.py ... --nodes-of 4          # nodes of 4 ranks: the node-aware exchange
    python examples/study_lm_scale.py --table docs/study/lm_scale/llama   # the tables of what ran

Models (built from a config: no weights to download), byte vocabulary (256), no dropout:
* ``llama``: LlamaForCausalLM: RMSNorm, SwiGLU, rotary positions, grouped-query attention (4 heads, 2 KV heads),
  untied embeddings; ``gpt2``: GPT2LMHeadModel (tied embedding, learned positions, GELU).
Corpora: ``vimdoc`` (Vim's English help text, /usr/share/vim/vim*/doc/*.txt, where Vim is installed), ``stdlib``
(Python's standard library sources), or a file.  Every 20th block of 4 KB is held out.

Recipe (nanoGPT's AdamW): lr 2e-3 (``--lr``), betas (0.9, 0.95), weight decay 0.1 on matrices, 10% linear warm-up
then cosine to 10%, global norm clip 1.0 on the averaged gradient, global batch ``--batch`` windows of
``--seq-len`` bytes drawn from the seed (the same batches for every method of a seed; each worker takes its slice).
fp32 (``none``) averages the workers' fp32 gradients: the same update at every N up to float rounding, so it runs
at the first N only.  TernGrad runs with the package's defaults but the exchange named, and
horovod_terngrad.optim.AdamW (noise estimate from the exchange).

Each run appends one JSON line to <out>/runs.jsonl: method, N, G, seed, lr, steps, held-out loss, seconds.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import time

import torch


def load_corpus(name: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    if name == "vimdoc":
        files = sorted(glob.glob("/usr/share/vim/vim*/doc/*.txt"))
        if not files:
            raise SystemExit("study_lm_scale: no Vim help text here (/usr/share/vim/vim*/doc); use --corpus stdlib")
        what = "Vim's help text"
    elif name == "stdlib":
        import sysconfig
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        what = "Python's standard library sources"
    else:
        files, what = [name], os.path.basename(name)
    data = b"".join(open(f, "rb").read() for f in files)
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    blocks = list(ids.split(4096))
    held = torch.cat([b for i, b in enumerate(blocks) if i % 20 == 19])
    kept = torch.cat([b for i, b in enumerate(blocks) if i % 20 != 19])
    return kept, held, f"{what} ({len(data) / 1e6:.1f} MB)"


def make_model(kind: str, width: int, layers: int, seq_len: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=int(width * 8 / 3) // 8 * 8,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=seq_len, tie_word_embeddings=False, attention_dropout=0.0,
                          bos_token_id=0, eos_token_id=0)
        model = LlamaForCausalLM(cfg)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=width, n_layer=layers, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


def lr_at(step: int, steps: int, lr: float) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def held_out_loss(model, held: torch.Tensor, seq_len: int, windows: int = 128) -> float:
    n = min(windows, (len(held) - 1) // seq_len)
    x = held[:n * seq_len].view(n, seq_len).long()
    with torch.no_grad():
        return float(model(input_ids=x, labels=x).loss)


def run(args, method: str, N: int, G: int, seed: int, lr: float, data) -> dict:
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.modelling.simulate import Simulator
    from horovod_terngrad.optim import AdamW
    train, held, _ = data
    model = make_model(args.model, args.width, args.layers, args.seq_len, seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = AdamW(groups, lr=lr, betas=(0.9, 0.95))
    from exchange_bits import exchange_spec
    # e.g. reternarized@b128: one scaler per 128 elements; a "+bf16" suffix: intra_node_dtype="bfloat16"
    spec, bf16 = (method[:-len("+bf16")], True) if method.endswith("+bf16") else (method, False)
    exchange, bucket = exchange_spec(spec)
    cfg = TernGradConfig(exchange=exchange if method != "none" else "allgather",
                         hierarchical=bool(G > 1), bucket_size=bucket,
                         intra_node_dtype="bfloat16" if bf16 else "float32")
    sim = Simulator(model, N, cfg, compression="none" if method == "none" else "terngrad",
                    ranks_per_node=max(G, 1))
    gen = torch.Generator().manual_seed(seed)

    t0 = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - args.seq_len, (args.batch,), generator=gen)
        x = torch.stack([train[s:s + args.seq_len] for s in starts.tolist()]).long()
        per = args.batch // N
        grads = []
        params = sim.params
        for r in range(N):
            xr = x[r * per:(r + 1) * per]
            loss = model(input_ids=xr, labels=xr).loss
            grads.append([g.detach() for g in torch.autograd.grad(loss, params)])
        avg = sim.average(grads)
        for p, g in zip(params, avg):
            p.grad = g.to(p.dtype)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, args.steps, lr)
        opt.step()
        if not all(torch.isfinite(p).all() for p in params):
            break
    loss = held_out_loss(model, held, args.seq_len)
    return {"model": args.model, "corpus": args.corpus, "method": method, "N": N, "G": G, "seed": seed, "lr": lr,
            "steps": args.steps, "batch": args.batch, "held_out": loss, "seconds": time.perf_counter() - t0,
            # rank 0's bits received per ternarized element (node-aware: across nodes only)
            "bits_received": 8 * sim.stats.bytes_received / max(1, sim.stats.elements) if method != "none" else 32.0}


def table(rows: list) -> str:
    """Per (method, topology, N, lr): mean, spread (max - min), worst seed, and the gap of the mean and of the
    worst seed to fp32's mean at the same lr."""
    base = {}
    for r in rows:
        if r["method"] == "none":
            base.setdefault(r["lr"], []).append(r["held_out"])
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["method"], r["G"], r["N"], r["lr"]), []).append(r)
    lines = ["| method | topology | N | lr | seeds | held-out per seed | mean | spread | worst | mean vs fp32 | "
             "worst vs fp32 mean |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {"none": 0, "allgather": 1, "requantized": 2, "reternarized": 3, "sharded": 4}
    for (m, G, N, lr), rs in sorted(cells.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1], kv[0][2],
                                                                    kv[0][3])):
        vals = [r["held_out"] for r in sorted(rs, key=lambda r: r["seed"])]
        mean = statistics.mean(vals)
        ref = statistics.mean(base[lr]) if lr in base else float("nan")
        topo = "flat" if G <= 1 else f"nodes of {G}"
        lines.append(f"| {'fp32' if m == 'none' else m} | {topo} | {N} | {lr:g} | {len(vals)} | "
                     f"{' / '.join(f'{v:.4f}' for v in vals)} | {mean:.4f} | {max(vals) - min(vals):.4f} | "
                     f"{max(vals):.4f} | {100 * (mean / ref - 1):+.2f}% | {100 * (max(vals) / ref - 1):+.2f}% |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--corpus", default="vimdoc")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="global batch (windows), split over the workers")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", default="2e-3", help="comma-separated: every method at each")
    p.add_argument("--workers", default="8,16,32,64")
    p.add_argument("--nodes-of", type=int, default=0, help="ranks per node (0 or 1: flat)")
    p.add_argument("--exchanges", default="none,allgather,requantized,reternarized",
                   help="comma-separated: none (fp32) or an exchange, optionally @bK for bucket_size=K "
                        "(one scaler per K elements; e.g. reternarized@b128), and a +bf16 suffix for "
                        "intra_node_dtype='bfloat16' (with --nodes-of)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default=None)
    p.add_argument("--table", default=None, metavar="DIR[,DIR...]",
                   help="print the table of the runs in DIR/runs.jsonl (several: together) and exit")
    p.add_argument("--write", default=None, metavar="FILE", help="with --table: also write it to FILE")
    args = p.parse_args(argv)
    if args.table:
        rows = [json.loads(line) for d in args.table.split(",") for line in open(os.path.join(d, "runs.jsonl"))]
        text = table(rows)
        print(text)
        if args.write:
            with open(args.write, "w") as f:
                f.write(text + "\n")
        return rows
    torch.set_num_threads(1)
    data = load_corpus(args.corpus)
    print(f"# {args.model} {args.layers}x{args.width} on {data[2]}; global batch {args.batch} x {args.seq_len}, "
          f"{args.steps} steps", flush=True)
    rows = []
    for lr in (float(x) for x in args.lr.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            for method in args.exchanges.split(","):
                for i, N in enumerate(int(n) for n in args.workers.split(",")):
                    if method == "none" and i > 0:
                        continue
                    row = run(args, method, N, args.nodes_of if method != "none" else 0, seed, lr, data)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.out:
                        os.makedirs(args.out, exist_ok=True)
                        with open(os.path.join(args.out, "runs.jsonl"), "a") as f:
                            f.write(json.dumps(row) + "\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
