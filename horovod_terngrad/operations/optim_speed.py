"""What one step of ``horovod_terngrad.optim.AdamW`` costs beside torch's AdamW, on a model's parameter shapes.

``adamw_step_ms(shapes, device)`` times, in interleaved rounds (a slow spell of the machine lands on all of them),
the median step of:

  tg             optim.AdamW (default mode) on a ternary step, with what a frontend hands over per tensor (the
                 exchange's record and noise estimate, ``set_record`` and ``put_noise``: the average's norm) in
                 the time; the gradient is the exchange's average itself, as a frontend that writes the average
                 into ``.grad`` leaves it
  tg-clipped     the same, the gradient scaled after the exchange (a norm clip): the step takes the gradients'
                 norms too, for the noise's factor
  torch-foreach  torch.optim.AdamW(foreach=True)
  torch-fused    torch.optim.AdamW(fused=True)

all with lr 1e-4, weight decay 0.1, betas (0.9, 0.95), on parameters of ``shapes`` (e.g. gpu_check.gpt2_shapes).
``python examples/optim_overhead.py --shapes gpt2-124m --device cuda`` prints it as a table.
"""
from __future__ import annotations

import statistics
import time

import torch

HYPER = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
KINDS = ("tg", "tg-clipped", "torch-foreach", "torch-fused")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def update_path(device) -> str:
    """Which update optim.AdamW's default mode takes for fp32 parameters on ``device``."""
    from ..backends import cpu_fused, cuda_adam
    from ..optim import adam as adam_module
    device = torch.device(device)
    kernel = adam_module.MULTI_TENSOR_KERNEL or cuda_adam.kernel_for(device)
    if kernel is not None and kernel.device == device.type:
        return "multi-tensor kernel (kernels/adam.cu)"
    if device.type == "cpu" and adam_module.FUSED_CPU and cpu_fused() is not None:
        return "fused C pass per tensor (tg_adam_corrected)"
    return "foreach ops"


def adamw_step_ms(shapes, device="cpu", steps: int = 5, rounds: int = 3, kinds=KINDS, seed: int = 0) -> dict:
    """Median ms per step of each of ``kinds`` (module docstring) on parameters of ``shapes`` ((name, shape)
    pairs) on ``device``, over ``rounds`` interleaved rounds of ``steps`` steps, after two warm-up steps each; with
    the ratios of tg to torch-fused and torch-foreach, the tensors and elements, and the path tg took."""
    from ..exchange import precision
    from ..optim import AdamW
    device = torch.device(device)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kinds {sorted(unknown)}: choose from {KINDS}")

    def params():                  # the same values for every kind, made one tensor at a time (memory)
        gen = torch.Generator().manual_seed(seed)
        ps = []
        for _, shape in shapes:
            p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device))
            p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(device)
            ps.append(p)
        return ps

    steps_of = {}
    for kind in kinds:
        ps = params()
        if kind.startswith("tg"):
            opt = AdamW(ps, **HYPER)
            ledger = opt.precision_ledger
            noises = [p.grad.abs() * 1e-3 for p in ps]
            if kind == "tg":
                averages = [p.grad for p in ps]                 # the gradient is the average itself
            else:
                averages = [p.grad / 0.7 for p in ps]           # the gradient is the average clipped by 0.7

            def step(opt=opt, ledger=ledger, ps=ps, noises=noises, averages=averages):
                for p, noise, average in zip(ps, noises, averages):     # what a frontend hands over
                    ledger.set_record(p, precision.TERNARY)
                    ledger.put_noise(p, noise, average)
                opt.step()
        else:
            opt = torch.optim.AdamW(ps, **HYPER, **({"fused": True} if kind == "torch-fused" else {"foreach": True}))
            step = opt.step
        steps_of[kind] = step
    times = {kind: [] for kind in kinds}
    for kind in kinds:                                    # warm-up: state allocation, compilation, first launches
        for _ in range(2):
            steps_of[kind]()
    _sync(device)
    for _ in range(rounds):
        for kind in kinds:
            for _ in range(steps):
                t0 = time.perf_counter()
                steps_of[kind]()
                _sync(device)
                times[kind].append(time.perf_counter() - t0)
    out = {f"{kind}_ms": 1e3 * statistics.median(ts) for kind, ts in times.items()}
    for kind in ("tg", "tg-clipped"):
        for ref in ("torch-fused", "torch-foreach"):
            if f"{kind}_ms" in out and f"{ref}_ms" in out:
                out[f"{kind}/{ref}"] = out[f"{kind}_ms"] / out[f"{ref}_ms"]
    out.update(tensors=len(shapes), elements=sum(torch.Size(shape).numel() for _, shape in shapes), device=str(device),
               path=update_path(device), steps=steps, rounds=rounds)
    return out
