"""The ``optimizer`` step: ``horovod_terngrad.optim.AdamW``'s step with a ternary gradient and its noise estimate,
beside ``torch.optim.AdamW``'s fused and foreach steps."""
from __future__ import annotations

import torch

from .timing import Timer


def optimizer_step_ms(shapes, device, timer: Timer | None = None, steps: int = 10) -> dict:
    """ms per step of ``horovod_terngrad.optim.AdamW`` on a ternary gradient with its noise estimate (each step
    the exchange's record and estimate, as a frontend hands them over: included), and of ``torch.optim.AdamW``
    fused and foreach, on parameters of ``shapes``: GPU time (wall on the CPU), and wall time."""
    from ...exchange import precision
    from ...optim import AdamW
    timer = timer or Timer(device)
    gen = torch.Generator(device=device).manual_seed(0)

    def params():
        ps = []
        for _, shape in shapes:
            p = torch.nn.Parameter(torch.randn(shape, device=device, generator=gen).mul_(0.02))
            p.grad = torch.randn(shape, device=device, generator=gen).mul_(1e-3)
            ps.append(p)
        return ps

    hp = dict(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    tg_params = params()
    tg_opt = AdamW(tg_params, **hp)
    noises = [p.grad.abs() * 1e-3 for p in tg_params]
    ledger = tg_opt.precision_ledger

    def tg_step():
        for p, noise in zip(tg_params, noises):           # what an exchange records and hands over (precision.py)
            ledger.set_record(p, precision.TERNARY)
            ledger.put_noise(p, noise, p.grad)
        tg_opt.step()

    out = {"params": len(tg_params), "elements": sum(p.numel() for p in tg_params)}
    t = timer.measure(tg_step, steps)
    out.update(tg_ms=1e3 * t["s"], tg_wall_ms=1e3 * t["wall_s"])
    out["ternary_params"] = sum(1 for p in tg_params
                                if float(tg_opt.state[p].get("ternary_steps", torch.zeros(()))) > 0)
    for kind in ("fused", "foreach"):
        ps = params()
        try:
            opt = torch.optim.AdamW(ps, **hp, **{kind: True})
            t = timer.measure(opt.step, steps)
            out.update({f"{kind}_ms": 1e3 * t["s"], f"{kind}_wall_ms": 1e3 * t["wall_s"]})
        except (RuntimeError, ValueError) as e:       # a torch without the fused step on this device
            out[f"{kind}_ms"] = None
            out[f"{kind}_error"] = str(e).splitlines()[0][:200]
    return out
