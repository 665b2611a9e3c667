"""Where horovod_terngrad.optim.AdamW's corrected second moment sits, per exchange: after K steps of
study_lm_scale's workload (the simulator, N ranks), the share of ternarized elements whose v - n is at or under
the floor (v_hat = v_floor·v: steps up to sqrt(1/v_floor) = 3.2x longer than plain v), the median of
(v - n) / v, and the median step length against fp32 AdamW's, sqrt(v32 / v_hat), with v32 the running mean of
the squared fp32 average of the same workers' gradients (clipped alike) kept beside the run: 1.0 is fp32's
schedule, above 1 longer steps.  An estimate n that tracks the ternary rounding's variance leaves v - n near
v32; one that equals the received value's own square (the re-ternarized exchange: s'^2·|t'| = (s'·t')^2) pins
v - n at 0.  torch's AdamW (no estimate) would step sqrt(v32 / v).

    python examples/study_adam_floor.py --workers 16 --steps 100 --exchanges allgather,requantized,reternarized@b128
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import study_lm_scale as sls
from horovod_terngrad.modelling.simulate import Simulator
from horovod_terngrad.optim import adam


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama")
    p.add_argument("--corpus", default="perlpod")
    p.add_argument("--max-mb", type=float, default=0.0, help="keep the corpus's first M MB (0: all of it)")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--exchanges", default="allgather,requantized,reternarized@b128")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", default=None, help="append each result as a JSON line to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ns = argparse.Namespace(model=args.model, corpus=args.corpus, max_mb=args.max_mb, width=args.width, layers=args.layers,
                            seq_len=args.seq_len, batch=args.batch, steps=args.steps, epochs=1.0, evals=0,
                            eval_windows=64, optimizer="terngrad")
    data = sls.load_corpus(args.corpus, args.max_mb)
    out = []
    for method in args.exchanges.split(","):
        captured = {}

        def seen(opt, args, kwargs):     # the run's optimizer, after each of its steps (a global step hook)
            captured["opt"] = opt
        average = Simulator.average
        v32: dict = {}

        def shadow(sim, grads):          # fp32 AdamW's second moment on the same gradients, beside the run
            means = [torch.stack([g[i] for g in grads]).mean(0) for i in range(len(grads[0]))]
            norm = torch.sqrt(sum((m * m).sum() for m in means))
            scale = min(1.0, 1.0 / (float(norm) + 1e-6))
            for q, m in zip(sim.params, means):
                v = v32.setdefault(q, torch.zeros_like(m))
                v.mul_(0.95).addcmul_(m * scale, m * scale, value=0.05)
            return average(sim, grads)
        hook = register_optimizer_step_post_hook(seen)
        Simulator.average = shadow
        try:
            row = sls.run(ns, method, args.workers, 0, args.seed, args.lr, data)
        finally:
            hook.remove()
            Simulator.average = average
        opt = captured["opt"]
        at_floor, total, ratios, longer, plain = 0, 0, [], [], []
        for grp in opt.param_groups:
            f = float(grp["v_floor"])
            for q in grp["params"]:
                st = opt.state[q]
                if adam.NOISE not in st:
                    continue
                v, n = st["exp_avg_sq"], st[adam.NOISE]
                r = ((v - n) / v.clamp_min(1e-30)).flatten()
                at_floor += int((r <= f).sum())
                total += r.numel()
                ratios.append(r)
                v_hat = torch.maximum(v - n, f * v)
                longer.append(torch.sqrt(v32[q] / v_hat.clamp_min(1e-30)).flatten())
                plain.append(torch.sqrt(v32[q] / v.clamp_min(1e-30)).flatten())
        med = float(torch.cat(ratios).median()) if ratios else float("nan")
        res = {"method": method, "model": f"{args.model} {args.layers}x{args.width}", "corpus": args.corpus,
               "max_mb": args.max_mb, "N": args.workers, "steps": args.steps, "lr": args.lr, "seed": args.seed,
               "ternarized_elements": total, "share_at_floor": at_floor / max(1, total),
               "median_v_minus_n_over_v": med,
               "median_step_vs_fp32_adamw": float(torch.cat(longer).median()),
               "median_step_vs_fp32_adamw_torch_adamw": float(torch.cat(plain).median()),
               "held_out": row["held_out"]}
        print(json.dumps(res), flush=True)
        out.append(res)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(res) + "\n")
    return out


if __name__ == "__main__":
    main()
