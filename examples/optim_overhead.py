"""What horovod_terngrad.optim.AdamW's step costs beside torch.optim.AdamW's, on GPT-2 shapes, against one rank's
compute alone (forward + backward of its batch): the step of the calibrated-regime benchmarks is at least that.

    OMP_NUM_THREADS=1 python examples/optim_overhead.py --json docs/adam/optim_overhead.json

Models (transformers GPT2LMHeadModel built from a config): the HSDP benchmark's GPT-2 4 x 256 (byte vocabulary,
context 64, examples/fsdp_benchmark.py) and the DDP benchmark's GPT-2 6 x 512 (vocabulary 16384).  For
each, in ``--rounds`` interleaved rounds (so a slow spell of the machine lands on all of them), the median over
``--steps`` steps of:

  compute     forward + backward of ``--batch`` sequences of 64 tokens (one rank's batch)
  torch       torch.optim.AdamW(foreach).step()
  tg          horovod_terngrad.optim.AdamW.step() (default mode) on a ternary step, noise estimate attached
  noise       the exchange's noise estimate for every tensor from 2 ranks' payloads
              (exchange/allgather.noise_estimate: about one more decode)
  tg-refresh-mode  the refresh mode's ternary step (m only) and refresh step (m and v), mixed as a 1000-step run
              of RefreshSchedule(warmup=8, interval=4, per_phase=4, max_interval=128)

The ledger's records are set as the exchange would set them (exchange/precision.py), so no exchange runs here.
overhead = (tg + noise - torch) / compute for the default; (mix - torch) / compute for the refresh mode.

The step alone against torch's foreach and fused AdamW, on a model's parameter shapes (no model built, any device;
operations/optim_speed.py says what each column times):

    OMP_NUM_THREADS=1 python examples/optim_overhead.py --shapes gpt2-124m --device cpu
    python examples/optim_overhead.py --shapes gpt2-124m --device cuda --steps 20 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from horovod_terngrad import codec
from horovod_terngrad.codec.schedule import RefreshSchedule
from horovod_terngrad.exchange.allgather import noise_estimate
from horovod_terngrad.exchange import precision
from horovod_terngrad.optim import AdamW

MODELS = {"gpt2-4x256": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=256),
          "gpt2-6x512-v16384": dict(n_layer=6, n_embd=512, n_head=8, vocab_size=16384)}


def build(spec):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **spec)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg)


def timed(fn, steps):
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(name, spec, batch, steps, rounds):
    model = build(spec)
    params = [p for p in model.parameters()]
    x = torch.randint(0, spec["vocab_size"], (batch, 64))

    def compute():
        model.zero_grad(set_to_none=False)
        model(input_ids=x, labels=x).loss.backward()

    compute()
    grads = [p.grad.detach().clone() for p in params]
    shadow = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for s, g in zip(shadow, grads):
        s.grad = g.clone()
    torch_opt = torch.optim.AdamW(shadow, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    def tg_setup(refresh):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for s, g in zip(ps, grads):
            s.grad = g.clone()
        return ps, AdamW(ps, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95), refresh=refresh)

    tg_params, tg_opt = tg_setup(None)
    rf_params, rf_opt = tg_setup(RefreshSchedule(warmup=8, interval=4, per_phase=4, max_interval=128))
    noises = [torch.rand_like(g) * g.abs().mean() for g in grads]

    def tg_step():
        for p, nz in zip(tg_params, noises):       # what every frontend hands over with a ternary average
            tg_opt.precision_ledger.set_record(p, precision.TERNARY)
            tg_opt.precision_ledger.put_noise(p, nz, p.grad)
        tg_opt.step()

    def rf_step(kind):
        def run():
            for p in rf_params:
                rf_opt.precision_ledger.set_record(p, kind)
            rf_opt.step()
        return run

    # two ranks' payloads of every tensor, for the exchange-side estimate
    payloads = []
    for g in grads:
        n = g.numel()
        t = torch.randint(-1, 2, (n,), dtype=torch.int8)
        one = codec.packing.encode(t, "2bit", torch.tensor([0.01]), 0)
        payloads.append((torch.cat([one, one]), one.numel(), n))

    def noise():
        for buf, size, n in payloads:
            h = codec.packing.Header("2bit", 0, 0, n)
            noise_estimate(buf, [h, h], [0, size], 2)

    torch_opt.step()
    rf_step(precision.REFRESH)()          # the schedule's first step is a refresh
    rf_step(precision.TERNARY)()
    tg_step()
    noise()                               # loads the backend once
    times = {"compute": [], "torch": [], "tg": [], "noise": [], "rf-ternary": [], "rf-refresh": []}
    fns = {"compute": compute, "torch": torch_opt.step, "tg": tg_step, "noise": noise,
           "rf-ternary": rf_step(precision.TERNARY), "rf-refresh": rf_step(precision.REFRESH)}
    for _ in range(rounds):
        for k, fn in fns.items():
            times[k] += timed(fn, steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    share = RefreshSchedule(max_interval=128).count(1000) / 1000
    mix = (1 - share) * med["rf-ternary"] + share * med["rf-refresh"]
    row = {"model": name, "params": sum(p.numel() for p in params), "tensors": len(params), "batch": batch,
           **{f"{k}_ms": 1e3 * v for k, v in med.items()},
           "overhead_default": (med["tg"] + med["noise"] - med["torch"]) / med["compute"],
           "overhead_refresh_mode": (mix - med["torch"]) / med["compute"], "refresh_share": share}
    return row


# parameter shapes for --shapes (operations/gpu_check.gpt2_shapes: transformers' GPT2LMHeadModel, head tied)
SHAPES = {"gpt2-124m": dict(layers=12, d=768, vocab=50257, context=1024),
          "gpt2-6x512-v16384": dict(layers=6, d=512, vocab=16384, context=64)}


def step_table(shapes_name, device, steps, rounds, kinds):
    """The step alone (operations/optim_speed.adamw_step_ms) on ``shapes_name``'s parameter shapes: its row."""
    from horovod_terngrad.operations.gpu_check import gpt2_shapes
    from horovod_terngrad.operations.optim_speed import adamw_step_ms
    row = adamw_step_ms(gpt2_shapes(**SHAPES[shapes_name]), device, steps=steps, rounds=rounds, kinds=kinds)
    row["shapes"] = shapes_name
    cols = [k for k in ("tg", "tg-clipped", "torch-foreach", "torch-fused") if f"{k}_ms" in row]
    ratios = [k for k in ("tg/torch-fused", "tg/torch-foreach", "tg-clipped/torch-fused") if k in row]
    print(f"{shapes_name} ({row['tensors']} tensors, {row['elements'] / 1e6:.1f}M elements) on {row['device']}, "
          f"median of {rounds} x {steps} steps; optim.AdamW's path: {row['path']}")
    print("| " + " | ".join([f"{k} ms" for k in cols] + ratios) + " |")
    print("|" + "---|" * (len(cols) + len(ratios)))
    print("| " + " | ".join([f"{row[k + '_ms']:.2f}" for k in cols] + [f"{row[k]:.2f}x" for k in ratios]) + " |")
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--shapes", choices=sorted(SHAPES), default=None,
                   help="time the step alone on these parameter shapes against torch's foreach and fused AdamW")
    p.add_argument("--device", default="cpu", help="with --shapes: cpu, cuda, or auto (cuda where present)")
    p.add_argument("--kinds", default="tg,tg-clipped,torch-foreach,torch-fused",
                   help="with --shapes: which steps to time (operations/optim_speed.py)")
    a = p.parse_args(argv)
    if a.shapes:
        device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
        if device == "cpu":
            torch.set_num_threads(1)
        row = step_table(a.shapes, device, a.steps, a.rounds, tuple(a.kinds.split(",")))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(row, f, indent=1)
        return
    torch.set_num_threads(1)
    rows = [measure(m, MODELS[m], a.batch, a.steps, a.rounds) for m in a.models.split(",")]
    print("| model | params (tensors) | compute alone ms | torch AdamW ms | tg AdamW ms | + noise estimate ms "
          "| overhead / compute | refresh mode: ternary / refresh step ms | its overhead over a 1000-step run |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e6:.2f}M ({r['tensors']}) | {r['compute_ms']:.0f} | {r['torch_ms']:.1f} "
              f"| {r['tg_ms']:.1f} | {r['noise_ms']:.1f} | {100 * r['overhead_default']:+.2f}% "
              f"| {r['rf-ternary_ms']:.1f} / {r['rf-refresh_ms']:.1f} | {100 * r['overhead_refresh_mode']:+.2f}% |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
