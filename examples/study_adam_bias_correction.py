"""Does subtracting the ternary variance from Adam's second moment (DP-AdamBC's idea) fix TernGrad + AdamW?

    python examples/study_adam_bias_correction.py --seed 0 --floor 0.1 --json docs/adam/runs/bc-floor0.1.s0.json

The allgather exchange hands every rank every rank's ternary vector t_r and scaler s_r, so each rank can form,
per element and at no extra bytes, nu = (1/N^2) sum_r (s_r t_r)^2 = (1/N^2) sum_r s_r^2 |t_r|, an unbiased
estimate of (1/N^2) sum_r s_r |g_r|.  The ternary noise's variance is (1/N^2) sum_r (s_r |g_r| - g_r^2): nu
over-estimates it by (1/N^2) sum_r g_r^2, the minibatch's own share of Adam's second moment, which one ternary
draw per rank cannot separate (an unbiased estimate of g_r^2 from one Bernoulli draw does not exist).  So
v - nu keeps the signal's square and loses most of the minibatch noise: with a floor it trains, with longer
steps than fp32's; this study measures by how much it misses fp32 AdamW.

The run is examples/transformers_lm.py's DDP run with --recipe nanogpt, replayed in one process: the same model,
initial weights, per-rank data streams (two ranks), learning-rate schedule and clip; each rank's gradient
ternarized by the reference codec with the same stream keys as the DDP hook (per-rank scalers, clip 2.5 sigma,
tensors under min_numel exact), averaged, then AdamW with v_hat = max(v - nu_ema, floor * v) (bias-corrected
EMAs, nu_ema with the same beta2).  Writes the held-out loss as transformers_lm does.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transformers_lm as lm  # noqa: E402

from horovod_terngrad import TernGradConfig  # noqa: E402
from horovod_terngrad.codec import rng  # noqa: E402
from horovod_terngrad.codec.ternary import expand_scalers, prepare, ternarize  # noqa: E402


def ternary_average(grads, names, step, cfg: TernGradConfig):
    """(average, nu) per tensor: the ternary average of the ranks' gradients and (1/N^2) sum_r (s_r t_r)^2;
    tensors the policy keeps exact: the fp32 average and nu = 0."""
    n = len(grads)
    out = []
    for i, name in enumerate(names):
        per_rank = [g[i] for g in grads]
        if not cfg.compresses(name, per_rank[0].numel()):
            out.append((sum(per_rank) / n, None))
            continue
        avg = torch.zeros(per_rank[0].numel())
        nu = torch.zeros_like(avg)
        for r, g in enumerate(per_rank):
            flat = g.reshape(-1).float().contiguous()
            prep = prepare(flat, cfg.bucket_size, cfg.clip_factor)
            t = ternarize(flat, prep.threshold, prep.scalers, cfg.bucket_size,
                          rng.stream_key(cfg.seed, step, rng.tensor_id(name), r)).float()
            x = t * expand_scalers(prep.scalers, cfg.bucket_size, flat.numel())
            avg += x
            nu += x * x
        out.append(((avg / n).view_as(per_rank[0]), (nu / n ** 2).view_as(per_rank[0])))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--floor", type=float, default=0.1, help="v_hat >= floor * v (0: only > 0)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    args = lm.parse_args(["--recipe", "nanogpt", "--n-layer", str(a.n_layer), "--steps", str(a.steps),
                          "--seed", str(a.seed), "--lr", str(a.lr)])
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train, held_out, _ = lm.load_corpus(None)
    model = lm.make_model(args)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    decay = {id(q) for q in params if q.dim() >= 2}
    cfg = TernGradConfig(seed=args.seed)
    gens = [torch.Generator().manual_seed(1000 + args.seed + r) for r in range(a.ranks)]
    beta1, beta2, eps = 0.9, args.beta2, 1e-8
    m = [torch.zeros_like(q) for q in params]
    v = [torch.zeros_like(q) for q in params]
    nu_ema = [torch.zeros_like(q) for q in params]
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        lr = lm.lr_at(args, step)
        grads = []
        for r in range(a.ranks):
            x = lm.windows(train, args.batch_size, args.seq_len, gens[r])
            model.zero_grad()
            model(input_ids=x, labels=x).loss.backward()
            grads.append([q.grad.detach().clone() for q in params])
        averaged = ternary_average(grads, names, step - 1, cfg)
        for q, (g, _) in zip(params, averaged):
            q.grad = g
        total = float(torch.nn.utils.clip_grad_norm_(params, args.clip_grad))
        scale = min(1.0, args.clip_grad / (total + 1e-6))        # the clip scales every gradient alike
        with torch.no_grad():
            for i, (q, (_, nu)) in enumerate(zip(params, averaged)):
                g = q.grad
                m[i].lerp_(g, 1 - beta1)
                v[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                if nu is not None:
                    nu_ema[i].mul_(beta2).add_(nu * scale ** 2, alpha=1 - beta2)
                if id(q) in decay:
                    q.mul_(1 - lr * args.weight_decay)
                b1, b2 = 1 - beta1 ** step, 1 - beta2 ** step
                vhat = v[i] / b2
                if nu is not None:
                    vhat = torch.maximum(vhat - nu_ema[i] / b2, a.floor * vhat)
                q.addcdiv_(m[i] / b1, vhat.sqrt().add_(eps), value=-lr)
        if step % 100 == 0:
            print(f"step {step}: loss {float(model(input_ids=x, labels=x).loss):.3f}  "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    held = lm.held_out_loss(model, held_out, args.seq_len)
    from horovod_terngrad.codec.sizes import payload_size
    sent = sum(8 * payload_size(q.numel(), cfg.packing, cfg.bucket_size) if cfg.compresses(n, q.numel())
               else 32 * q.numel() for n, q in zip(names, params))
    result = {"study": "adam_bias_correction", "seed": args.seed, "steps": args.steps, "floor": a.floor, "lr": a.lr,
              "ranks": a.ranks, "held_out_loss": held,
              "bits_per_element_overall": sent / sum(q.numel() for q in params)}
    print(f"held-out loss {held:.4f}")
    print("result: " + json.dumps(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
