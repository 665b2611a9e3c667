"""Adam and AdamW for TernGrad: keep the ternary rounding's noise out of the second moment.

Why.  A TernGrad gradient is unbiased, E[s·t] = g, but its square is not: E[(s·t)^2] = s·|g| >= g^2 per rank,
and the average over N ranks carries (1/N^2)·Σ_r (s_r·|g_r| - g_r^2) of ternary variance on top of the
minibatch's.  Adam divides by the square root of its running mean of squared gradients v, so fed ternary
gradients it takes every step shorter (about 1.4x with the default clip at 2.5σ).

Two ways to keep the noise out of v, both measured (docs/adam.md); the first is the default:

* ``refresh=None`` (default): **v corrected by the measured noise** (DP-AdamBC's idea, arXiv 2312.14334).  The
  allgather exchange hands every rank every rank's ternary vector and scalers, so each rank forms, per element
  and at no extra bytes, nu = (1/N^2)·Σ_r s_r^2·|t_r| (exchange/allgather.noise_estimate), an unbiased estimate
  of (1/N^2)·Σ_r s_r·|g_r|.  The optimizer keeps its running mean n beside v and divides by

      v_hat = max(v - n, v_floor·v) / (1 - β2^step)

  nu over-estimates the ternary variance by (1/N^2)·Σ_r g_r^2 (one draw per rank cannot tell g_r^2 apart), so
  v - n is smaller than fp32's v by up to the minibatch's own share; the floor (``v_floor``, default 0.1: at
  most sqrt(10) ≈ 3.2x longer steps than plain v) keeps elements whose estimate is all noise finite.  A norm clip
  or a GradScaler's unscale between the exchange and the step scales nu by the same factor squared (recovered
  from the two norms).  Late in training, where the minibatch's noise dominates the squared gradient, that share
  is most of v: the steps are then longer than fp32 AdamW's (docs/scale.md, "Whole runs").  The requantized
  exchange (the default above 4 ranks) gives the estimate too (the owner's, of both its stages, one stochastic
  unbiased bit per element), and so does the node-aware exchange (its cross-node stage's, carried by the
  intra-node allgather).  The re-ternarized exchange gives s'^2·|t'|, the received value's own square: v - n is
  then zero and every step sits at the floor.  Where no estimate comes (the sharded exchange, a rank in
  ``hvd.join()``), v takes the ternary gradient as plain AdamW would, said once.
* ``refresh=RefreshSchedule(...)``: **v from full-precision refreshes only** (0/1 Adam's idea, arXiv
  2202.06009).  The exchange sends the gradient at full precision on the schedule's steps; there both moments
  are updated, elsewhere only m, and v's bias correction counts its refreshes (``state["v_steps"]``).  The
  exchange decides from this optimizer's own ``step`` of the parameter and records it (exchange/precision.py),
  so the two never disagree (accumulation, ``backward_passes_per_step``, a GradScaler's skipped step: the count
  does not move and the refresh is taken next time; resume and elastic restore the count).  It costs 32 bits
  per element on each refresh.

The contract with the exchanges (exchange/precision.py): each optimizer owns a ``PrecisionLedger``
(``precision_ledger``) and claims its parameters in it (the last optimizer to claim a parameter is the one
the exchanges serve); the exchanges find it from the parameter, decide and record per exchange, and hand the
noise estimate over into it; ``step`` reads its own ledger only.

Parameters whose gradient did not come through a ternary exchange, and never did (no TernGrad, tensors under
``min_numel`` or in ``exclude``, ``HOROVOD_TERNGRAD=0``), take torch's own update, bit for bit: the functional
``adam`` torch's ``step`` calls, with the group's flags.

Cost.  One more state tensor per ternarized parameter (n), the noise estimate held from the exchange to the
step, and foreach ops over the parameters grouped by device and dtype (on a DTensor, its local shard); bias
corrections from the host-side step counts: no synchronization on a GPU, as torch's non-capturable Adam.
``capturable``, ``differentiable`` and ``fused`` apply to torch's path; a ternarized parameter under them is
refused with a reason at its first step.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch.optim.adam import adam as torch_adam

from .. import backends
from ..codec.schedule import RefreshSchedule
from ..exchange import precision

log = logging.getLogger("horovod_terngrad")

V_STEPS = "v_steps"             # updates v has had (refresh mode: its refreshes)
TERNARY_STEPS = "ternary_steps"  # steps taken with a ternary gradient (after the first, TernGrad's path for good)
NOISE = "exp_avg_noise"          # running mean of the ternary noise estimate (default mode)
# default mode on a CPU, fp32: one fused C pass per tensor (kernels/terngrad_cpu.c, tg_adam_corrected) instead of
# the foreach ops, which take about a dozen passes over memory; False forces the foreach ops (tests compare both)
FUSED_CPU = True


def _local(t):
    """A DTensor's local shard (the same memory), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _schedule_dict(refresh) -> dict | None:
    if refresh is None:
        return None
    if isinstance(refresh, dict):
        refresh = RefreshSchedule(**refresh)
    elif not isinstance(refresh, RefreshSchedule):
        raise TypeError(f"refresh must be a RefreshSchedule (or its fields as a dict), got {type(refresh).__name__}")
    # kept in the param groups as plain values, so a checkpoint loads with torch.load(weights_only=True) and
    # Horovod's DistributedOptimizer, which rebuilds the optimizer from its param groups, keeps it
    return dataclasses.asdict(refresh)


class _RefreshedAdam:
    """The TernGrad-aware part shared by Adam and AdamW (mixed in before torch's class)."""

    _warned_unrefreshed = False
    _warned_no_noise = False

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        param_group = dict(param_group, refresh=_schedule_dict(param_group.get("refresh", self._refresh_default)))
        param_group.setdefault("v_floor", self._v_floor)
        if not 0 <= param_group["v_floor"] <= 1:
            raise ValueError(f"v_floor must be in [0, 1], got {param_group['v_floor']!r}")
        super().add_param_group(param_group)
        self._claim(self.param_groups[-1])

    @property
    def precision_ledger(self) -> precision.PrecisionLedger:
        """This optimizer's side of the contract with the exchanges (exchange/precision.py)."""
        ledger = self.__dict__.get("_precision_ledger")
        if ledger is None:       # made at the first param group (torch's __init__ adds them before ours returns)
            ledger = self._precision_ledger = precision.PrecisionLedger(self)
        return ledger

    def _claim(self, group) -> None:
        schedule = None if group.get("refresh") is None else RefreshSchedule(**group["refresh"])
        ledger = self.precision_ledger
        for p in group["params"]:
            ledger.claim(p, schedule, noise=schedule is None)

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:           # the loaded groups' settings
            group.setdefault("refresh", None)
            group.setdefault("v_floor", self._v_floor)
            self._claim(group)

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
            ledger = self.precision_ledger
            records = [ledger.record_of(p) for p in params]           # read once per step (weak-keyed map)
            for i, p in enumerate(params):
                st = self.state[p]
                # torch's path until the first ternary gradient (so the warm-up's refreshes are torch's update),
                # TernGrad's after it, for good (host-side count: no GPU sync)
                ternary_before = on_host and TERNARY_STEPS in st and float(st[TERNARY_STEPS]) > 0
                (tern if records[i] == precision.TERNARY or ternary_before else plain).append(i)
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
                    # v was updated with m: its count follows step.  Every key TernGrad's path uses exists from the
                    # first step on, so that a checkpoint template (torch.distributed.checkpoint loads only the keys
                    # a fresh state has) holds them
                    p = params[i]
                    st = self.state[p]
                    if V_STEPS in st:
                        st[V_STEPS].copy_(st["step"])
                    else:
                        st[V_STEPS] = st["step"].clone()
                        st[TERNARY_STEPS] = torch.zeros_like(st["step"])
                    if NOISE not in st and ledger.wants_noise(p):
                        st[NOISE] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if tern:
                amsgrad = group["amsgrad"]
                self._terngrad_update(group, [params[i] for i in tern], [grads[i] for i in tern],
                                      [exp_avgs[i] for i in tern], [exp_avg_sqs[i] for i in tern],
                                      [max_exp_avg_sqs[i] for i in tern] if amsgrad else None,
                                      [records[i] for i in tern])
        return loss

    def _terngrad_update(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, records) -> None:
        for flag in ("capturable", "differentiable", "fused"):
            if group[flag]:
                raise ValueError(f"horovod_terngrad.optim.{type(self).__name__}: {flag}=True is not supported for "
                                 f"parameters whose gradients TernGrad ternarizes (first: shape "
                                 f"{tuple(params[0].shape)}); leave {flag} unset")
        beta1, beta2 = group["betas"]
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        decoupled = group["decoupled_weight_decay"]
        corrected = group.get("refresh") is None
        by_kind: dict = {}
        noise_of = {}
        ledger = self.precision_ledger
        ternary_counts = []       # host step counts, advanced by one foreach call (not one op per tensor)
        for i, p in enumerate(params):
            state = self.state[p]
            if V_STEPS not in state:      # a state from torch's AdamW: v has had as many updates as steps so far
                state[V_STEPS] = state["step"].clone()
            if TERNARY_STEPS not in state:
                state[TERNARY_STEPS] = torch.zeros_like(state["step"])
            record = records[i]
            if record == precision.TERNARY:
                ternary_counts.append(state[TERNARY_STEPS])
            if corrected:
                refresh = True            # v is updated every step; n carries the noise to take out
                if NOISE not in state:
                    state[NOISE] = torch.zeros_like(p, memory_format=torch.preserve_format)
                noise_of[i] = ledger.take_noise(p) if record == precision.TERNARY else None
                if record == precision.TERNARY and noise_of[i] is None and not _RefreshedAdam._warned_no_noise:
                    _RefreshedAdam._warned_no_noise = True
                    log.warning("horovod_terngrad.optim: no ternary noise estimate came with a gradient (shape %s): "
                                "the allgather, re-ternarized and requantized exchanges give one, flat or across "
                                "nodes (not 'sharded', nor a step with a rank in hvd.join()); its second moment takes "
                                "the ternary "
                                "gradient as plain AdamW does", tuple(p.shape))
            else:
                refresh = record != precision.TERNARY
                if not refresh and float(state[V_STEPS]) == 0:
                    # a ternary gradient before any exact one (a schedule without warm-up, a parameter added
                    # late): v from it beats a division by eps
                    refresh = True
                    if not _RefreshedAdam._warned_unrefreshed:
                        _RefreshedAdam._warned_unrefreshed = True
                        log.warning("horovod_terngrad.optim: a parameter (shape %s) got a ternary gradient before "
                                    "any full-precision one; its second moment starts from that", tuple(p.shape))
            by_kind.setdefault((p.device, p.dtype, refresh), []).append(i)
        if ternary_counts:
            torch._foreach_add_(ternary_counts, 1)
        for (device, dtype, refresh), idx in by_kind.items():
            if corrected and self._fused_cpu(device, dtype, params, grads, max_exp_avg_sqs, idx, noise_of):
                self._fused_corrected_update(group, params, grads, max_exp_avg_sqs, idx, noise_of)
                continue
            ps = [_local(params[i]) for i in idx]
            gs = [_local(grads[i]) for i in idx]
            ms = [_local(exp_avgs[i]) for i in idx]
            vs = [_local(exp_avg_sqs[i]) for i in idx]
            if group["maximize"]:
                gs = torch._foreach_neg(gs)
            if wd != 0 and not decoupled:
                gs = torch._foreach_add(gs, ps, alpha=wd)
            torch._foreach_lerp_(ms, gs, 1 - beta1)
            if refresh:
                torch._foreach_mul_(vs, beta2)
                torch._foreach_addcmul_(vs, gs, gs, 1 - beta2)
            if corrected:
                ns = [_local(self.state[params[i]][NOISE]) for i in idx]
                torch._foreach_mul_(ns, beta2)
                got = [(j, noise_of.get(i)) for j, i in enumerate(idx)]
                got = [(j, x) for j, x in got if x is not None]
                if got:
                    # n += (1 - β2)·noise·(|g|²/|average|² at the exchange): the gradient may have been scaled
                    # since the exchange (clip, unscale), the noise with it squared.  The factors are computed as
                    # one vector on the device (no host sync) and handed out as its 0-d views: a handful of
                    # kernels per step, not five per tensor (on a GPU, 76 tensors' small kernels took 6x torch's
                    # whole AdamW step).  (The gradient as it came, before maximize's sign and Adam's L2 term.)
                    sq = torch.stack(torch._foreach_norm([_local(grads[idx[j]]) for j, _ in got], 2,
                                                         dtype=torch.float32))
                    sq = sq * sq
                    at = torch.stack([x[1] for _, x in got])
                    factor = (torch.where(at > 0, sq / at, torch.ones_like(sq)) * (1 - beta2)).unbind(0)
                    torch._foreach_addcmul_([ns[j] for j, _ in got], [x[0].to(ns[j].dtype) for j, x in got],
                                            factor)
            del gs
            # the host step counts: one foreach call each, then read (torch's own Adam does the same)
            counts = [self.state[params[i]]["step"] for i in idx]
            v_counts = [self.state[params[i]][V_STEPS] for i in idx]
            torch._foreach_add_(counts, 1)
            if refresh:
                torch._foreach_add_(v_counts, 1)
            bias1 = [1 - beta1 ** c.item() for c in counts]
            bias2_sqrt = [math.sqrt(1 - beta2 ** v.item()) for v in v_counts]
            if wd != 0 and decoupled:
                torch._foreach_mul_(ps, 1 - lr * wd)
            if corrected:
                # v_hat = max(v - n, f·v): the ternary noise out, never below the floor f.  Computed as
                # f·max((v - n)/f, v) in one temporary, the f folded into the bias correction: three passes
                # (a CPU in fp32 takes the fused C pass instead: _fused_corrected_update)
                f = float(group["v_floor"])
                v_hat = torch._foreach_sub(vs, ns)    # one pass, one launch (a copy and an in-place sub: two)
                if f > 0:
                    torch._foreach_mul_(v_hat, 1 / f)
                    torch._foreach_maximum_(v_hat, vs)
                else:
                    torch._foreach_clamp_min_(v_hat, 0.0)
                    f = 1.0
                if max_exp_avg_sqs is not None:
                    if f != 1.0:
                        torch._foreach_mul_(v_hat, f)
                        f = 1.0
                    maxs = [_local(max_exp_avg_sqs[i]) for i in idx]
                    torch._foreach_maximum_(maxs, v_hat)
                    torch._foreach_copy_(v_hat, maxs)
                torch._foreach_sqrt_(v_hat)
                denom = v_hat
                bias2_sqrt = [b / math.sqrt(f) for b in bias2_sqrt]
            elif max_exp_avg_sqs is not None:
                maxs = [_local(max_exp_avg_sqs[i]) for i in idx]
                torch._foreach_maximum_(maxs, vs)
                denom = torch._foreach_sqrt(maxs)
            else:
                denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, bias2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(ps, ms, denom, [-lr / b for b in bias1])

    def _fused_cpu(self, device, dtype, params, grads, max_exp_avg_sqs, idx, noise_of) -> bool:
        """Whether the default mode's update of these parameters can take the fused C pass: CPU, fp32, every
        tensor it writes or reads contiguous (it walks raw pointers), the fused CPU backend loaded."""
        if not FUSED_CPU or device.type != "cpu" or dtype != torch.float32:
            return False
        be = backends.for_device(device)
        if not backends.has_capability(be, backends.ADAM_CORRECTED):
            return False
        for i in idx:
            st = self.state[params[i]]
            ts = [_local(params[i]), _local(grads[i]), _local(st["exp_avg"]), _local(st["exp_avg_sq"]),
                  _local(st[NOISE])] + ([_local(max_exp_avg_sqs[i])] if max_exp_avg_sqs is not None else [])
            if any(t.dtype != torch.float32 or not t.is_contiguous() for t in ts):
                return False
            got = noise_of.get(i)
            if got is not None and (got[0].numel() != ts[0].numel() or got[0].device.type != "cpu"):
                return False
        return True

    def _fused_corrected_update(self, group, params, grads, max_exp_avg_sqs, idx, noise_of) -> None:
        """The default mode's update (the foreach ops of ``_terngrad_update``, the same formula) as one C pass per
        tensor: on a CPU the factor |g|²/|average|² is read on the host for free."""
        be = backends.for_device(torch.device("cpu"))
        beta1, beta2 = group["betas"]
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        decoupled = group["decoupled_weight_decay"]
        decay = 1 - lr * wd if wd != 0 and decoupled else 1.0
        l2 = float(wd) if wd != 0 and not decoupled else 0.0
        for i in idx:
            param = params[i]
            st = self.state[param]
            st["step"] += 1
            st[V_STEPS] += 1
            bias1 = 1 - beta1 ** float(st["step"])
            bias2_sqrt = math.sqrt(1 - beta2 ** float(st[V_STEPS]))
            g = _local(grads[i])
            got = noise_of.get(i)
            noise, coef = None, 0.0
            if got is not None:
                noise, at = got
                at = float(at)
                factor = float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2 / at if at > 0 else 1.0
                noise, coef = noise.to(torch.float32).contiguous(), (1 - beta2) * factor
            be.adam_corrected(_local(param), _local(st["exp_avg"]), _local(st["exp_avg_sq"]), _local(st[NOISE]),
                              g, noise, _local(max_exp_avg_sqs[i]) if max_exp_avg_sqs is not None else None,
                              beta1=beta1, beta2=beta2, step=lr / bias1, inv_bias2_sqrt=1 / bias2_sqrt, eps=eps,
                              decay=decay, l2=l2, noise_coef=coef, floor=float(group["v_floor"]),
                              maximize=group["maximize"])


class Adam(_RefreshedAdam, torch.optim.Adam):
    """``torch.optim.Adam`` with TernGrad's noise kept out of the second moment (adam.py's docstring).
    ``refresh``: None (default: v corrected by the exchange's noise estimate, floored at ``v_floor``·v), or a
    ``RefreshSchedule`` (or a dict of its fields): v from full-precision refreshes only; per param group."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, refresh: RefreshSchedule | dict | None = None, v_floor: float = 0.1):
        self._refresh_default = _schedule_dict(refresh)
        self._v_floor = v_floor
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=decoupled_weight_decay)
        self.defaults.update(refresh=self._refresh_default, v_floor=v_floor)


class AdamW(_RefreshedAdam, torch.optim.AdamW):
    """``torch.optim.AdamW`` with TernGrad's noise kept out of the second moment (adam.py's docstring).
    ``refresh``: None (default: v corrected by the exchange's noise estimate, floored at ``v_floor``·v), or a
    ``RefreshSchedule`` (or a dict of its fields): v from full-precision refreshes only; per param group."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 refresh: RefreshSchedule | dict | None = None, v_floor: float = 0.1):
        self._refresh_default = _schedule_dict(refresh)
        self._v_floor = v_floor
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, foreach=foreach,
                         capturable=capturable, differentiable=differentiable, fused=fused)
        self.defaults.update(refresh=self._refresh_default, v_floor=v_floor)
