"""Table 1-style study: CifarNet, fp32 vs TernGrad, N simulated workers with a fixed batch per worker.

    python examples/study_cifarnet.py --workers 2,4,8 --epochs 4 --out docs/study [--cifar10 PATH]

Paper Table 1 setup: Adam, base lr 0.0002, batch per worker fixed (64 here) so the total batch grows with
N, all runs the same number of epochs.  Workers are simulated (horovod_terngrad.modelling.simulate: the exact
codec and averaging of a real run).  Without --cifar10 it trains on Fashion-MNIST, a SUBSTITUTE, and the
outputs say so.  Writes <out>/cifarnet_study.{json,md}.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cifarnet import SUBSTITUTE, CifarNet, ParameterEMA, augment, evaluate  # noqa: E402

from horovod_terngrad import TernGradConfig  # noqa: E402
from horovod_terngrad.modelling.simulate import Simulator, batch_indices  # noqa: E402

PAPER_LR = 2e-4          # Adam's base learning rate in the paper's Table 1


def train(data, n_workers: int, compression: str, epochs: float, seed: int, per_worker: int = 64,
          lr: float = PAPER_LR, test_limit: int = 0, ema_decay: float = 0.9999, eval_every: float = 0,
          on_eval=None, exclude: tuple = (), bucket_size: int = 0, device: str = "cpu",
          checkpoint: str = "", on_resume=None, dataset: str = "") -> dict:
    """One run.  With ``eval_every`` (epochs) the test accuracy (raw and EMA) is also taken along the
    way and passed to ``on_eval(point)``, so a long run leaves a learning curve even if cut short.
    ``exclude`` / ``bucket_size`` go to TernGradConfig (the paper's remedies: fp32 last layer, buckets).

    ``checkpoint``: a file that the run saves itself to at every evaluation and at the end, and resumes from
    when it exists (model, Adam, EMA, the data generator and the simulator's step counters: the resumed run
    takes the same steps as an uninterrupted one on the same device and thread count; on a GPU, cuDNN's
    nondeterministic kernels make no two runs bitwise equal anyway).  A later call with more ``epochs``
    extends the run.  A checkpoint of another run (any setting below, dataset included) is refused.
    ``on_resume(curve)`` gets the curve restored from the checkpoint ([] for a fresh run) once it is accepted.
    ``device``: where the model, gradients and codec run (the data stays on the CPU and is augmented there)."""
    run = {"workers": n_workers, "compression": compression, "exclude": list(exclude), "bucket_size": bucket_size,
           "lr": lr, "seed": seed, "per_worker": per_worker, "ema_decay": ema_decay, "test_limit": test_limit,
           "eval_every": eval_every, "dataset": dataset, "device_type": torch.device(device).type}
    torch.manual_seed(seed)
    xtr, ytr = data["train"]
    model = CifarNet(in_channels=xtr.shape[1]).to(device)
    opt = model.adam(lr)
    # the paper's settings, with which docs/study was measured: every tensor ternarized (unless excluded),
    # one shared scaler (the library's defaults keep small tensors in fp32 and use per-rank scalers)
    config = TernGradConfig(seed=seed, exclude=tuple(exclude), bucket_size=bucket_size, min_numel=0, shared_scaler=True)
    sim = Simulator(model, n_workers, config, compression=compression)
    batch = per_worker * n_workers
    steps = int(epochs * len(xtr) // batch)
    g = torch.Generator().manual_seed(seed)
    ema = ParameterEMA(model, ema_decay)
    xte, yte = data["test"]
    if test_limit:
        xte, yte = xte[:test_limit], yte[:test_limit]
    every = int(eval_every * len(xtr) // batch) if eval_every else 0
    start, curve, seconds_before = 0, [], 0.0
    if checkpoint and os.path.exists(checkpoint):
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        if state["run"] != run:
            raise ValueError(f"checkpoint {checkpoint} is of another run: {state['run']}; this run: {run}")
        if state["iterations"] > steps:
            raise ValueError(f"checkpoint {checkpoint} is at iteration {state['iterations']}, past the "
                             f"{steps} iterations of {epochs:g} epochs")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        ema.load_state_dict(state["ema"])
        sim.load_state_dict(state["simulator"])
        g.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])                 # dropout draws from the global generator
        if "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        start, curve, seconds_before = state["iterations"], state["curve"], state["seconds"]
    if on_resume:
        on_resume(list(curve))

    def save(iterations, seconds):
        if not checkpoint:
            return
        state = {"run": run, "iterations": iterations, "seconds": seconds, "curve": curve,
                 "model": model.state_dict(), "optimizer": opt.state_dict(), "ema": ema.state_dict(),
                 "simulator": sim.state_dict(), "generator": g.get_state(), "torch_rng": torch.get_rng_state()}
        if torch.device(device).type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(device)
        os.makedirs(os.path.dirname(os.path.abspath(checkpoint)), exist_ok=True)
        torch.save(state, checkpoint + ".tmp")
        os.replace(checkpoint + ".tmp", checkpoint)      # a run killed while saving keeps the last good one

    def evaluation(iterations):
        return {"iterations": iterations, "epochs": iterations * batch / len(xtr), "test_acc": evaluate(model, xte, yte),
                "test_acc_ema": ema.evaluate_with(model, lambda m: evaluate(m, xte, yte)),
                "seconds": time.perf_counter() - t0}

    def add_point(point):
        curve.append(point)
        save(point["iterations"], point["seconds"])
        if on_eval:
            on_eval(point)

    t0 = time.perf_counter() - seconds_before
    for it in range(start, steps):
        idx = batch_indices(seed, it, len(xtr), batch)
        sim.step(augment(xtr[idx], g).to(device), ytr[idx].to(device), F.cross_entropy, opt)
        ema.update(model)
        if every and (it + 1) % every == 0:
            add_point(evaluation(it + 1))
    if curve and curve[-1]["iterations"] == steps:       # the last evaluation was at the last step
        final = curve[-1]
    else:
        final = evaluation(steps)
        if every:                                        # off the grid: the curve still ends where the run does
            add_point(final)
    result = {"workers": n_workers, "compression": compression, "exclude": list(exclude), "bucket_size": bucket_size,
              "lr": lr, "total_batch": batch, "iterations": steps, "epochs": epochs, "test_acc": final["test_acc"],
              "test_acc_ema": final["test_acc_ema"], "ema_decay": ema_decay, "seconds": time.perf_counter() - t0,
              "curve": curve}
    save(steps, result["seconds"])
    return result


def gap_cells(b: dict, t: dict, gap_unit: str = "") -> str:
    """Table cells 'fp32 | TernGrad | gap | fp32 (EMA) | TernGrad (EMA) | gap (EMA)' of one comparison."""
    cells = []
    for key in ("test_acc", "test_acc_ema"):
        cells += [f"{100 * b[key]:.2f}%", f"{100 * t[key]:.2f}%", f"{100 * (t[key] - b[key]):+.2f}{gap_unit}"]
    return " | ".join(cells)


def variant_note(rows: list) -> str:
    """' TernGrad variant: ...' when the TernGrad rows ran with exclude/bucket_size, else ''."""
    names = {variant_name(tuple(r.get("exclude", ())), r.get("bucket_size", 0)) for r in rows if r["compression"] == "terngrad"}
    names.discard("")
    return f" TernGrad variant: {', '.join(sorted(names))}." if names else ""


def write_outputs(rows: list, out: str, epochs: float) -> None:
    """<out>/cifarnet_study.{json,md} from result rows (also used to merge runs made per N)."""
    dataset = rows[0]["dataset"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "cifarnet_study.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lrs = sorted({r.get("lr", PAPER_LR) for r in rows})
    lines = [f"CifarNet, Adam lr {', '.join(f'{lr:g}' for lr in lrs)}, batch 64 per worker, {epochs:g} epochs, "
             f"data: **{dataset}**. "
             "Accuracy of the final parameters, and (as the paper evaluates) of their exponential moving "
             "average (decay 0.9999, TensorFlow's warm-up)." + variant_note(rows), "",
             "| workers N | total batch | iterations | fp32 | TernGrad | gap | fp32 (EMA) | TernGrad (EMA) | gap (EMA) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({r["workers"] for r in rows}):
        b = next(r for r in rows if r["workers"] == n and r["compression"] == "none")
        t = next(r for r in rows if r["workers"] == n and r["compression"] == "terngrad")
        lines.append(f"| {n} | {b['total_batch']} | {b['iterations']} | {gap_cells(b, t, '%')} |")
    with open(os.path.join(out, "cifarnet_study.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def variant_name(exclude=(), bucket_size: int = 0, lr: float = PAPER_LR) -> str:
    """A short label for a run's variant ('' = the paper's setup: Adam lr 0.0002 and, for TernGrad, every
    layer with one scaler each)."""
    parts = [f"exclude={'|'.join(exclude)}"] if exclude else []
    if bucket_size:
        parts.append(f"bucket={bucket_size}")
    if lr != PAPER_LR:
        parts.append(f"lr={lr:g}")
    return ",".join(parts)


def variant_tag(variant: str) -> str:
    """The variant as a file-name suffix ('' for the default)."""
    tag = re.sub(r"[^A-Za-z0-9.]+", "-", variant).strip("-")
    return "_" + tag if tag else ""


def curve_filename(n: int, comp: str, variant: str = "") -> str:
    return f"cifarnet_curve_{n}_{comp}{variant_tag(variant)}.jsonl"


def curve_path(out: str, n: int, comp: str, variant: str = "") -> str:
    """Where a run's curve goes: curve_filename, or, if that file holds another variant whose tag reads the
    same (e.g. '^logits' and 'logits$'), that name with a hash of the variant, so neither overwrites the other."""
    path = os.path.join(out, curve_filename(n, comp, variant))
    if os.path.exists(path):
        with open(path) as f:
            first = f.readline()
        if first.strip() and json.loads(first).get("variant", "") != variant:
            digest = hashlib.sha1(variant.encode()).hexdigest()[:8]
            path = path[:-len(".jsonl")] + f"-{digest}.jsonl"
    return path


def curve_lr(points: list) -> float:
    """The Adam learning rate of a curve (curves written before --lr existed ran at the paper's)."""
    return float(points[0].get("lr", PAPER_LR))


def epoch_label(epochs: float) -> str:
    """'26' for 25.96 epochs (evaluations every epoch land a few steps short of it), '2.50' off the grid."""
    return f"{epochs:.0f}" if abs(epochs - round(epochs)) < 0.05 else f"{epochs:.2f}"


def gap_table(base: list, tern: list, last: int = 5) -> list:
    """Markdown rows of one TernGrad curve against one fp32 curve at the evaluations both have (matched by
    iteration), then the mean gap (raw and EMA) over the last ``last`` of them: one evaluation's gap moves
    by a few tenths from epoch to epoch."""
    lines = ["| epoch | fp32 | TernGrad | gap | fp32 (EMA) | TernGrad (EMA) | gap (EMA) |",
             "|---|---|---|---|---|---|---|"]
    at = {p["iterations"]: p for p in base}
    pairs = [(at[t["iterations"]], t) for t in tern if t["iterations"] in at]
    lines += [f"| {epoch_label(b['epochs'])} | {gap_cells(b, t)} |" for b, t in pairs]
    tail = pairs[-last:]
    if tail:
        raw = sum(t["test_acc"] - b["test_acc"] for b, t in tail) / len(tail)
        ema = sum(t["test_acc_ema"] - b["test_acc_ema"] for b, t in tail) / len(tail)
        lines += ["", f"Mean gap over the last {len(tail)} evaluations (epochs {epoch_label(tail[0][0]['epochs'])}-"
                      f"{epoch_label(tail[-1][0]['epochs'])}): {100 * raw:+.2f} (raw), {100 * ema:+.2f} (EMA)."]
    return lines


def write_curves(out: str) -> str:
    """<out>/cifarnet_curve.{md,png} from the learning curves (<out>/cifarnet_curve_<N>_<comp>[_<variant>].jsonl)
    that runs with --eval-every leave: test accuracy per epoch of fp32 and of each TernGrad variant, and
    their gap.  A TernGrad run at another learning rate than the paper's is compared with the fp32 run at
    the same rate and with the fp32 run at the paper's (the fair baseline is the better fp32)."""
    import glob

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves = {}
    for path in sorted(glob.glob(os.path.join(out, "cifarnet_curve_*_*.jsonl"))):
        with open(path) as f:
            points = [json.loads(line) for line in f if line.strip()]
        if points:
            curves[(points[0]["workers"], points[0]["compression"], points[0].get("variant", ""))] = points
    if not curves:
        raise FileNotFoundError(f"no learning curves (cifarnet_curve_*_*.jsonl) under {out}")
    dataset = next(iter(curves.values()))[0]["dataset"]
    lines = [f"CifarNet learning curves, Adam (lr 0.0002 unless the variant says otherwise), batch 64 per worker, "
             f"data: **{dataset}**. Test accuracy after each epoch (raw parameters / their moving average).", ""]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = itertools.cycle(["--", ":", "-.", (0, (5, 1)), (0, (1, 3))])
    for n in sorted({w for w, _, _ in curves}):
        bases = {curve_lr(pts): pts for (w, c, _), pts in curves.items() if w == n and c == "none"}
        for lr, base in sorted(bases.items()):
            ax.plot([p["epochs"] for p in base], [100 * p["test_acc_ema"] for p in base], "-",
                    label=f"N={n} fp32{'' if lr == PAPER_LR else f' (lr={lr:g})'} (EMA)")
        for variant in sorted(v for w, c, v in curves if w == n and c == "terngrad"):
            tern = curves[(n, "terngrad", variant)]
            name = f"TernGrad{' (' + variant + ')' if variant else ''}"
            ax.plot([p["epochs"] for p in tern], [100 * p["test_acc_ema"] for p in tern], linestyle=next(styles),
                    label=f"N={n} {name} (EMA)")
            lr = curve_lr(tern)
            for base_lr in dict.fromkeys([lr, PAPER_LR]):
                if base_lr in bases:
                    against = "" if base_lr == PAPER_LR and lr == PAPER_LR else f", against fp32 at lr {base_lr:g}"
                    lines += [f"N = {n}, {name}{against}:", ""] + gap_table(bases[base_lr], tern) + [""]
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"CifarNet, fp32 vs TernGrad ({dataset})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    png = os.path.join(out, "cifarnet_curve.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    with open(os.path.join(out, "cifarnet_curve.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return png


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2,4,8")
    p.add_argument("--epochs", type=float, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cifar10", default="")
    p.add_argument("--test-limit", type=int, default=0)
    p.add_argument("--out", default="docs/study")
    p.add_argument("--compressions", default="none,terngrad",
                   help="run only some of them (e.g. one per process, side by side); the table needs both")
    p.add_argument("--eval-every", type=float, default=0,
                   help="also evaluate every this many epochs; the curve goes to <out>/cifarnet_curve_<N>_<comp>.jsonl")
    p.add_argument("--exclude", action="append", default=[],
                   help="a regular expression (repeatable): TernGrad leaves matching layers in fp32 "
                        "(the paper's remedy for the last classification layer: --exclude '^logits')")
    p.add_argument("--bucket-size", type=int, default=0,
                   help="TernGrad scaler per this many elements (0: one per layer, the paper's default)")
    p.add_argument("--lr", type=float, default=PAPER_LR,
                   help="Adam learning rate (paper: 0.0002); a run with another one carries 'lr=...' in its variant")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ... (model, gradients and codec)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: two runs side by side on 2 cores)")
    p.add_argument("--checkpoint-dir", default="",
                   help="save each run there at every evaluation and at the end, and resume from it: rerun the "
                        "same command after an interruption, or with more --epochs to extend a run")
    p.add_argument("--plot-curves", action="store_true",
                   help="only write <out>/cifarnet_curve.{md,png} from the curves already under <out>")
    args = p.parse_args(argv)
    if args.plot_curves:
        print(write_curves(args.out))
        return
    torch.set_num_threads(args.threads)
    from horovod_terngrad.operations.datasets import load_cifar10, load_fashion_mnist
    data = load_cifar10(args.cifar10) if args.cifar10 else load_fashion_mnist()
    dataset = "CIFAR-10" if args.cifar10 else SUBSTITUTE
    exclude = tuple(e for e in args.exclude if e)
    rows = []
    for n in (int(v) for v in args.workers.split(",")):
        for comp in args.compressions.split(","):
            variant = (variant_name(exclude, args.bucket_size, args.lr) if comp == "terngrad"
                       else variant_name(lr=args.lr))
            path = curve_path(args.out, n, comp, variant)
            # named as the curve file (hash suffix included), so variants never share a checkpoint
            ckpt = (os.path.join(args.checkpoint_dir, os.path.basename(path)[:-len(".jsonl")] + ".pt")
                    if args.checkpoint_dir else "")

            def curve_line(point, n=n, comp=comp, variant=variant):
                return json.dumps(dict(point, workers=n, compression=comp, variant=variant, lr=args.lr,
                                       dataset=dataset)) + "\n"

            def log_point(point, path=path, n=n, comp=comp, curve_line=curve_line):
                with open(path, "a") as f:
                    f.write(curve_line(point))
                print(f"[{dataset}] N={n} {comp} epoch {point['epochs']:.2f}: {100 * point['test_acc']:.2f}% "
                      f"(EMA {100 * point['test_acc_ema']:.2f}%)", flush=True)

            def restart_curve(restored, path=path, curve_line=curve_line):
                # the curve file starts as the accepted checkpoint's curve (empty for a fresh run): points a
                # killed run logged after its last checkpoint are taken again, not twice
                os.makedirs(args.out, exist_ok=True)
                with open(path, "w") as f:
                    f.writelines(curve_line(point) for point in restored)
            r = train(data, n, comp, args.epochs, args.seed, test_limit=args.test_limit,
                      eval_every=args.eval_every, on_eval=log_point if args.eval_every else None,
                      exclude=exclude, bucket_size=args.bucket_size, lr=args.lr, device=args.device,
                      checkpoint=ckpt, on_resume=restart_curve if args.eval_every else None, dataset=dataset)
            r["dataset"] = dataset
            rows.append(r)
            print(f"[{dataset}] N={n} {comp}{' (' + variant + ')' if variant else ''}: {100 * r['test_acc']:.2f}% (EMA {100 * r['test_acc_ema']:.2f}%, "
                  f"{r['iterations']} iterations, "
                  f"{r['seconds']:.0f}s)", flush=True)
    if {r["compression"] for r in rows} >= {"none", "terngrad"}:
        write_outputs(rows, args.out, args.epochs)
    else:
        run_variant = (variant_name(exclude, args.bucket_size, args.lr) if "terngrad" in args.compressions.split(",")
                       else variant_name(lr=args.lr))
        name = f"cifarnet_rows_{args.compressions.replace(',', '_')}{variant_tag(run_variant)}"
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
