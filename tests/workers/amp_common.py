"""What the mixed-precision workers (amp_hvd.py under horovodrun, amp_ddp.py under torchrun) share: the model,
each rank's data, the overflows injected on one rank, and the training loop that records, per step, the loss,
the loss scale after ``scaler.update()`` and whether the optimizer step was skipped (no parameter changed).

Schedule of a run (steps 0 .. STEPS-1), TernGrad and its full-precision baseline alike:

* the first steps overflow on every rank: GradScaler starts at INIT_SCALE (1.5 * 2**24), far above what fp16 holds
  here, and backs off by 1/2 per step until the scaled gradients fit;
* step SPIKE_STEP: the last rank alone multiplies its loss by 2**20 (its fp16 backward overflows);
* step TERN_INF_STEP: rank 0 alone puts +Inf into one element of TERNARIZED's gradient (8192 elements: over
  the default ``min_numel``, so TernGrad ternarizes it);
* step SMALL_NAN_STEP: rank 1 alone puts NaN into SMALL's gradient (under ``min_numel``: full precision).

``growth_interval`` stays GradScaler's default (2000), so the scale never grows within a run: every back-off
is one of the steps above.  The first scale that fits sits 1.7x or more under the overflow point of every
rank's fp16 backward (measured at the initial model), and the gradients only shrink afterwards, so no other step
overflows, with or without TernGrad's noise.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 16
INIT_SCALE = 1.5 * 2.0 ** 24
SPIKE_STEP, TERN_INF_STEP, SMALL_NAN_STEP = 9, 11, 13
SPIKE = 2.0 ** 20
TERNARIZED = "2.weight"     # Linear(64, 128).weight: 8192 elements
SMALL = "4.bias"            # 8 elements
LR, MOMENTUM = 0.1, 0.9


def make_model(seed=0):
    """16 -> 64 -> 128 -> 8: one weight of 8192 elements (ternarized at the defaults), the rest (1024, 1024 and
    the biases) under ``min_numel`` = 4096, at full precision."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def batch(rank):
    """This rank's fixed batch (full-batch training, so the loss goes down step by step): 64 inputs and the
    targets of a fixed teacher."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1000 + rank))
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(7)) / 2
    return x, torch.tanh(x @ w)


class Faults:
    """The overflows of one rank alone (see the module docstring); ``step`` is set by the loop."""

    def __init__(self, model, rank, size, enabled=True):
        self.rank, self.enabled, self.step = rank, enabled, -1
        self.spike_rank, self.tern_rank, self.nan_rank = size - 1, 0, 1
        params = dict(model.named_parameters())
        params[TERNARIZED].register_hook(self._hook(TERN_INF_STEP, self.tern_rank, float("inf")))
        params[SMALL].register_hook(self._hook(SMALL_NAN_STEP, self.nan_rank, float("nan")))

    def _hook(self, step, rank, value):
        def hook(grad):            # runs before the gradient is accumulated, so before any exchange
            if self.enabled and self.step == step and self.rank == rank:
                grad = grad.clone()
                grad.view(-1)[0] = value
                return grad
            return None
        return hook

    def loss_factor(self):
        return SPIKE if self.enabled and self.step == SPIKE_STEP and self.rank == self.spike_rank else 1.0

    def injected_steps(self):
        return [SPIKE_STEP, TERN_INF_STEP, SMALL_NAN_STEP] if self.enabled else []


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def train(model, faults, backward_and_step, rank, steps=range(STEPS), autocast=torch.float16, scaler=None,
          dtype=torch.float32):
    """Runs ``steps``; ``backward_and_step(loss)`` is the frontend's recipe.  ``dtype``: the inputs' dtype (the
    model's parameters' for ``.half()`` / bf16 models).  Returns the per-step record."""
    x, y = batch(rank)
    x = x.to(dtype)
    rec = {"loss": [], "scale": [], "skipped": [], "finite": [], "max_grad": [], "steps": list(steps)}
    for s in steps:
        faults.step = s
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cpu", dtype=autocast or torch.float16, enabled=autocast is not None):
            loss = F.mse_loss(model(x).float(), y)
        before = params_of(model)
        rec["loss"].append(loss.item())
        used = scaler.get_scale() if scaler is not None else 1.0
        backward_and_step(loss * faults.loss_factor())
        # the largest |averaged gradient| times the scale it was computed at (both recipes leave the gradients
        # unscaled): how close to fp16's limit the step came (a diagnostic the tests print on failure)
        grads = torch.cat([p.grad.detach().float().reshape(-1) for p in model.parameters()])
        rec["finite"].append(bool(torch.isfinite(grads).all()))
        rec["max_grad"].append(used * grads.abs().max().item())
        rec["scale"].append(scaler.get_scale() if scaler is not None else None)
        rec["skipped"].append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    rec["params"] = params_of(model)
    rec["injected"] = faults.injected_steps()
    return rec
