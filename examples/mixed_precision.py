"""Mixed precision for the examples (``--amp fp16|bf16``): autocast around forward and loss, and for fp16 a
``torch.amp.GradScaler`` with the step recipe of each frontend, counting the steps the scaler skipped.

Horovod (its documented AMP pattern: the gradients are averaged before the scaler looks at them)::

    scaler.scale(loss).backward()
    opt.synchronize()                    # wait for the averaged gradients
    scaler.unscale_(opt)                 # (gradient clipping would go here)
    with opt.skip_synchronize():
        scaler.step(opt)                 # skipped when a gradient holds inf/NaN
    scaler.update()

DDP (the comm hook has averaged the gradients when backward returns)::

    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()

A step counts as skipped when ``scaler.step(opt)`` did not run ``opt.step()``, which GradScaler does exactly when
it found inf/NaN in the (averaged, unscaled) gradients.  It is seen through the optimizer's public step hook
(``opt.register_step_post_hook``, fired whenever ``opt.step()`` runs), not GradScaler's private per-optimizer
state.  Watching the scale instead (``get_scale()`` going down in ``update()``, the backoff on inf/NaN) gives the
same count while the scale is positive, but misses the skips once it has underflowed to 0 (0 x 0.5 = 0), which a
run that overflows at every step reaches after ~150 halvings.  Every rank sees the same averaged gradients, so
every rank skips the same steps; the examples check it by gathering every rank's count.

bf16 has fp32's exponent range, so it needs no loss scaling: autocast only, no scaler.
"""
from __future__ import annotations

import argparse
import contextlib
import math

import torch

MODES = ("off", "fp16", "bf16")
DEFAULT_INIT_SCALE = 2.0 ** 16          # torch.amp.GradScaler's own default


def scale_value(text: str) -> float:
    """A loss scale from the command line: a number (``65536``, ``1e12``) or a power written ``2**40``."""
    try:
        if "**" in text:
            base, exp = text.split("**", 1)
            value = float(base) ** float(exp)
        else:
            value = float(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a loss scale: {text!r} (a number, or a power like 2**40)") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"a loss scale must be positive and finite, got {text!r}")
    return value


def add_arguments(p) -> None:
    p.add_argument("--amp", choices=MODES, default="off",
                   help="mixed precision: autocast to fp16 with a GradScaler, or to bf16 (no scaler); off: fp32")
    p.add_argument("--init-scale", type=scale_value, default=DEFAULT_INIT_SCALE,
                   help="GradScaler's initial loss scale with --amp fp16 (default 2**16, GradScaler's own); a huge "
                        "one (e.g. 2**40) makes the first steps overflow on purpose")


class MixedPrecision:
    """``autocast()`` for forward+loss, ``step(loss, opt)`` for backward+step with the frontend's recipe, and the
    GradScaler's counters: ``skipped`` (steps skipped so far), ``skipped_at`` (which, counting this object's
    ``step`` calls from 1) and ``scale`` (the current loss scale)."""

    def __init__(self, mode: str = "off", device_type: str = "cpu", init_scale: float = DEFAULT_INIT_SCALE,
                 horovod: bool = False):
        if mode not in MODES:
            raise ValueError(f"amp must be one of {MODES}, got {mode!r}")
        self.mode, self.device_type, self.horovod = mode, device_type, horovod
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mode)
        self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale) if mode == "fp16" else None
        self.init_scale = init_scale if self.scaler is not None else None
        self.skipped = 0
        self.skipped_at: list[int] = []              # the steps skipped (1 = the first step of the run)
        self.steps = 0
        self._hooked: set[int] = set()               # optimizers whose step hook is registered
        self._stepped = False                        # set by the hook: opt.step() ran in this step

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def scale(self) -> float | None:
        return self.scaler.get_scale() if self.scaler is not None else None

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def step(self, loss: torch.Tensor, opt, clip=None) -> bool:
        """Backward and optimizer step; True when the step was taken, False when GradScaler skipped it.  ``clip``
        (e.g. a gradient-norm clip) runs on the averaged, unscaled gradients just before the step (Horovod:
        after ``synchronize()``, the step under ``skip_synchronize()``)."""
        self.steps += 1
        if self.scaler is None:                       # fp32 or bf16: the plain step
            loss.backward()
            if clip is not None and self.horovod:
                opt.synchronize()
                clip()
                with opt.skip_synchronize():
                    opt.step()
                return True
            if clip is not None:
                clip()
            opt.step()
            return True
        scaler = self.scaler
        if id(opt) not in self._hooked:
            opt.register_step_post_hook(self._on_step)
            self._hooked.add(id(opt))
        self._stepped = False
        scaler.scale(loss).backward()
        if self.horovod:
            opt.synchronize()
            scaler.unscale_(opt)
            if clip is not None:
                clip()
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            if clip is not None:
                scaler.unscale_(opt)
                clip()
            scaler.step(opt)
        scaler.update()
        if not self._stepped:                         # GradScaler found inf/NaN and did not call opt.step()
            self.skipped += 1
            self.skipped_at.append(self.steps)
            return False
        return True

    def _on_step(self, optimizer, args, kwargs) -> None:
        self._stepped = True

    def summary(self) -> str:
        """What the examples print beside the loss ('' without --amp)."""
        if self.scaler is not None:
            return f"amp fp16: {self.skipped} steps skipped so far, loss scale {self.scale:.6g}"
        return "amp bf16" if self.mode == "bf16" else ""

    def record(self) -> dict:
        """For the examples' JSON results."""
        rec = {"amp": self.mode}
        if self.scaler is not None:
            rec.update(init_scale=self.init_scale, skipped_steps=self.skipped, loss_scale=self.scale,
                       skipped_at=list(self.skipped_at))
        return rec
