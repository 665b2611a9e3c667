"""Adam and AdamW for TernGrad: the second moment taken only from exact gradients.

Why.  A TernGrad gradient is unbiased, E[s·t] = g, but its square is not: E[(s·t)^2] = s·|g| >= g^2 per rank,
and the average over N ranks carries (1/N^2)·Σ_r (s_r·|g_r| - g_r^2) of ternary variance on top of the
minibatch's.  Adam divides by the square root of its running mean of squared gradients v, so fed ternary
gradients it takes every step shorter (about 1.4x with the default clip at 2.5σ) and trains a transformer
measurably worse than fp32 AdamW (docs/adam.md).  Subtracting an estimate of that variance from v (DP-AdamBC's
idea) cannot work here: one ternary draw per rank gives no unbiased estimate of g_r^2, and subtracting s_r·|x_r|
removes the minibatch's own variance too (docs/adam.md measures it).

What.  The second moment is updated only from exact averages (0/1 Adam's idea, arXiv 2202.06009).  The exchange
sends a gradient at full precision on the steps of a ``RefreshSchedule`` (codec/schedule.py: every step of a
short warm-up, then further and further apart); there both moments are updated.  On every other step the
gradient is ternary and updates the first moment only; v keeps its last value, and its bias correction counts
the refreshes it has had (``state["v_steps"]``), not the steps:

    refresh:  m <- β1·m + (1-β1)·g,  v <- β2·v + (1-β2)·g^2,  v_steps += 1
    ternary:  m <- β1·m + (1-β1)·g
    always:   step += 1;  p <- p - lr·(m / (1-β1^step)) / (sqrt(v / (1-β2^v_steps)) + eps)
              (AdamW: p <- p·(1 - lr·wd) first; Adam with weight decay: g <- g + wd·p first; amsgrad: the
              running max of v; maximize: -g)

The optimizer does not count refreshes itself: the exchange that decided a gradient's precision records it
(exchange/precision.py), from this optimizer's own ``step`` of that parameter, and ``step()`` reads the record.
So they cannot disagree, whatever the frontend does between the two (accumulation, Horovod's
``backward_passes_per_step`` and ``synchronize()``/``skip_synchronize()``, a step a GradScaler skips: the step
count does not move, so the refresh is taken at the next exchange).  Ranks decide alike (their optimizer states
are identical), a resumed run decides as the uninterrupted one (the step is in ``state_dict()``).

Parameters whose gradient did not come through a ternary exchange, and that never did (no TernGrad, tensors
under ``min_numel`` or in ``exclude``, ``HOROVOD_TERNGRAD=0``), take torch's own update, bit for bit: the same
functional ``adam`` torch's ``step`` calls, with the group's flags.

Cost.  On top of torch's foreach update: nothing on ternary steps but a skipped v update; the update runs as
foreach ops over the parameters grouped by device and dtype, with bias corrections computed on the host from the
host-side step counts (no synchronization on a GPU, as torch's non-capturable Adam).  ``capturable``,
``differentiable`` and ``fused`` apply to torch's path; a TernGrad parameter under them is refused with a
reason at its first step.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch.optim.adam import adam as torch_adam

from ..codec.schedule import RefreshSchedule
from ..exchange import precision

log = logging.getLogger("horovod_terngrad")

V_STEPS = "v_steps"


def _schedule_dict(refresh) -> dict:
    if refresh is None:
        refresh = RefreshSchedule()
    elif isinstance(refresh, dict):
        refresh = RefreshSchedule(**refresh)
    elif not isinstance(refresh, RefreshSchedule):
        raise TypeError(f"refresh must be a RefreshSchedule (or its fields as a dict), got {type(refresh).__name__}")
    # kept in the param groups as plain values, so a checkpoint loads with torch.load(weights_only=True) and
    # Horovod's DistributedOptimizer, which rebuilds the optimizer from its param groups, keeps it
    return dataclasses.asdict(refresh)


class _RefreshedAdam:
    """The TernGrad-aware part shared by Adam and AdamW (mixed in before torch's class)."""

    _warned_unrefreshed = False

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        param_group = dict(param_group, refresh=_schedule_dict(param_group.get("refresh", self._refresh_default)))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        schedule = RefreshSchedule(**group["refresh"])
        for p in group["params"]:
            precision.request(p, schedule, self)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:           # the loaded groups' schedules
            schedule = RefreshSchedule(**group.setdefault("refresh", dataclasses.asdict(RefreshSchedule())))
            for p in group["params"]:
                precision.request(p, schedule, self)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient: torch's for those that travelled at full precision by
        policy (bit for bit), the refreshed second moment's for TernGrad's (module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            plain, tern = [], []
            on_host = not (group["fused"] or group["capturable"])     # else TernGrad's path is refused anyway
            for i, p in enumerate(params):
                st = self.state[p]
                # torch's path until the first ternary gradient (so the warm-up's refreshes are torch's update);
                # after it, v has had fewer updates than m (v_steps < step) for good
                ternary_before = on_host and V_STEPS in st and float(st[V_STEPS]) != float(st["step"])
                (tern if precision.record_of(p) == precision.TERNARY or ternary_before else plain).append(i)
            if plain:
                pick = (lambda xs: [xs[i] for i in plain])
                torch_adam(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs),
                           pick(max_exp_avg_sqs) if group["amsgrad"] else [], pick(steps),
                           amsgrad=group["amsgrad"], has_complex=has_complex, beta1=group["betas"][0],
                           beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"],
                           eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"],
                           capturable=group["capturable"], differentiable=group["differentiable"],
                           fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                           found_inf=getattr(self, "found_inf", None),
                           decoupled_weight_decay=group["decoupled_weight_decay"])
                for i in plain:
                    # v was updated with m: its count follows step.  Kept from the first step on, so that a
                    # checkpoint template (torch.distributed.checkpoint loads only the keys a fresh state has) holds it
                    st = self.state[params[i]]
                    if V_STEPS in st:
                        st[V_STEPS].copy_(st["step"])
                    else:
                        st[V_STEPS] = st["step"].clone()
            if tern:
                amsgrad = group["amsgrad"]
                self._terngrad_update(group, [params[i] for i in tern], [grads[i] for i in tern],
                                      [exp_avgs[i] for i in tern], [exp_avg_sqs[i] for i in tern],
                                      [max_exp_avg_sqs[i] for i in tern] if amsgrad else None)
        return loss

    def _terngrad_update(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs) -> None:
        for flag in ("capturable", "differentiable", "fused"):
            if group[flag]:
                raise ValueError(f"horovod_terngrad.optim.{type(self).__name__}: {flag}=True is not supported for "
                                 f"parameters whose gradients TernGrad ternarizes (first: shape "
                                 f"{tuple(params[0].shape)}); leave {flag} unset")
        beta1, beta2 = group["betas"]
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        decoupled = group["decoupled_weight_decay"]
        by_kind: dict = {}
        for i, p in enumerate(params):
            state = self.state[p]
            if V_STEPS not in state:      # a state from torch's AdamW: v has had as many updates as steps so far
                state[V_STEPS] = state["step"].clone()
            refresh = precision.record_of(p) != precision.TERNARY
            if not refresh and float(state[V_STEPS]) == 0:
                # a ternary gradient before any exact one (a schedule without warm-up, a parameter added
                # late): v from it beats a division by eps
                refresh = True
                if not _RefreshedAdam._warned_unrefreshed:
                    _RefreshedAdam._warned_unrefreshed = True
                    log.warning("horovod_terngrad.optim: a parameter (shape %s) got a ternary gradient before any "
                                "full-precision one; its second moment starts from that", tuple(p.shape))
            by_kind.setdefault((p.device, p.dtype, refresh), []).append(i)
        for (_, _, refresh), idx in by_kind.items():
            ps = [params[i] for i in idx]
            gs = [grads[i] for i in idx]
            ms = [exp_avgs[i] for i in idx]
            vs = [exp_avg_sqs[i] for i in idx]
            if group["maximize"]:
                gs = torch._foreach_neg(gs)
            if wd != 0 and not decoupled:
                gs = torch._foreach_add(gs, ps, alpha=wd)
            torch._foreach_lerp_(ms, gs, 1 - beta1)
            if refresh:
                torch._foreach_mul_(vs, beta2)
                torch._foreach_addcmul_(vs, gs, gs, 1 - beta2)
            del gs
            bias1, bias2_sqrt = [], []
            for p in ps:
                state = self.state[p]
                state["step"] += 1
                if refresh:
                    state[V_STEPS] += 1
                bias1.append(1 - beta1 ** float(state["step"]))
                bias2_sqrt.append(math.sqrt(1 - beta2 ** float(state[V_STEPS])))
            if wd != 0 and decoupled:
                torch._foreach_mul_(ps, 1 - lr * wd)
            if max_exp_avg_sqs is not None:
                maxs = [max_exp_avg_sqs[i] for i in idx]
                torch._foreach_maximum_(maxs, vs)
                vs = maxs
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, bias2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(ps, ms, denom, [-lr / b for b in bias1])


class Adam(_RefreshedAdam, torch.optim.Adam):
    """``torch.optim.Adam`` with TernGrad's refreshed second moment (adam.py's docstring); ``refresh``: the
    ``RefreshSchedule`` (or a dict of its fields) of the full-precision exchanges, per param group."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, refresh: RefreshSchedule | dict | None = None):
        self._refresh_default = _schedule_dict(refresh)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=decoupled_weight_decay)
        self.defaults["refresh"] = self._refresh_default


class AdamW(_RefreshedAdam, torch.optim.AdamW):
    """``torch.optim.AdamW`` with TernGrad's refreshed second moment (adam.py's docstring); ``refresh``: the
    ``RefreshSchedule`` (or a dict of its fields) of the full-precision exchanges, per param group."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 refresh: RefreshSchedule | dict | None = None):
        self._refresh_default = _schedule_dict(refresh)
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused)
        self.defaults["refresh"] = self._refresh_default
