"""The contract between an optimizer of horovod_terngrad.optim and the exchanges of its gradients.

An optimizer that treats ternary and exact gradients differently (TernGrad's Adam keeps ternary noise out of its
second moment) must know, for each gradient it applies, what the exchange did with it (``TERNARY``, a scheduled
``REFRESH`` at full precision, or ``FULL`` precision by policy), and in its default mode it needs the exchange's
ternary noise estimate of that gradient (the allgather transport's (1/N^2)·Σ_r (s_r·t_r)^2).  The pieces:

* **Who owns it.**  Each such optimizer owns one ``PrecisionLedger`` (as DeepSpeed's 1-bit optimizers own their
  compressed collective's state).  It holds, per parameter the optimizer *claims* (``PrecisionLedger.claim``):
  the request (a refresh schedule, or whether the noise estimate is wanted), the record of the parameter's last
  exchange, and the noise estimate with the buffer it lives in.  Nothing is kept at module level; every map is
  keyed weakly by parameter identity, so a parameter that is gone takes its entry with it, and a ledger goes
  with its optimizer.
* **How an exchange finds it.**  The DDP comm hook and FSDP's all-reduce hook see parameters, never the
  optimizer, so the ledger marks each parameter it claims with a weak reference to itself (the attribute
  ``LEDGER_ATTRIBUTE``); ``ledger_of(param)`` reads it.  Every frontend (Horovod's compressor too, although it
  knows its optimizer) and the simulator find the ledger that way, one code path.  Under FSDP2 the optimizer's
  parameters are the sharded DTensor parameters FSDP holds (``FSDPParam.sharded_param``), which are what the
  hook is given: the mark is on them.  A parameter claimed by two ledgers (two optimizers over one parameter, or
  ``hvd.DistributedOptimizer`` rebuilding an optimizer from its param groups) belongs to the last one to claim
  it; the earlier ledger lets go of it (that optimizer then gets no records for it: torch's update).  A copy of
  the parameter (``copy.deepcopy``, pickling) is claimed by nobody.
* **Who decides and records.**  The frontend, as it exchanges the gradient of a parameter the policy would
  ternarize, calls ``route(params, compressible)``: the ledger's schedule decides whether this exchange is a
  full-precision refresh, and the decision is recorded (REFRESH or TERNARY; FULL where the policy sends it at
  full precision) in the same call.  So the optimizer and the exchange never disagree about which steps were
  full precision: the one who decided is the one who wrote it down, per exchange, whatever happens between the
  exchange and the optimizer's step (accumulation, a GradScaler's skipped step, Horovod's
  ``backward_passes_per_step``).  The returned ``Route`` says whether to ternarize, and travels with the
  exchange's ticket (``Engine.start(..., route=)``), which then asks its transport for the noise estimate
  where the ledger wants it, written into the ledger's buffer for that parameter.
* **Who hands over.**  After the exchange the frontend calls ``deliver(ticket, average)``: the estimate (or its
  absence) goes to the ledger of the ticket's parameter, with the squared norm of the average then (whatever
  scales the gradient before the step, a norm clip or a GradScaler's unscale, scales the noise by the same
  factor squared, which the optimizer recovers from the two norms).
* **Who reads.**  The optimizer, in its step: ``record_of`` and ``take_noise`` of its own ledger.

Lifetime of an estimate: it is that of the parameter's last exchange before the step.  Starting an exchange that
wants one withdraws the previous estimate (its buffer is about to be rewritten); ``deliver`` sets the new one, or
none if the transport gave none (the sharded exchange, a rank in ``hvd.join()``, NaN/Inf); ``take_noise`` hands it
to the step once.  The buffer belongs to the parameter's ledger entry: on a CPU it is allocated once and reused
by every exchange of that parameter (a fresh buffer of every ternarized tensor's size per step is page-faulted in
anew: a third of the estimate's time on a CPU), never by another parameter's exchange; on an accelerator each
exchange's transport allocates it (the caching allocator reuses the memory without faults) and the ledger holds
it only from the exchange to the step.

Resume and elastic.  The decision is a pure function of the schedule and of the claiming optimizer's step count
of that parameter (its ``state[param]["step"]``): the same on every rank, restored by
``optimizer.load_state_dict`` on resume and by Horovod elastic's state sync, and not advanced by a step a
GradScaler skips, so a skipped refresh is taken again at the next exchange.  Every exchange before one optimizer
step (gradient accumulation without ``no_sync``) decides alike.  The ledger itself holds nothing to checkpoint.
Parameters nobody claimed are never refreshed: without ``horovod_terngrad.optim`` the exchanges are exactly what
they were.
"""
from __future__ import annotations

import weakref

import torch

from torch.utils.weak import WeakIdKeyDictionary

from ..codec.schedule import RefreshSchedule

TERNARY = "ternary"          # the gradient is TernGrad's unbiased ternary average
REFRESH = "refresh"          # a scheduled full-precision exchange of a gradient that is otherwise ternarized
FULL = "full"                # sent at full precision by policy (min_numel, exclude, a link where TernGrad does not pay)
RECORDS = (TERNARY, REFRESH, FULL)

# the attribute a ledger sets on each parameter it claims: a weak reference to the ledger
LEDGER_ATTRIBUTE = "_terngrad_precision_ledger"


def _local(t):
    """A DTensor's local shard (the same memory), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer_step(optimizer, param) -> int:
    """How many updates ``optimizer`` has applied to ``param`` (its state's ``step``; 0 before the first).  The
    count lives on the host unless the optimizer is capturable or fused: then reading it synchronizes."""
    state = optimizer.state.get(param)      # .get: the state is a defaultdict, and a lookup would add an entry
    step = state.get("step") if state else None
    return 0 if step is None else int(step)


class _LedgerRef:
    """The mark on a claimed parameter: a weak reference to its ledger.  A copy or a pickle of the parameter
    carries a dead one (the copy is not the parameter the optimizer updates; a weak reference does not pickle)."""

    __slots__ = ("_ref",)

    def __init__(self, ledger=None):
        self._ref = None if ledger is None else weakref.ref(ledger)

    def __call__(self):
        return None if self._ref is None else self._ref()

    def __reduce__(self):
        return (_LedgerRef, ())


class _Claim:
    """A ledger's entry for one parameter."""

    __slots__ = ("schedule", "noise", "record", "estimate", "norm", "buffer")

    def __init__(self, schedule, noise: bool):
        self.schedule = schedule     # RefreshSchedule or None (never refresh)
        self.noise = noise           # the optimizer wants the ternary noise estimate
        self.record = None           # TERNARY | REFRESH | FULL: what the last exchange did
        self.estimate = None         # the last exchange's noise estimate (flat), until the step takes it
        self.norm = None             # the fp32 norm of that exchange's average (0-d, on its device)
        self.buffer = None           # CPU: the estimate's memory, reused by every exchange of the parameter


class PrecisionLedger:
    """One optimizer's side of the contract (module docstring): its parameters' requests, the record of each
    one's last exchange, and their noise estimates.  Created by the optimizer, one per optimizer; it holds the
    optimizer weakly (the optimizer holds it), its parameters by weak identity."""

    def __init__(self, optimizer):
        self._optimizer = weakref.ref(optimizer)
        self._claims = WeakIdKeyDictionary()       # keyed by identity: a tensor's == is elementwise
        # moves whenever a parameter is claimed or let go of here: what the optimizer's per-group view of its
        # claims (optim/adam.py) is keyed by
        self.generation = 0

    @property
    def optimizer(self):
        """The optimizer that owns this ledger (None once it is gone)."""
        return self._optimizer()

    # -- the optimizer's side ---------------------------------------------------------------------------------------
    def claim(self, param, schedule: RefreshSchedule | None, noise: bool = False) -> None:
        """Ask every exchange of ``param``'s gradient to follow ``schedule`` (None: never refresh), counted in this
        ledger's optimizer's steps of it, and, with ``noise``, to hand over the ternary noise estimate with each
        ternary average.  The last ledger to claim a parameter is the one the exchanges serve."""
        if schedule is not None and not isinstance(schedule, RefreshSchedule):
            raise TypeError(f"schedule must be a RefreshSchedule or None, got {type(schedule).__name__}")
        previous = _marked(param)
        if previous is not None and previous is not self:
            previous._claims.pop(param, None)
            previous.generation += 1
        self.generation += 1
        claim = self._claims.get(param)
        if claim is None:
            self._claims[param] = _Claim(schedule, bool(noise))
        else:            # a claim renewed (load_state_dict): its record and estimate stay
            claim.schedule, claim.noise = schedule, bool(noise)
        try:
            setattr(param, LEDGER_ATTRIBUTE, _LedgerRef(self))
        except (AttributeError, TypeError) as e:
            raise TypeError(f"TernGrad: cannot mark parameter (shape {tuple(param.shape)}, "
                            f"{type(param).__name__}) with its optimizer's ledger: {e}") from e

    def release(self, param) -> None:
        """Let go of ``param``: its request, record and estimate; exchanges no longer ask this ledger."""
        self._claims.pop(param, None)
        self.generation += 1
        if _marked(param) is self:
            delattr(param, LEDGER_ATTRIBUTE)

    def holds(self, param) -> bool:
        return param is not None and param in self._claims

    def schedule_of(self, param) -> RefreshSchedule | None:
        claim = self._claims.get(param) if param is not None else None
        return None if claim is None else claim.schedule

    def wants_noise(self, param) -> bool:
        """Whether exchanges of ``param`` are asked for the ternary noise estimate."""
        claim = self._claims.get(param) if param is not None else None
        return claim is not None and claim.noise

    def step_of(self, param) -> int:
        """The optimizer's step count of ``param``: what the schedule is read at."""
        optimizer = self._optimizer()
        return 0 if optimizer is None else optimizer_step(optimizer, param)

    def record_of(self, param) -> str | None:
        """What the last exchange of ``param``'s gradient was (None: never exchanged by TernGrad since claimed)."""
        claim = self._claims.get(param) if param is not None else None
        return None if claim is None else claim.record

    def noise_of(self, param):
        """(flat noise estimate, squared norm of the average) held for the step, without taking it; or None."""
        claim = self._claims.get(param) if param is not None else None
        return None if claim is None or claim.estimate is None else (claim.estimate, claim.norm.square())

    def take_noise(self, param):
        """(noise estimate shaped as ``param``'s local tensor, squared norm of the average at the exchange) of the
        last exchange, once; None if it gave none, or it was taken already."""
        claim = self._claims.get(param) if param is not None else None
        got = None if claim is None else take_estimate(claim, param)
        return None if got is None else (got.noise.view(_local(param).shape), got.norm.square())

    def claims_of(self, params) -> dict:
        """{id(param): its claim} of those of ``params`` this ledger holds (the optimizer's per-group view; valid
        while ``generation`` stays)."""
        claims = self._claims
        return {id(p): claims[p] for p in params if p in claims}

    # -- what an exchange writes (``route`` and ``deliver`` call these; public for tests and benchmarks that
    # -- drive the optimizer without an exchange)
    def set_record(self, param, record: str) -> None:
        """Record what an exchange of ``param``'s gradient did (TERNARY, REFRESH or FULL)."""
        if record not in RECORDS:
            raise ValueError(f"record must be one of {RECORDS}, got {record!r}")
        claim = self._claims.get(param)
        if claim is None:
            raise KeyError(f"TernGrad: a parameter of shape {tuple(param.shape)} is not claimed by this ledger")
        claim.record = record

    def put_noise(self, param, noise: torch.Tensor | None, average: torch.Tensor | None) -> None:
        """Hand over the noise estimate of ``param``'s average (None: the exchange gave none), and the average."""
        claim = self._claims.get(param)
        if claim is None:
            raise KeyError(f"TernGrad: a parameter of shape {tuple(param.shape)} is not claimed by this ledger")
        _store(claim, noise, average)


def _marked(param) -> "PrecisionLedger | None":
    ref = getattr(param, LEDGER_ATTRIBUTE, None)
    return ref() if isinstance(ref, _LedgerRef) else None


def ledger_of(param) -> PrecisionLedger | None:
    """The ledger whose optimizer claimed ``param`` (None: no parameter, nobody claimed it, or its optimizer is
    gone)."""
    if param is None:
        return None
    ledger = _marked(param)
    if ledger is None or ledger.optimizer is None or param not in ledger._claims:
        return None
    return ledger


class Estimate:
    """A noise estimate taken for the step: ``noise`` as the exchange gave it (flat, or any shape of the parameter's
    local element count), ``norm`` the fp32 norm of the exchange's average (0-d, on its device).  The step takes
    the gradient's own norm again: a write through ``.data`` or a raw pointer (a fused clipping kernel) would not
    show in the gradient's version counter."""

    __slots__ = ("noise", "norm")

    def __init__(self, noise, norm):
        self.noise, self.norm = noise, norm


def take_estimate(claim: _Claim, param) -> Estimate | None:
    """The claim's estimate for the step (``Estimate``), once; None if the last exchange gave none, or it was
    taken already.  A count that is not the parameter's local one is an error naming the shape."""
    noise = claim.estimate
    if noise is None:
        return None
    claim.estimate = None
    local = _local(param)
    if noise.numel() != local.numel():
        raise ValueError(f"TernGrad: the noise estimate of a parameter of shape {tuple(local.shape)} holds "
                         f"{noise.numel()} elements")
    return Estimate(noise, claim.norm)


def _store(claim: _Claim, noise, average) -> None:
    if noise is None:
        claim.estimate = claim.norm = None
        return
    claim.estimate = noise
    claim.norm = torch.linalg.vector_norm(average.detach(), dtype=torch.float32)


class Route:
    """What ``route`` decided for one exchange of a gradient: whether it is ternarized (``ternary``), and, where
    the gradient's parameter's ledger wants it, the claim its noise estimate goes to (``noise``).  Handed to
    ``Engine.start`` / ``start_group``, it rides on the ticket to ``deliver``."""

    __slots__ = ("ternary", "_claim")

    def __init__(self, ternary: bool, claim: _Claim | None = None):
        self.ternary = ternary
        self._claim = claim

    @property
    def noise(self) -> bool:
        """Whether this exchange is asked for the ternary noise estimate."""
        return self._claim is not None

    def arm(self, ticket) -> None:
        """Set up ``ticket`` (the exchange's, just started) to follow this route: ask its transport for the noise
        estimate where wanted, written into the claim's buffer on a CPU (``ticket.noise_out``).  The claim's
        previous estimate is withdrawn: the buffer is about to be rewritten, and this exchange's estimate (or
        its absence) is the one the step should see.  Called by the engine; every rank arms alike."""
        ticket.route = self
        claim = self._claim
        if claim is None:
            return
        ticket.want_noise = True
        claim.estimate = claim.norm = None
        g32 = ticket.g32
        if g32.device.type != "cpu":
            return                  # the transport allocates it: no fault on an accelerator, freed after the step
        if claim.buffer is None or claim.buffer.numel() != g32.numel():
            claim.buffer = torch.empty(g32.numel(), dtype=torch.float32)
        ticket.noise_out = claim.buffer


FULL_PRECISION = Route(False)       # the route of a gradient nobody claimed that the policy sends at full precision


def route(params, compressible: bool) -> Route:
    """Decide and record the precision of one exchange of the gradients of ``params`` (which travel as one
    tensor: one parameter, or several in FSDP's flat-shard fallback; None entries for tensors that belong to no
    parameter, such as a direct ``hvd.allreduce``).  ``compressible``: whether the policy would ternarize it.

    The ledgers of the claimed parameters record FULL where not compressible; else REFRESH where any of their
    schedules marks the step its optimizer is about to take of that parameter (then the exchange goes at full
    precision), TERNARY otherwise.  Unclaimed parameters are always ternary where compressible and get no
    record.  The noise estimate is asked for where the gradient is ternarized, belongs to one parameter, and
    that parameter's ledger wants it."""
    claims = []
    for param in params:
        ledger = ledger_of(param)
        if ledger is not None:
            claims.append((ledger, param, ledger._claims[param]))
    if not compressible:
        for _, _, claim in claims:
            claim.record = FULL
        return FULL_PRECISION
    refresh = any(claim.schedule is not None and claim.schedule.full_precision(ledger.step_of(param))
                  for ledger, param, claim in claims)
    for _, _, claim in claims:
        claim.record = REFRESH if refresh else TERNARY
    if refresh:
        return Route(False)
    noisy = claims[0][2] if len(params) == 1 and claims and claims[0][2].noise else None
    return Route(True, noisy)


def deliver(ticket, average: torch.Tensor) -> None:
    """After ``ticket``'s exchange returned ``average``: hand its noise estimate (or the news that none came) to
    the ledger its route named.  A ticket without a route, or whose route wants no estimate, is left alone."""
    route_ = getattr(ticket, "route", None)
    claim = None if route_ is None else route_._claim
    if claim is not None:
        _store(claim, ticket.noise, average)


__all__ = ["TERNARY", "REFRESH", "FULL", "RECORDS", "LEDGER_ATTRIBUTE", "PrecisionLedger", "Route", "FULL_PRECISION",
           "Estimate", "take_estimate", "ledger_of", "route", "deliver", "optimizer_step"]
