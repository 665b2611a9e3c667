"""AdamW accuracy over whole runs: a `transformers` LM trained in the simulator (modelling/simulate.py: the real
engine for N ranks in one process) at N = 2-64 workers with a fixed global batch, flat or in nodes of G ranks (the
node-aware exchange), per exchange, against fp32 AdamW, to the end of its learning-rate schedule.

    # one epoch of each corpus (warm-up, cosine decay to the end), 3 seeds, both cores:
    python examples/study_lm_scale.py --model llama --corpus perlpod --workers 8,16,64 --seeds 0,1,2 \\
        --exchanges none,default --lr 1e-3,2e-3,4e-3 --jobs 2 --out docs/study/whole_run/llama-perlpod
    python examples/study_lm_scale.py ... --nodes-of 4           # nodes of 4 ranks: the node-aware exchange
    python examples/study_lm_scale.py --table docs/study/whole_run/llama-perlpod   # the tables of what ran
    python examples/study_lm_scale.py --plot docs/study/whole_run/curves.png --table DIR   # held-out curves

Models (built from a config: no weights to download), byte vocabulary (256), no dropout:
* ``llama``: LlamaForCausalLM: RMSNorm, SwiGLU, rotary positions, grouped-query attention (4 heads, 2 KV heads),
  untied embeddings; ``gpt2``: GPT2LMHeadModel (tied embedding, learned positions, GELU).
Corpora: ``vimdoc`` (Vim's English help text, where Vim is installed), ``perlpod`` (Perl's documentation, POD, 1 MB
of English technical prose), ``copyright`` (every distinct /usr/share/doc/*/copyright file: licence and
attribution text), ``stdlib`` (Python's standard library sources), or a file; ``--max-mb`` keeps the first M MB.
Every 20th block of 4 KB is held out.

Recipe (nanoGPT's AdamW): lr 2e-3 (``--lr``), betas (0.9, 0.95), weight decay 0.1 on matrices, 10% linear warm-up
then cosine to 10% at the last step, global norm clip 1.0 on the averaged gradient, global batch ``--batch``
windows of ``--seq-len`` bytes drawn from the seed (the same batches for every method of a seed; each worker
takes its slice).  ``--steps 0`` (the default) runs ``--epochs`` epochs of the training bytes.  fp32 (``none``)
averages the workers' fp32 gradients: the same update at every N up to float rounding, so it runs at the first N
only.  TernGrad runs with the package's defaults but the exchange named (``default``: what
``TernGradConfig()`` picks at that N), with horovod_terngrad.optim.AdamW (noise estimate from the exchange) or,
with ``--optimizer torch``, torch.optim.AdamW (no estimate: the exchange alone).  ``owner-step-nearest`` and ``owner-step-stochastic`` (a
research path, examples/owner_step.py): the requantized exchange's first stage in base-3 to the shard owners, who
step their shards of the master weights with the first stage's noise estimate and send ternary weight differences
(rounded to the nearest level, or stochastically; ``@bK``: one scaler per K elements of the difference, else one per
shard); the workers train on the copy those differences build, the held-out loss is the master's (also recorded:
the copy's, and each stage's bits).  ``levels3`` / ``levels4`` (a research path, examples/level_rounding.py): the
ranks' gradients rounded stochastically to 3 levels (ternary) or 4 on the 2-bit codes and averaged exactly; with
the suffix ``o`` the optimizer gets the rounding's exact variance (a diagnosis), with ``e`` an estimate that takes
each element's own square of the mean out; with ``c`` first (``levels3c``, ``levels4ce``) the ranks' dithers are
stratified per element (correlated rounding: the same bits, a lower variance of the average).

Each run appends one JSON line to <out>/runs.jsonl: model, corpus, method, optimizer, N, G, seed, lr, steps,
the final held-out loss (all held-out windows, up to ``--eval-windows``), its curve (``--evals`` points on 64
windows), bits received per element, seconds.  A run already in runs.jsonl is not run again, so a study can be
stopped and continued.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import statistics
import sys
import time

import torch

OPTIMIZERS = ("terngrad", "torch")
OWNER_STEP = "owner-step-"       # owner-step-nearest / -stochastic / -exact (examples/owner_step.py)
FOUR_LEVEL_SUFFIX = "+4level"    # the product's four-level first stage (TernGradConfig(levels=4), codec/levels.py)
LEVEL_SETS = tuple(f"levels{k}{e}" for k in (3, 4) for e in ("", "o", "e", "c", "ce", "s", "cs"))   # the first stage in 3 or 4 levels
#                                                                           (examples/level_rounding.py)
CURVE_WINDOWS = 64


def corpus_files(name: str) -> tuple[list, str]:
    if name == "vimdoc":
        files = sorted(glob.glob("/usr/share/vim/vim*/doc/*.txt"))
        what = "Vim's help text"
    elif name == "perlpod":
        files = sorted(glob.glob("/usr/share/perl/5*/pod/*.pod") + glob.glob("/usr/share/perl/5*/**/*.pod",
                                                                               recursive=True))
        files = sorted(set(files))
        what = "Perl's documentation"
    elif name == "copyright":
        files = sorted(glob.glob("/usr/share/doc/*/copyright"))
        what = "Debian's copyright files"
    elif name == "stdlib":
        import sysconfig
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        what = "Python's standard library sources"
    else:
        files, what = [name], os.path.basename(name)
    if not files:
        raise SystemExit(f"study_lm_scale: corpus {name!r} has no files on this machine")
    return files, what


def _corpus_bytes(files: list, max_mb: float = 0.0) -> bytes:
    seen, parts = set(), []
    for f in files:                        # each distinct file once (many packages ship the same licence)
        data = open(f, "rb").read()
        digest = hashlib.sha1(data).digest()
        if digest not in seen:
            seen.add(digest)
            parts.append(data)
    data = b"".join(parts)
    return data[:int(max_mb * 1e6)] if max_mb > 0 else data


def load_corpus(name: str, max_mb: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, str]:
    files, what = corpus_files(name)
    data = _corpus_bytes(files, max_mb)
    if len(data) < 20 * 4096:
        raise SystemExit(f"study_lm_scale: corpus {name!r} has {len(data)} bytes; the held-out split (every 20th "
                         f"block of 4 KB) needs at least {20 * 4096}")
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
    """10% linear warm-up, then cosine from lr to 0.1·lr, reached at the last step."""
    warm = max(1, steps // 10)
    if step < warm:
        return lr * (step + 1) / warm
    t = (step - warm) / max(1, steps - 1 - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def held_out_loss(model, held: torch.Tensor, seq_len: int, windows: int = 128) -> float:
    """Mean loss over the first ``windows`` disjoint windows of the held-out bytes (in chunks of 64)."""
    n = min(windows, (len(held) - 1) // seq_len)
    x = held[:n * seq_len].view(n, seq_len).long()
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, 64):
            xb = x[i:i + 64]
            total += float(model(input_ids=xb, labels=xb).loss) * xb.shape[0]
    return total / n


def steps_of(args, train: torch.Tensor) -> int:
    """--steps, or --epochs epochs of the training bytes at the global batch."""
    if args.steps > 0:
        return args.steps
    return max(10, round(args.epochs * len(train) / (args.batch * args.seq_len)))


_DATA: dict = {}


def _data(args):
    key = (args.corpus, args.max_mb)
    if key not in _DATA:
        _DATA[key] = load_corpus(args.corpus, args.max_mb)
    return _DATA[key]


def key_of(row: dict) -> tuple:
    """What makes two runs the same run (resuming skips a task whose key is in runs.jsonl)."""
    return (row["model"], row["corpus"], row.get("max_mb", 0.0), row["method"], row.get("optimizer", "terngrad"),
            row["N"], row["G"], row["seed"], row["lr"], row["steps"], row["batch"])


def run(args, method: str, N: int, G: int, seed: int, lr: float, data=None, optimizer: str | None = None) -> dict:
    from horovod_terngrad import TernGradConfig
    from horovod_terngrad.modelling.simulate import Simulator
    from horovod_terngrad.optim import AdamW
    train, held, _ = data if data is not None else _data(args)
    steps = steps_of(args, train)
    model = make_model(args.model, args.width, args.layers, args.seq_len, seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    optimizer = optimizer or getattr(args, "optimizer", "terngrad")
    opt = (AdamW if optimizer == "terngrad" else torch.optim.AdamW)(groups, lr=lr, betas=(0.9, 0.95))
    from exchange_bits import exchange_spec
    # e.g. reternarized@b128: one scaler per 128 elements; a "+bf16" suffix: intra_node_dtype="bfloat16", a
    # "+fp32" suffix: intra_node_dtype="float32" (without either: the default's bf16)
    spec, inside, levels4 = method, None, method.endswith(FOUR_LEVEL_SUFFIX)
    if levels4:     # e.g. owner-step-nearest@b128+4level: the product's four-level first stage (config.levels = 4)
        spec = method[:-len(FOUR_LEVEL_SUFFIX)]
    for suffix, dtype in (("+bf16", "bfloat16"), ("+fp32", "float32")):
        if spec.endswith(suffix):
            spec, inside = spec[:-len(suffix)], dtype
    exchange, bucket = exchange_spec(spec)
    extra = {} if inside is None else {"intra_node_dtype": inside}
    # the study's labels name the first stage: the ternary code unless "+4level" (TernGradConfig's default is 4)
    extra["levels"] = 4 if levels4 else 3
    owner = exchange.startswith(OWNER_STEP)
    first, _, second = exchange.partition("+")     # levels4c+ef4: a second stage back from the owners
    levels = first in LEVEL_SETS
    if levels:
        # levels3 / levels4: the first stage rounded to 3 or 4 levels, averaged exactly (examples/level_rounding.py)
        from level_rounding import LEVELS, LevelSimulator
        base = first[:len("levels3")]
        sim = LevelSimulator(model, N, TernGradConfig(exchange="allgather", hierarchical=False), LEVELS[base], seed,
                             estimate=first[len(base):], second=second, second_bucket=bucket)
    elif owner:
        # owner-step-<rounding>[@gK][@bK]: the requantized exchange's first stage in base-3 (with @gK one scaler
        # per K gradient elements: OwnerStepOptimizer's TernGradConfig(bucket_size=K)), the owners step their
        # shards and send ternary weight differences (one scaler per K elements of the difference; 0: per shard)
        from owner_step import OwnerStepSimulator
        if G > 1:
            raise SystemExit("study_lm_scale: owner-step runs flat (no --nodes-of)")
        rounding, _, grad_bucket = exchange[len(OWNER_STEP):].partition("@g")
        rounding, _, first = rounding.partition(":")     # owner-step-nearest:levels4c: that first stage instead
        cfg = TernGradConfig(exchange="requantized", packing="base3", hierarchical=False,
                             bucket_size=int(grad_bucket or 0), **extra)
        if first:
            from level_rounding import LEVELS, LevelOwnerStepSimulator
            base = first[:len("levels3")]
            sim = LevelOwnerStepSimulator(model, N, cfg, LEVELS[base], seed, estimate=first[len(base):],
                                          rounding=rounding, delta_bucket=bucket)
        else:
            sim = OwnerStepSimulator(model, N, cfg, rounding=rounding, delta_bucket=bucket)
    else:
        cfg = TernGradConfig(exchange=exchange if method != "none" else "allgather",
                             hierarchical=bool(G > 1), bucket_size=bucket, **extra)
        sim = Simulator(model, N, cfg, compression="none" if method == "none" else "terngrad",
                        ranks_per_node=max(G, 1))
    gen = torch.Generator().manual_seed(seed)
    marks = sorted({round(steps * (k + 1) / args.evals) for k in range(args.evals)}) if args.evals else []
    curve = []

    t0 = time.perf_counter()
    finite = True
    for step in range(steps):
        starts = torch.randint(0, len(train) - args.seq_len, (args.batch,), generator=gen)
        x = torch.stack([train[s:s + args.seq_len] for s in starts.tolist()]).long()
        per = args.batch // N
        grads = []
        params = sim.params
        if owner:
            sim.to_replica()                # forward and backward on every rank's copy of the weights
        for r in range(N):
            xr = x[r * per:(r + 1) * per]
            loss = model(input_ids=xr, labels=xr).loss
            grads.append([g.detach() for g in torch.autograd.grad(loss, params)])
        avg = sim.average(grads)
        if owner:
            sim.to_master()                 # the owners step their shards of the master weights
        for p, g in zip(params, avg):
            p.grad = g.to(p.dtype)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, steps, lr)
        opt.step()
        if owner:
            sim.send_weights()
        if not all(torch.isfinite(p).all() for p in params):
            finite = False
            break
        if step + 1 in marks and step + 1 < steps:
            curve.append([step + 1, held_out_loss(model, held, args.seq_len, CURVE_WINDOWS)])
            print(f"  {method} N={N} lr {lr:g} seed {seed}: step {step + 1}/{steps}, held-out {curve[-1][1]:.4f} "
                  f"(64 windows), {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    loss = held_out_loss(model, held, args.seq_len, args.eval_windows) if finite else float("nan")
    if finite and marks:
        curve.append([steps, held_out_loss(model, held, args.seq_len, CURVE_WINDOWS)])
    extra_fields = {}
    if owner:
        # the held-out loss above is the master's (the owners' shards, gathered once in fp32 at the end); also
        # the replica's, and the bits of each stage
        sim.to_replica()
        grad_bits, delta_bits = sim.bits_received()
        extra_fields = {"held_out_replica": held_out_loss(model, held, args.seq_len, args.eval_windows)
                        if finite else float("nan"),
                        "bits_gradient": grad_bits, "bits_weights": delta_bits, "replica_error_max": sim.error_max}
        sim.to_master()
    return {**extra_fields, "model": args.model, "width": args.width, "layers": args.layers, "corpus": args.corpus,
            "max_mb": args.max_mb, "method": method, "optimizer": optimizer, "N": N, "G": G, "seed": seed,
            "lr": lr, "steps": steps, "batch": args.batch, "seq_len": args.seq_len, "held_out": loss,
            "curve": curve, "exchange": (exchange if owner or levels else sim.engines[0].config.exchange if method != "none" else "none"),
            "seconds": time.perf_counter() - t0,
            # optim.AdamW's noise estimate: its minibatch share taken out by the senders' squares (codec/squares.py)
            "estimate": "squares" if method != "none" and optimizer == "terngrad" else None,
            # rank 0's bits received per ternarized element (node-aware: across nodes only)
            "bits_received": (sum(sim.bits_received()) if owner else
                              8 * sim.stats.bytes_received / max(1, sim.stats.elements) if method != "none" else 32.0)}


def _task(payload):
    args, method, N, G, seed, lr, optimizer = payload
    torch.set_num_threads(1)
    return run(args, method, N, G, seed, lr, optimizer=optimizer)


def label(r: dict) -> str:
    m = "fp32" if r["method"] == "none" else r["method"]
    return m + (" + torch AdamW" if r.get("optimizer", "terngrad") == "torch" and r["method"] != "none" else "")


def _order(r: dict) -> tuple:
    order = {"none": 0, "default": 1, "allgather": 2, "requantized": 3, "reternarized": 4, "sharded": 5}
    return (order.get(r["method"].split("@")[0].split("+")[0], 9), r["method"], r.get("optimizer", "terngrad"))


def table(rows: list) -> str:
    """Per (method, optimizer, topology, N, lr): mean, spread (max - min), worst seed, and the gap of the mean and
    of the worst seed to fp32's mean at the same lr and at fp32's best lr (the lr with the lowest mean)."""
    base = {}
    for r in rows:
        if r["method"] == "none":
            base.setdefault(r["lr"], []).append(r["held_out"])
    best_fp32 = min((statistics.mean(v) for v in base.values()), default=float("nan"))
    cells: dict = {}
    for r in rows:
        cells.setdefault((label(r), r["G"], r["N"], r["lr"]), []).append(r)
    lines = ["| method | topology | N | lr | seeds | bits/element | held-out per seed | mean | spread | worst | "
             "mean vs fp32 (same lr) | worst vs fp32 (same lr) | mean vs fp32's best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (m, G, N, lr), rs in sorted(cells.items(), key=lambda kv: (_order(kv[1][0]), kv[0][1], kv[0][2], kv[0][3])):
        vals = [r["held_out"] for r in sorted(rs, key=lambda r: r["seed"])]
        mean = statistics.mean(vals)
        ref = statistics.mean(base[lr]) if lr in base else float("nan")
        topo = "flat" if G <= 1 else f"nodes of {G}"
        bits = statistics.mean(r["bits_received"] for r in rs)
        lines.append(f"| {m} | {topo} | {N if m != 'fp32' else 'any'} | {lr:g} | {len(vals)} | {bits:.2f} | "
                     f"{' / '.join(f'{v:.4f}' for v in vals)} | {mean:.4f} | {max(vals) - min(vals):.4f} | "
                     f"{max(vals):.4f} | {100 * (mean / ref - 1):+.2f}% | {100 * (max(vals) / ref - 1):+.2f}% | "
                     f"{100 * (mean / best_fp32 - 1):+.2f}% |")
    return "\n".join(lines)


def best_lr_table(rows: list) -> str:
    """Per (method, optimizer, topology, N): the lr with the lowest mean over the seeds every lr ran, whether the
    sweep brackets it (a lower and a higher lr ran), and its mean and worst seed (over all its seeds) against fp32
    at fp32's own best lr."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((label(r), r["G"], r["N"] if r["method"] != "none" else 0), {}).setdefault(
            r["lr"], {})[r["seed"]] = r["held_out"]
    fp32 = [v for (m, _, _), v in cells.items() if m == "fp32"]
    ref = min((statistics.mean(x.values()) for v in fp32 for x in v.values()), default=float("nan"))
    lines = ["| method | topology | N | lrs run | best lr | bracketed | seeds | mean at best | worst at best | "
             "mean vs fp32's best | worst vs fp32's best |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (m, G, N), by_lr in sorted(cells.items(), key=lambda kv: (kv[0][0] != "fp32", kv[0][0], kv[0][1], kv[0][2])):
        if len(by_lr) < 2:
            continue
        # the lrs are compared on the seeds every one of them ran (paired: the same batches and initial weights)
        common = set.intersection(*(set(v) for v in by_lr.values()))
        if not common:
            continue
        lr = min(by_lr, key=lambda k: statistics.mean(by_lr[k][sd] for sd in common))
        lrs = sorted(by_lr)
        bracketed = lrs[0] < lr < lrs[-1]
        vals = list(by_lr[lr].values())
        mean = statistics.mean(vals)
        topo = "flat" if G <= 1 else f"nodes of {G}"
        lines.append(f"| {m} | {topo} | {N or 'any'} | {', '.join(f'{x:g}' for x in lrs)} | {lr:g} | "
                     f"{'yes' if bracketed else 'no (edge)'} | {len(vals)} | {mean:.4f} | {max(vals):.4f} | "
                     f"{100 * (mean / ref - 1):+.2f}% | {100 * (max(vals) / ref - 1):+.2f}% |")
    return "\n".join(lines)


def plot(rows: list, path: str, title: str = "") -> None:
    """Held-out loss along the run (mean over seeds at each evaluation), one panel per (N, topology): fp32 AdamW at
    its best lr (solid black) and at the recipe's (dashed), and every method run with horovod_terngrad.optim.AdamW
    at its own best lr among those run there; a method that leads early and trails late shows as crossing curves."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [r for r in rows if r.get("curve") and math.isfinite(r["held_out"])]
    fp32 = [r for r in done if r["method"] == "none"]
    others = [r for r in done if r["method"] != "none" and r.get("optimizer", "terngrad") == "terngrad"]
    Ns = sorted({(r["N"], r["G"]) for r in others})
    fig, axes = plt.subplots(1, max(1, len(Ns)), figsize=(4.6 * max(1, len(Ns)), 3.8), squeeze=False)

    def mean_curve(rs):
        pts: dict = {}
        for r in rs:
            for s, v in r["curve"]:
                pts.setdefault(s, []).append(v)
        xs = sorted(pts)
        return xs, [statistics.mean(pts[s]) for s in xs]

    def best_lr(rs):
        by: dict = {}
        for r in rs:
            by.setdefault(r["lr"], []).append(r["held_out"])
        return min(by, key=lambda lr: statistics.mean(by[lr])) if by else None

    recipe = 2e-3 if any(r["lr"] == 2e-3 for r in fp32) else (fp32[0]["lr"] if fp32 else None)
    fp32_best = best_lr(fp32)
    for ax, (N, G) in zip(axes[0], Ns):
        for lr, style in ((fp32_best, "-"), (recipe, "--")):
            xs, ys = mean_curve([r for r in fp32 if r["lr"] == lr])
            if xs and not (style == "--" and lr == fp32_best):
                ax.plot(xs, ys, style, color="black", label=f"fp32 AdamW, lr {lr:g}")
        for m in sorted({r["method"] for r in others if r["N"] == N and r["G"] == G}):
            mine = [r for r in others if r["method"] == m and r["N"] == N and r["G"] == G]
            lr = best_lr(mine)
            xs, ys = mean_curve([r for r in mine if r["lr"] == lr])
            ax.plot(xs, ys, label=f"{m}, lr {lr:g}")
        ax.set_title(f"N = {N}" + ("" if G <= 1 else f", nodes of {G}"))
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss (mean of seeds)")
        ax.set_ylim(top=min(ax.get_ylim()[1], 2.6))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    p.add_argument("--corpus", default="vimdoc")
    p.add_argument("--max-mb", type=float, default=0.0, help="keep the corpus's first M MB (0: all of it)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="global batch (windows), split over the workers")
    p.add_argument("--steps", type=int, default=0, help="steps of the schedule (0: --epochs epochs of the corpus)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--evals", type=int, default=8, help="held-out evaluations along the run (the curve)")
    p.add_argument("--eval-windows", type=int, default=512, help="held-out windows of the final loss")
    p.add_argument("--lr", default="2e-3", help="comma-separated: every method at each")
    p.add_argument("--workers", default="8,16,64")
    p.add_argument("--nodes-of", type=int, default=0, help="ranks per node (0 or 1: flat)")
    p.add_argument("--exchanges", default="none,default",
                   help="comma-separated: none (fp32), default, or an exchange, optionally @bK for bucket_size=K "
                        "(one scaler per K elements; e.g. reternarized@b128), and a +bf16 or +fp32 suffix for "
                        "intra_node_dtype (with --nodes-of; without: the default's bf16); a /torch suffix: "
                        "torch.optim.AdamW for that method (/terngrad: horovod_terngrad.optim.AdamW); "
                        "owner-step-nearest or owner-step-stochastic[@bK]: the owners step their shards and send "
                        "ternary weight differences (examples/owner_step.py); levels3 or levels4[o|e|c|ce]: the "
                        "first stage rounded to 3 or 4 levels (c: correlated; examples/level_rounding.py)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="terngrad",
                   help="terngrad: horovod_terngrad.optim.AdamW (the Adam recipe); torch: torch.optim.AdamW")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (one process and one thread each)")
    p.add_argument("--out", default=None)
    p.add_argument("--table", default=None, metavar="DIR[,DIR...]",
                   help="print the tables of the runs in DIR/runs.jsonl (several: together) and exit")
    p.add_argument("--write", default=None, metavar="FILE", help="with --table: also write them to FILE")
    p.add_argument("--plot", default=None, metavar="PNG", help="with --table: the held-out curves to PNG")
    p.add_argument("--write-corpus", default=None, metavar="FILE",
                   help="write the corpus's bytes (distinct files, --max-mb) to FILE and exit: the same data for "
                        "examples/transformers_lm.py --corpus FILE, which holds out the same blocks")
    args = p.parse_args(argv)
    if args.write_corpus:
        train, held, what = _data(args)
        files, _ = corpus_files(args.corpus)
        data = _corpus_bytes(files, args.max_mb)
        with open(args.write_corpus, "wb") as f:
            f.write(data)
        print(f"{args.write_corpus}: {what}; {len(train)} training bytes: one epoch is "
              f"{steps_of(args, train)} steps of {args.batch} x {args.seq_len}")
        return []
    if args.table:
        rows = [json.loads(line) for d in args.table.split(",") for line in open(os.path.join(d, "runs.jsonl"))]
        text = table(rows) + "\n\n" + best_lr_table(rows)
        print(text)
        if args.write:
            with open(args.write, "w") as f:
                f.write(text + "\n")
        if args.plot:
            plot(rows, args.plot)
        return rows
    torch.set_num_threads(1)
    train, held, what = _data(args)
    print(f"# {args.model} {args.layers}x{args.width} on {what}; global batch {args.batch} x {args.seq_len}, "
          f"{steps_of(args, train)} steps", flush=True)
    done = set()
    path = os.path.join(args.out, "runs.jsonl") if args.out else None
    if path and os.path.exists(path):
        done = {key_of(json.loads(line)) for line in open(path)}
    tasks = []
    for lr in (float(x) for x in args.lr.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            for spec in args.exchanges.split(","):
                method, _, optimizer = spec.partition("/")
                optimizer = optimizer or args.optimizer
                if optimizer not in OPTIMIZERS:
                    raise SystemExit(f"study_lm_scale: {spec!r}: the optimizer after '/' is one of {OPTIMIZERS}")
                for i, N in enumerate(int(n) for n in args.workers.split(",")):
                    if method == "none" and i > 0:
                        continue
                    G = args.nodes_of if method != "none" else 0
                    probe = {"model": args.model, "corpus": args.corpus, "max_mb": args.max_mb, "method": method,
                             "optimizer": optimizer, "N": N, "G": G, "seed": seed, "lr": lr,
                             "steps": steps_of(args, train), "batch": args.batch}
                    if key_of(probe) not in done:
                        tasks.append((args, method, N, G, seed, lr, optimizer))
    rows = []

    def keep(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        if path:
            os.makedirs(args.out, exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    if args.jobs > 1 and len(tasks) > 1:
        import multiprocessing
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        with multiprocessing.get_context("fork").Pool(args.jobs, maxtasksperchild=1) as pool:
            for row in pool.imap_unordered(_task, tasks):
                keep(row)
    else:
        for t in tasks:
            keep(run(*t[:-1], optimizer=t[-1]))
    if rows:
        print(table(rows))
    return rows


if __name__ == "__main__":
    main()
