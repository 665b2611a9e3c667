"""``OwnerStepOptimizer``: each rank steps its own shard of the weights; 3.2 bits per element received at any N.

Wraps an optimizer class (``horovod_terngrad.optim.AdamW`` by default) the way ``ZeroRedundancyOptimizer``
does, and owns the exchange its step runs (exchange/owner_step.py), as DeepSpeed's 1-bit optimizers own theirs:

    opt = OwnerStepOptimizer(model.named_parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0,
                             collectives="horovod")          # or "torch" (torch.distributed), or a Collectives
    for batch in data:
        loss_fn(model(batch)).backward()                     # local gradients: no DDP / DistributedOptimizer
        opt.step(); opt.zero_grad()

One ``step``: (1) every rank's gradients, ternarized, go to the shards' owners, who decode the exact average of
their shard and its noise estimate; (2) each owner's inner optimizer steps its shard of the fp32 master weights
with them (the global norm clip, ``max_grad_norm``, costs one allgather of a scalar); (3) each owner sends every
rank its shard's weight difference against the replica, rounded to the nearest ternary level, and every rank
adds it to the model's parameters, which are the replica the next forward pass runs on.  The replica stays within
one step of the master (codec/nearest.py).  Parameters the config keeps at full precision (``min_numel``,
``exclude``) are averaged in fp32 and stepped by every rank.

Measured (docs/scale.md, whole runs at N = 16, 3 seeds, at fp32 AdamW's best lr): a Llama 2x64 over 3 epochs,
+0.30% held-out loss against fp32 AdamW at 3.68 bits per element received, where the requantized exchange's
default is +0.89% at 7.62 bits; a GPT-2 2x64 over one epoch of a small corpus, +1.57% (at a higher lr, its own
best, 0.49% below fp32's best).

The rules it keeps:

* Every rank calls ``step`` every step (its collectives are fused over all parameters); a rank without a
  gradient for a parameter sends zeros.  ``hvd.join()`` cannot apply (the alltoall needs every rank): a joined
  rank's peers get Horovod's error.
* A NaN/Inf in any rank's gradient skips the step on every rank (no update of masters or replicas; the step
  count still moves, so the random streams stay a function of it) and logs the tensors once per run, as
  ``GradScaler`` skips; with ``config.on_nonfinite="raise"`` every rank raises ``NonFiniteGradientError``.
* ``state_dict`` holds this rank's shards (masters, the inner optimizer's state, the step count) and the layout;
  a checkpoint is one file per rank, as with DCP.  ``load_state_dict`` needs the same world size, rank and
  parameters, and says which differs otherwise.  The model's own ``state_dict`` holds the replica.  A run resumed
  from both continues bit for bit.
* The masters are copied from the parameters at the first step, after a check that every rank holds the same
  ones (DDP and Accelerate's ``prepare`` broadcast rank 0's after the optimizer is built; on Horovod, call
  ``hvd.broadcast_parameters`` first).  ``hvd.broadcast_optimizer_state`` and elastic's ``TorchState`` do not
  apply: the state is each rank's own shard.
* Mixed precision: bf16 autocast works as it is.  fp16's ``GradScaler`` works through its custom-optimizer
  contract (``scaler.step(opt)`` hands the scaler to ``step``, which torch marks as deprecated with a
  ``FutureWarning``): the scaler's own overflow check would read ``param_groups``' gradients, the owners' shards,
  empty before the exchange, so ``step`` unscales the local gradients itself, and records the ranks' common
  verdict (NaN/Inf in any rank's gradient) as the scaler's check: every rank skips the same steps and every
  rank's scale moves the same way.  Those skips are the scaler's probing, so they neither log nor raise.
* ``param_groups`` are the inner optimizer's (their ``params`` are the shards): learning-rate schedulers and
  ``group["lr"] = ...`` work as usual.
"""
from __future__ import annotations

import logging

import torch

from ..codec.sizes import reternarized_bounds
from ..config import TernGradConfig
from ..errors import NonFiniteGradientError, TernGradError
from ..exchange import precision
from ..exchange.owner_step import OwnerStepExchange

log = logging.getLogger("horovod_terngrad")


def _collectives(spec):
    if spec == "horovod":
        from ..exchange.hvd_collectives import HorovodCollectives
        return HorovodCollectives()
    if spec == "torch":
        from ..exchange.dist_collectives import DistCollectives
        return DistCollectives()
    if hasattr(spec, "alltoall_async") and hasattr(spec, "rank"):
        return spec
    raise ValueError(f"collectives must be 'horovod', 'torch' or a Collectives object, got {spec!r}")


def _named_groups(named_parameters) -> list:
    """[{options..., "params": [(name, tensor), ...]}] from named_parameters() or from such groups."""
    items = list(named_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g, params=list(g["params"])) for g in items]
    else:
        groups = [{"params": items}]
    seen = set()
    for g in groups:
        for entry in g["params"]:
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
                    and isinstance(entry[1], torch.Tensor)):
                raise TypeError("OwnerStepOptimizer takes (name, parameter) pairs, as model.named_parameters() "
                                f"gives, or groups of them; got {type(entry).__name__}")
            if entry[0] in seen:
                raise ValueError(f"OwnerStepOptimizer: parameter name '{entry[0]}' appears twice")
            seen.add(entry[0])
    return groups


class OwnerStepOptimizer(torch.optim.Optimizer):
    """Each rank steps its own shard of the weights with ``optimizer_class`` (module docstring).

    ``named_parameters``: (name, parameter) pairs, or param groups of them (names must agree across ranks: they
    key the random streams and the layout).  ``collectives``: "horovod", "torch" or a ``Collectives``.
    ``config``: the codec's settings (default ``TernGradConfig(packing="base3", levels=3)``: ternary gradients, 3.2
    bits per element in all; ``levels=4`` sends the gradients in the four-level code, 2 bits, for 3.6).  ``max_grad_norm``: clip the
    global norm of the averaged gradient (None: no clip).  ``weight_bucket_size``: one scaler per that many
    elements of each shard's weight difference (0: one per shard); finer rounding of the replica for (N-1)/N·32/K
    bits more per element received.  Other keywords go to ``optimizer_class``."""

    # GradScaler leaves the unscaling and the overflow check to such an optimizer: its own check reads
    # param_groups' gradients, which are the owners' shards, empty until the exchange has run (step, below)
    _step_supports_amp_scaling = True

    def __init__(self, named_parameters, optimizer_class=None, *, collectives="horovod", config=None,
                 max_grad_norm=None, weight_bucket_size: int = 0, name: str = "terngrad.os", **defaults):
        if optimizer_class is None:
            from .adam import AdamW
            optimizer_class = AdamW
        self.config = config if config is not None else TernGradConfig(packing="base3", levels=3)
        self.coll = _collectives(collectives)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        groups = _named_groups(named_parameters)
        self.names, self.params, self.ternary = [], [], []
        for g in groups:
            for n, p in g["params"]:
                if p.requires_grad:
                    if not p.is_contiguous():
                        raise ValueError(f"OwnerStepOptimizer: parameter '{n}' (shape {tuple(p.shape)}) is not "
                                         f"contiguous: the owners' differences are added to it in place")
                    self.names.append(n)
                    self.params.append(p)
                    self.ternary.append(self.coll.size > 1 and self.config.compresses(n, p.numel()))
        self._build_shards(groups, optimizer_class, defaults)
        torch.optim.Optimizer.__init__(self, [{"params": []}], {})
        self.param_groups, self.state, self.defaults = self.inner.param_groups, self.inner.state, self.inner.defaults
        self._ledger = getattr(self.inner, "precision_ledger", None)
        tern = [i for i, t in enumerate(self.ternary) if t]
        # whether a tensor's shards carry the squares for the noise estimate: read from its group's options, which
        # every rank shares (a rank that owns no shard of it has no claim to ask)
        noise = [self._ledger is not None and self.inner.param_groups[self._group_of[i]].get("refresh", 0) is None
                 for i in tern]
        self.weight_bucket_size = int(weight_bucket_size)
        self.exchange = OwnerStepExchange(self.coll, self.config,
                                          [(self.names[i], self.params[i].numel()) for i in tern], noise, name,
                                          weight_bucket=self.weight_bucket_size)
        self._tern, self._exact = tern, [i for i, t in enumerate(self.ternary) if not t]
        self.steps = 0
        self._masters_current = False   # the masters are copied from the replica at the first step (below)
        self.skipped_steps = 0
        self.last_grad_norm = None
        self._warned_nonfinite = False
        self._warned_unscale = False

    def _build_shards(self, groups, optimizer_class, defaults) -> None:
        """The inner optimizer over this rank's fp32 master shards (ternarized parameters) and the parameters
        themselves (full precision), group by group with the user's options."""
        N, me = self.coll.size, self.coll.rank
        self.shards, self._group_of = [], []
        inner_groups, k = [], 0
        for gi, g in enumerate(groups):
            members = []
            for n, p in g["params"]:
                if not p.requires_grad:
                    continue
                if self.ternary[k]:
                    lo, hi = reternarized_bounds(p.numel(), N, self.config.bucket_size)[me]
                    shard = p.detach().reshape(-1)[lo:hi].to(torch.float32).clone() if hi > lo else None
                    self.shards.append(shard)
                    if shard is not None:
                        members.append(shard)
                else:
                    self.shards.append(None)
                    members.append(p)
                self._group_of.append(gi)
                k += 1
            inner_groups.append({**{key: v for key, v in g.items() if key != "params"}, "params": members})
        self.inner = optimizer_class(inner_groups, **defaults)

    @classmethod
    def from_optimizer(cls, optimizer, named_parameters, **kwargs) -> "OwnerStepOptimizer":
        """An owner-step optimizer with ``optimizer``'s class, param groups and options (built, not yet stepped),
        for scripts that build their optimizer first: ``torch.optim.Adam`` / ``AdamW`` become
        ``horovod_terngrad.optim.Adam`` / ``AdamW`` (the same update, with ternary noise kept out of v).
        ``named_parameters``: the model's (names key the streams); ``kwargs``: ``collectives``, ``config``,
        ``max_grad_norm``, ``name``."""
        import inspect

        from .adam import Adam, AdamW
        if any(optimizer.state.values()):
            raise ValueError("OwnerStepOptimizer.from_optimizer: the optimizer has taken steps; build the "
                             "owner-step optimizer before the first step (its state lives in the owners' shards)")
        names = {id(p): n for n, p in named_parameters}
        groups = []
        for g in optimizer.param_groups:
            unnamed = [tuple(p.shape) for p in g["params"] if id(p) not in names]
            if unnamed:
                raise ValueError(f"OwnerStepOptimizer.from_optimizer: parameters of shapes {unnamed[:4]} are not "
                                 f"in named_parameters")
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [(names[id(p)], p) for p in g["params"]]})
        klass = {torch.optim.AdamW: AdamW, torch.optim.Adam: Adam}.get(type(optimizer), type(optimizer))
        accepted = inspect.signature(klass.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
        return cls(groups, klass, **kwargs, **defaults)

    # -- the step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """One owner step (module docstring).  ``grad_scaler``: the ``torch.amp.GradScaler`` whose ``step`` calls
        this one, which passes itself: the local gradients are unscaled here and the ranks' common NaN/Inf verdict
        becomes its overflow check."""
        loss = None
        if grad_scaler is None and getattr(self, "grad_scale", None) is not None:
            raise TernGradError("OwnerStepOptimizer: this torch's GradScaler did not pass itself to step(), so the "
                                "ranks' overflow verdict cannot reach it (its own check reads param_groups' "
                                "gradients, the owners' shards). Use bf16 autocast (no scaler), or fp16 with "
                                "hvd.DistributedOptimizer / the DDP hook")
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._masters_current:
            self._start_from_replica()
        if grad_scaler is not None:
            self._unscale(grad_scaler)
        ex, step = self.exchange, self.steps
        self.steps += 1
        grads = [self._grad(i) for i in self._tern]
        handles = ex.send_gradients(grads, step)
        exact = ex.exact_average([self._grad(i) for i in self._exact])
        bad = ex.nonfinite(handles)
        owned = ex.owned_averages(handles)
        skip = bool(bad) or not all(bool(torch.isfinite(a).all()) for a in exact)
        if grad_scaler is not None:
            self._record_overflow(grad_scaler, skip)
        if skip:
            return self._skip(bad or [self.names[i] for i in self._exact], scaled=grad_scaler is not None)
        self._hand_over(owned, exact)
        if self.max_grad_norm is not None:
            self._clip(owned, exact)
        self.inner.step()
        deltas = []
        for j, i in enumerate(self._tern):
            lo, hi = ex.owned[j]
            shard = self.shards[i]
            deltas.append(None if shard is None else shard - self.params[i].detach().reshape(-1)[lo:hi].float())
        device = self.params[self._tern[0]].device if self._tern else None
        ex.apply_weights(ex.send_weights(deltas, device), [self.params[i].data.view(-1) for i in self._tern])
        return loss

    def _start_from_replica(self) -> None:
        """Before the first step (of a run not loaded from a checkpoint): check that every rank holds the same
        parameters, then copy each master shard from them.  Why here and not at construction: DDP, and
        Accelerate's ``prepare``, broadcast rank 0's parameters after the optimizer was built."""
        local = torch.zeros((), dtype=torch.float64)
        for k, p in enumerate(self.params):
            local += (p.detach().double().sum() * (k + 1) + p.detach().double().square().sum()).cpu()
        every = self.exchange.scalars(local, "check")       # the same vector on every rank: one decision
        if not bool((every == every[0]).all()) and not bool(every.isnan().any()):
            raise TernGradError("OwnerStepOptimizer: the ranks' parameters differ at the first step: broadcast "
                                "them first (hvd.broadcast_parameters(model.state_dict(), root_rank=0); DDP does "
                                "it when it wraps the model)")
        for (lo, hi), i in zip(self.exchange.owned, self._tern):
            if self.shards[i] is not None:
                self.shards[i].copy_(self.params[i].detach().reshape(-1)[lo:hi])
        self._masters_current = True

    def _unscale(self, grad_scaler) -> None:
        """Divide the local gradients by the scaler's scale in place, as ``GradScaler.unscale_`` would (its
        reciprocal in fp64, applied in fp32): a power of two, so exact.  After the user's ``scaler.unscale_(opt)``
        only the ternarized parameters' gradients are left: that call unscaled the full-precision ones, which
        param_groups hold themselves."""
        state = grad_scaler._per_optimizer_states[id(self)]
        unscaled = state["stage"].name == "UNSCALED"
        if unscaled and not self._warned_unscale:
            self._warned_unscale = True     # the clip-after-unscale_ recipe would clip still-scaled gradients
            log.warning("horovod_terngrad: scaler.unscale_(OwnerStepOptimizer) reaches only the full-precision "
                        "parameters (param_groups hold the owners' shards); step() unscales the others. Clip the "
                        "averaged gradient with OwnerStepOptimizer(max_grad_norm=...), not clip_grad_norm_")
        inv = grad_scaler._get_scale_async().double().reciprocal().float()
        grads = [self.params[i].grad for i in (self._tern if unscaled else range(len(self.params)))
                 if self.params[i].grad is not None]
        if grads:
            torch._foreach_mul_(grads, inv.to(grads[0].device))

    def _record_overflow(self, grad_scaler, skip: bool) -> None:
        """The ranks' common verdict as the scaler's overflow check of this optimizer (what its ``update`` reads,
        so every rank's scale moves the same way)."""
        scale = grad_scaler._get_scale_async()
        found = torch.full((), float(skip), dtype=torch.float32, device=scale.device)
        grad_scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {scale.device: found}

    def _grad(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _hand_over(self, owned: list, exact: list) -> None:
        """The owners' averages become their shards' gradients, with the noise estimate handed to the inner
        optimizer's ledger; the full-precision averages become those parameters' gradients."""
        ledger = self._ledger
        for j, i in enumerate(self._tern):
            shard = self.shards[i]
            if shard is None:
                continue
            avg, noise = owned[j]
            shard.grad = avg
            if ledger is not None and ledger.holds(shard):
                ledger.set_record(shard, precision.TERNARY)
                ledger.put_noise(shard, noise, avg)
        for i, avg in zip(self._exact, exact):
            p = self.params[i]
            p.grad = avg.to(p.dtype).clone()
            if ledger is not None and ledger.holds(p):
                ledger.set_record(p, precision.FULL)

    def _clip(self, owned: list, exact: list) -> None:
        """Scale every gradient by min(1, max_norm / (‖average‖ + 1e-6)), the norm summed over the owners' shards
        and (once, on rank 0) the full-precision averages, in rank order: the same factor on every rank."""
        local = torch.zeros((), dtype=torch.float64)
        for got in owned:
            if got is not None:
                local += got[0].double().square().sum().cpu()
        if self.coll.rank == 0:
            for a in exact:
                local += a.double().square().sum().cpu()
        norm = float(self.exchange.scalar_sum(local).sqrt())
        self.last_grad_norm = norm
        coef = self.max_grad_norm / (norm + 1e-6)
        if coef < 1.0:
            for got in owned:
                if got is not None:
                    got[0].mul_(coef)
            for i in self._exact:
                self.params[i].grad.mul_(coef)

    def _skip(self, names: list, scaled: bool = False):
        if scaled:                  # the loss scale overflowed: the scaler's probing, which its update() answers
            self.skipped_steps += 1
            return None
        if self.config.on_nonfinite == "raise":
            raise NonFiniteGradientError(f"TernGrad: gradient(s) {names[:8]} hold NaN or Inf on at least one rank "
                                         f"(owner-step exchange, step {self.steps - 1})")
        self.skipped_steps += 1
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            log.warning("horovod_terngrad: owner-step skipped step %d on every rank: NaN or Inf in %s on at least "
                        "one rank (further skips are counted in skipped_steps)", self.steps - 1, names[:8])
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    # -- state ---------------------------------------------------------------------------------------------------
    def _layout(self) -> dict:
        return {"world": self.coll.size, "rank": self.coll.rank, "names": list(self.names),
                "numels": [p.numel() for p in self.params], "ternary": list(self.ternary),
                "packing": self.config.packing, "bucket_size": self.config.bucket_size,
                "weight_bucket_size": self.weight_bucket_size}

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "steps": self.steps, "skipped_steps": self.skipped_steps,
                "masters": [s.clone() for s in self.shards if s is not None], "layout": self._layout()}

    def load_state_dict(self, state_dict: dict) -> None:
        # a checkpoint from before weight buckets existed rounded with one scaler per shard
        mine, theirs = self._layout(), {"weight_bucket_size": 0, **state_dict.get("layout", {})}
        for key in mine:
            if theirs.get(key) != mine[key]:
                shown = (lambda v: v if not isinstance(v, list) or len(v) < 6 else f"{v[:3]}... ({len(v)})")
                raise TernGradError(f"OwnerStepOptimizer.load_state_dict: the checkpoint's {key} is "
                                    f"{shown(theirs.get(key))}, this optimizer's {shown(mine[key])}: an owner-step "
                                    f"checkpoint holds one rank's shards and loads into the same rank of the same "
                                    f"world and parameters")
        masters = iter(state_dict["masters"])
        for s in self.shards:
            if s is not None:
                s.copy_(next(masters))
        self.inner.load_state_dict(state_dict["inner"])
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        self.steps, self.skipped_steps = int(state_dict["steps"]), int(state_dict.get("skipped_steps", 0))
        self._masters_current = True

    def bits_received(self) -> float:
        """This rank's payload bits received per ternarized element per step, so far (both stages)."""
        elements = sum(self.params[i].numel() for i in self._tern) * max(1, self.steps)
        return 8.0 * self.exchange.bytes_received / max(1, elements)


__all__ = ["OwnerStepOptimizer"]
