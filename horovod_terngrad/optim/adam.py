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

  That sum over-estimates the ternary variance by (1/N^2)·Σ_r g_r^2, which holds the minibatch's own noise (one
  draw per rank cannot tell g_r^2 apart per element); left in, v - n would lose the share of fp32's v that is
  minibatch noise and the steps would grow longer than fp32 AdamW's (1.8x at the end of a whole run).  So every
  sender also carries its exact Σ g_r^2 (4 bytes per payload, codec/squares.py), and the exchange scales nu so
  that its total is the rounding's variance alone: v - n then follows fp32 AdamW's v, and fp32's learning rate
  carries over (docs/scale.md, "Where Adam's corrected second moment sits").  The floor (``v_floor``, default
  0.1: at most sqrt(10) ≈ 3.2x longer steps than plain v) keeps elements whose estimate is all noise finite.  A
  norm clip or a GradScaler's unscale between the exchange and the step scales nu by the same factor squared
  (recovered from the two norms).  The requantized
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

Cost.  One more state tensor per ternarized parameter (n), and the noise estimate held from the exchange to the
step.  The default mode's update of fp32 parameters (on a DTensor, its local shard) is one pass over memory: on
CUDA one launch of ``kernels/adam.cu`` for all of a group's tensors (backends/cuda_adam.py; CuPy compiles it), on a
CPU one C pass per tensor (``tg_adam_corrected``), the same bytes given the same inputs.  It reads p, g, m, v, n
and the estimate and writes p, m, v, n: 40 bytes per element, where torch's fused AdamW moves 28, so on a
memory-bound device its floor is about 1.43x torch's fused step; the noise's factor |g|²/|average|² adds the
gradient's norm (one foreach norm on CUDA, one per tensor on a CPU: 4 bytes more), and the hand-over the
average's (``precision.deliver``, one per tensor: 4 more).  Other dtypes, the refresh mode, and
CUDA without CuPy take foreach ops over the parameters grouped by device and dtype.  The host work per step is a
few list passes per group: the ledger's claims are cached per group (rebuilt when a claim moves), the step
counts advanced and read through numpy views, bias corrections once per distinct count; no synchronization on
a GPU, as torch's non-capturable Adam.  ``capturable``, ``differentiable`` and ``fused`` apply to torch's path;
a ternarized parameter under them is refused with a reason at its first step.
"""
from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import torch
from torch.optim.adam import adam as torch_adam

from .. import backends
from ..backends import cuda_adam
from ..codec.schedule import RefreshSchedule
from ..exchange import precision

log = logging.getLogger("horovod_terngrad")

V_STEPS = "v_steps"             # updates v has had (refresh mode: its refreshes)
TERNARY_STEPS = "ternary_steps"  # steps taken with a ternary gradient (after the first, TernGrad's path for good)
NOISE = "exp_avg_noise"          # running mean of the ternary noise estimate (default mode)
# default mode on a CPU, fp32: one fused C pass per tensor (kernels/terngrad_cpu.c, tg_adam_corrected) instead of
# the foreach ops, which take about a dozen passes over memory; False forces the foreach ops (tests compare both)
FUSED_CPU = True
# default mode, fp32 on CUDA: every tensor of a group in one launch of kernels/adam.cu (backends/cuda_adam.py).
# A kernel object set here is used instead where its device matches (tests: the host build on a CPU)
MULTI_TENSOR_KERNEL = None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _local(t):
    """A DTensor's local shard (the same memory), else the tensor."""
    return t if type(t) in _PLAIN else t.to_local() if hasattr(t, "to_local") else t


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

    def _group_view(self, group) -> "_GroupView":
        """The group's cached view of the ledger (claims by parameter, the parameters on TernGrad's path for
        good): rebuilt when the ledger's claims move (a claim, a release, ``load_state_dict``) or the group's
        parameter list is another."""
        ledger = self.precision_ledger
        views = self.__dict__.setdefault("_group_views", {})
        params = group["params"]
        key = (ledger.generation, id(params), len(params))
        view = views.get(id(group))
        if view is None or view.key != key or view.group is not group:
            view = views[id(group)] = _GroupView(key, group, ledger.claims_of(params))
            for p in params:                       # TernGrad's path for good after a first ternary gradient
                st = self.state.get(p)
                if st and TERNARY_STEPS in st and float(st[TERNARY_STEPS]) > 0:
                    view.ternary.add(id(p))
        return view

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
            view = self._group_view(group)
            claims = [view.claims.get(id(p)) for p in params]
            # torch's path until the first ternary gradient (so the warm-up's refreshes are torch's update),
            # TernGrad's after it, for good (the view's set; a fused or capturable group is refused there anyway)
            ternary = view.ternary if not (group["fused"] or group["capturable"]) else ()
            plain, tern = [], []
            for i, p in enumerate(params):
                c = claims[i]
                (tern if (c is not None and c.record == precision.TERNARY) or id(p) in ternary else plain).append(i)
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
                # v was updated with m: its count follows step.  Every key TernGrad's path uses exists from the
                # first step on, so that a checkpoint template (torch.distributed.checkpoint loads only the keys a
                # fresh state has) holds them
                follow, counts = [], []
                for i in plain:
                    p = params[i]
                    st = self.state[p]
                    if V_STEPS in st:
                        follow.append(st[V_STEPS])
                        counts.append(st["step"])
                    else:
                        st[V_STEPS] = st["step"].clone()
                        st[TERNARY_STEPS] = torch.zeros_like(st["step"])
                    if NOISE not in st and claims[i] is not None and claims[i].noise:
                        st[NOISE] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if follow:
                    torch._foreach_copy_(follow, counts)
            if tern:
                amsgrad = group["amsgrad"]
                self._terngrad_update(group, view, [params[i] for i in tern], [grads[i] for i in tern],
                                      [exp_avgs[i] for i in tern], [exp_avg_sqs[i] for i in tern],
                                      [max_exp_avg_sqs[i] for i in tern] if amsgrad else None,
                                      [claims[i] for i in tern])
        return loss

    def _terngrad_update(self, group, view, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, claims) -> None:
        for flag in ("capturable", "differentiable", "fused"):
            if group[flag]:
                raise ValueError(f"horovod_terngrad.optim.{type(self).__name__}: {flag}=True is not supported for "
                                 f"parameters whose gradients TernGrad ternarizes (first: shape "
                                 f"{tuple(params[0].shape)}); leave {flag} unset")
        beta1, beta2 = group["betas"]
        corrected = group.get("refresh") is None
        by_kind: dict = {}
        estimates = {}
        states = [self.state[p] for p in params]
        ternary_counts = []
        for i, p in enumerate(params):
            state = states[i]
            if V_STEPS not in state:      # a state from torch's AdamW: v has had as many updates as steps so far
                state[V_STEPS] = state["step"].clone()
            if TERNARY_STEPS not in state:
                state[TERNARY_STEPS] = torch.zeros_like(state["step"])
            claim = claims[i]
            is_ternary = claim is not None and claim.record == precision.TERNARY
            if is_ternary:
                ternary_counts.append(state[TERNARY_STEPS])
                view.ternary.add(id(p))
            if corrected:
                refresh = True            # v is updated every step; n carries the noise to take out
                if NOISE not in state:
                    state[NOISE] = torch.zeros_like(p, memory_format=torch.preserve_format)
                got = precision.take_estimate(claim, p) if is_ternary else None
                estimates[i] = got
                if is_ternary and got is None and not _RefreshedAdam._warned_no_noise:
                    _RefreshedAdam._warned_no_noise = True
                    log.warning("horovod_terngrad.optim: no ternary noise estimate came with a gradient (shape %s): "
                                "the allgather, re-ternarized and requantized exchanges give one, flat or across "
                                "nodes (not 'sharded', nor a step with a rank in hvd.join()); its second moment takes "
                                "the ternary "
                                "gradient as plain AdamW does", tuple(p.shape))
            else:
                refresh = not is_ternary
                if not refresh and float(state[V_STEPS]) == 0:
                    # a ternary gradient before any exact one (a schedule without warm-up, a parameter added
                    # late): v from it beats a division by eps
                    refresh = True
                    if not _RefreshedAdam._warned_unrefreshed:
                        _RefreshedAdam._warned_unrefreshed = True
                        log.warning("horovod_terngrad.optim: a parameter (shape %s) got a ternary gradient before "
                                    "any full-precision one; its second moment starts from that", tuple(p.shape))
            by_kind.setdefault((p.device, p.dtype, refresh), []).append(i)
        # the host step counts (ternary steps, steps, v's updates) advanced by one foreach call and read in one go;
        # the bias corrections from them (torch's own non-capturable Adam does the same: no GPU sync)
        counts = [st["step"] for st in states]
        v_idx = [i for (_, _, refresh), idx in by_kind.items() if refresh for i in idx]
        view.advance(ternary_counts + counts + [states[i][V_STEPS] for i in v_idx])
        bias1, bias2_sqrt = _bias_corrections(view.read(counts), view.read([st[V_STEPS] for st in states]), beta1,
                                              beta2)
        for (device, dtype, refresh), idx in by_kind.items():
            b1, b2 = [bias1[i] for i in idx], [bias2_sqrt[i] for i in idx]
            if corrected:
                kernel = self._multi_tensor_kernel(device, dtype, params, grads, states, max_exp_avg_sqs, idx,
                                                   estimates)
                if kernel is not None:
                    self._multi_tensor_update(kernel, group, params, grads, states, max_exp_avg_sqs, idx, estimates,
                                              b1, b2)
                    continue
                if self._fused_cpu(device, dtype, params, grads, states, max_exp_avg_sqs, idx, estimates):
                    self._fused_corrected_update(group, params, grads, states, max_exp_avg_sqs, idx, estimates, b1,
                                                 b2)
                    continue
            self._foreach_update(group, params, grads, states, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, idx,
                                 estimates, refresh, b1, b2)

    def _foreach_update(self, group, params, grads, states, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, idx, estimates,
                        refresh, bias1, bias2_sqrt) -> None:
        """The update of ``idx`` as foreach ops (every device and dtype; the refresh mode everywhere)."""
        beta1, beta2 = group["betas"]
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        decoupled = group["decoupled_weight_decay"]
        corrected = group.get("refresh") is None
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
            ns = [_local(states[i][NOISE]) for i in idx]
            torch._foreach_mul_(ns, beta2)
            got = [(j, estimates.get(i)) for j, i in enumerate(idx)]
            got = [(j, x) for j, x in got if x is not None]
            if got:
                # n += (1 - β2)·noise·(|g|²/|average|² at the exchange): the gradient may have been scaled
                # since the exchange (clip, unscale), the noise with it squared.  The factors are computed as
                # one vector on the device (no host sync) and handed out as its 0-d views: a handful of
                # kernels per step, not five per tensor.  (The gradient as it came, before maximize's sign and
                # Adam's L2 term.)
                sq = torch.stack(torch._foreach_norm([_local(grads[idx[j]]) for j, _ in got], 2,
                                                     dtype=torch.float32))
                sq = sq * sq
                at = torch.stack([x.norm for _, x in got])
                at = at * at
                factor = (torch.where(at > 0, sq / at, torch.ones_like(sq)) * (1 - beta2)).unbind(0)
                torch._foreach_addcmul_([ns[j] for j, _ in got],
                                        [x.noise.view(ns[j].shape).to(ns[j].dtype) for j, x in got], factor)
        del gs
        if wd != 0 and decoupled:
            torch._foreach_mul_(ps, 1 - lr * wd)
        if corrected:
            # v_hat = max(v - n, f·v): the ternary noise out, never below the floor f.  Computed as
            # f·max((v - n)/f, v) in one temporary, the f folded into the bias correction: three passes
            # (fp32 on a CPU or a GPU takes one fused pass instead: _fused_corrected_update, _multi_tensor_update)
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

    @staticmethod
    def _fused_operands(params, grads, states, max_exp_avg_sqs, idx, estimates, device) -> bool:
        """Whether every tensor the fused pass of ``idx`` writes or reads is fp32, contiguous (it walks raw
        pointers) and on ``device``."""
        # dtype and device: the parameter's (``by_kind``), which torch holds its gradient and state to
        for i in idx:
            st = states[i]
            ts = (params[i], grads[i], st["exp_avg"], st["exp_avg_sq"], st[NOISE])
            if max_exp_avg_sqs is not None:
                ts += (max_exp_avg_sqs[i],)
            for t in ts:
                if not _local(t).is_contiguous():
                    return False
            got = estimates.get(i)
            if got is not None and got.noise.device != device:
                return False
        return True

    def _multi_tensor_kernel(self, device, dtype, params, grads, states, max_exp_avg_sqs, idx, estimates):
        """The multi-tensor kernel (backends/cuda_adam.py) for the default mode's update of ``idx``, or None: on
        CUDA, fp32 and contiguous, where CuPy is installed (``MULTI_TENSOR_KERNEL`` overrides: tests run the host
        build of the same source on a CPU)."""
        if dtype != torch.float32:
            return None
        kernel = MULTI_TENSOR_KERNEL if MULTI_TENSOR_KERNEL is not None else cuda_adam.kernel_for(device)
        if kernel is None or kernel.device != device.type:
            return None
        ok = self._fused_operands(params, grads, states, max_exp_avg_sqs, idx, estimates, device)
        return kernel if ok else None

    def _multi_tensor_update(self, kernel, group, params, grads, states, max_exp_avg_sqs, idx, estimates, bias1,
                             bias2_sqrt) -> None:
        """The default mode's update of ``idx`` (the foreach ops of ``_foreach_update``, the same formula:
        tg_adam_corrected's) in one launch of ``kernels/adam.cu``, after one foreach norm of the gradients that
        came with an estimate; the noise's factor is formed on the device."""
        beta1, beta2 = group["betas"]
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        decoupled = group["decoupled_weight_decay"]
        sts = [states[i] for i in idx]
        gs = [_local(grads[i]) for i in idx]
        noises, grad_norms, average_norms, need = [], [], [], []
        for j, i in enumerate(idx):
            got = estimates.get(i)
            if got is None:
                noises.append(None)
                grad_norms.append(None)
                average_norms.append(None)
                continue
            noise = got.noise
            noises.append(noise if noise.dtype == torch.float32 and noise.is_contiguous()
                          else noise.to(torch.float32).contiguous())
            average_norms.append(got.norm)
            grad_norms.append(None)
            need.append(j)
        if need:
            for j, nrm in zip(need, torch._foreach_norm([gs[j] for j in need], 2, dtype=torch.float32)):
                grad_norms[j] = nrm
        cuda_adam.adam_multi(
            kernel, [_local(params[i]) for i in idx], [_local(st["exp_avg"]) for st in sts],
            [_local(st["exp_avg_sq"]) for st in sts], [_local(st[NOISE]) for st in sts], gs, noises,
            None if max_exp_avg_sqs is None else [_local(max_exp_avg_sqs[i]) for i in idx], grad_norms,
            average_norms, [lr / b for b in bias1], [1 / b for b in bias2_sqrt], beta1=beta1, beta2=beta2, eps=eps,
            decay=1 - lr * wd if wd != 0 and decoupled else 1.0, l2=float(wd) if wd != 0 and not decoupled else 0.0,
            floor=float(group["v_floor"]), maximize=group["maximize"])

    def _fused_cpu(self, device, dtype, params, grads, states, max_exp_avg_sqs, idx, estimates) -> bool:
        """Whether the default mode's update of these parameters can take the fused C pass: CPU, fp32, every
        tensor it writes or reads contiguous (it walks raw pointers), the fused CPU backend loaded."""
        if not FUSED_CPU or device.type != "cpu" or dtype != torch.float32:
            return False
        be = backends.for_device(device)
        if not backends.has_capability(be, backends.ADAM_CORRECTED):
            return False
        return self._fused_operands(params, grads, states, max_exp_avg_sqs, idx, estimates, device)

    def _fused_corrected_update(self, group, params, grads, states, max_exp_avg_sqs, idx, estimates, bias1,
                                bias2_sqrt) -> None:
        """The default mode's update (the foreach ops of ``_foreach_update``, the same formula) as one C pass per
        tensor: on a CPU the factor |g|²/|average|² is read on the host for free."""
        be = backends.for_device(torch.device("cpu"))
        beta1, beta2 = group["betas"]
        lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
        decoupled = group["decoupled_weight_decay"]
        decay = 1 - lr * wd if wd != 0 and decoupled else 1.0
        l2 = float(wd) if wd != 0 and not decoupled else 0.0
        floor, maximize = float(group["v_floor"]), group["maximize"]
        for j, i in enumerate(idx):
            st = states[i]
            g = _local(grads[i])
            got = estimates.get(i)
            noise, coef = None, 0.0
            if got is not None:
                # kernels/adam.cu's arithmetic: the average's square in fp32, the gradient's in double
                at = float(got.norm.square())
                gn = float(torch.linalg.vector_norm(g, dtype=torch.float32))
                factor = (gn * gn) / at if at > 0 else 1.0
                noise, coef = got.noise.to(torch.float32).contiguous(), (1 - beta2) * factor
            be.adam_corrected(_local(params[i]), _local(st["exp_avg"]), _local(st["exp_avg_sq"]), _local(st[NOISE]),
                              g, noise, _local(max_exp_avg_sqs[i]) if max_exp_avg_sqs is not None else None,
                              beta1=beta1, beta2=beta2, step=lr / bias1[j], inv_bias2_sqrt=1 / bias2_sqrt[j],
                              eps=eps, decay=decay, l2=l2, noise_coef=coef, floor=floor, maximize=maximize)


def _bias_corrections(cs, vcs, beta1: float, beta2: float) -> tuple[list, list]:
    """(1 - β1^step, sqrt(1 - β2^v_steps)) per tensor from the step counts; computed once per distinct count (a
    group's tensors mostly share theirs)."""
    b1 = {c: 1 - beta1 ** c for c in set(cs)}
    b2 = {c: math.sqrt(1 - beta2 ** c) for c in set(vcs)}
    return [b1[c] for c in cs], [b2[c] for c in vcs]


class _GroupView:
    """One param group's view of its optimizer's ledger (``_RefreshedAdam._group_view``), and numpy views of its
    host step counters."""

    __slots__ = ("key", "group", "claims", "ternary", "_counters")

    def __init__(self, key, group, claims):
        self.key, self.group, self.claims = key, group, claims
        self.ternary: set = set()     # ids of the parameters on TernGrad's path for good
        self._counters: dict = {}     # id(counter) -> (counter, its numpy view): the counter kept alive with it

    def _arrays(self, counters) -> list | None:
        """numpy views of ``counters`` (host 0-d fp32 tensors, as torch's non-capturable Adam keeps ``step``), or
        None if one is not such a tensor."""
        cache, out = self._counters, []
        for t in counters:
            e = cache.get(id(t))
            if e is None or e[0] is not t:
                if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 0 or t.requires_grad:
                    return None
                e = cache[id(t)] = (t, t.numpy())
            out.append(e[1])
        return out

    def advance(self, counters) -> None:
        """counter += 1 for each of ``counters``: through the numpy views (a tenth of a CPU scalar op's cost; the
        same fp32 addition), else one foreach call."""
        arrays = self._arrays(counters)
        if arrays is None:
            torch._foreach_add_(counters, 1)
            return
        one = _ONE
        for a in arrays:
            np.add(a, one, out=a)

    def read(self, counters) -> list:
        """The counters' values as Python floats, without an op per tensor."""
        arrays = self._arrays(counters)
        if arrays is None:
            return torch.stack(counters).tolist() if counters else []
        return [float(a) for a in arrays]


_ONE = np.float32(1)


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
