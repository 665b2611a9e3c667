"""What an exchange did with each parameter's gradient, for the optimizers that must know (horovod_terngrad.optim).

An optimizer that treats ternary and exact gradients differently (TernGrad's Adam keeps ternary noise out of its
second moment) *requests* for its parameters either the exchange's noise estimate (``noise``: the allgather
transport's (1/N^2)·Σ_r (s_r·t_r)^2, handed over with the average by ``attach_noise``) or a refresh schedule.
Every frontend (Horovod's compressor, the DDP hook, the FSDP hook), when it exchanges the gradient of a parameter
it would ternarize, asks ``decide`` whether this exchange is one of the schedule's full-precision refreshes, and
*records* what it did.  The optimizer then reads the record (and the estimate) of each gradient it applies.  So the two never disagree about which steps were full precision:
the one who decided is the one who wrote it down, per exchange, whatever happened between the exchange and the
optimizer's step (accumulation, a GradScaler's skipped step, Horovod's ``backward_passes_per_step``).

The decision is a pure function of the schedule and of the requesting optimizer's step count of that parameter
(its ``state[param]["step"]``): the same on every rank, restored by ``optimizer.load_state_dict`` on resume and
by Horovod elastic's state sync, and not advanced by a step a GradScaler skips, so a skipped refresh is taken
again at the next exchange.  Every exchange before one optimizer step (gradient accumulation without
``no_sync``) decides alike.  Parameters nobody requested are never refreshed: without ``horovod_terngrad.optim``
the exchanges are exactly what they were.

Both maps are weak: a parameter that is gone takes its request and record with it.
"""
from __future__ import annotations

import weakref

import torch

from torch.utils.weak import WeakIdKeyDictionary

from ..codec.schedule import RefreshSchedule

TERNARY = "ternary"          # the gradient is TernGrad's unbiased ternary average
REFRESH = "refresh"          # a scheduled full-precision exchange of a gradient that is otherwise ternarized
FULL = "full"                # sent at full precision by policy (min_numel, exclude, a link where TernGrad does not pay)

# keyed by identity: a tensor's == is elementwise
_requests = WeakIdKeyDictionary()     # parameter -> (schedule, weakref(optimizer))
_records = WeakIdKeyDictionary()      # parameter -> TERNARY | REFRESH | FULL
_noise = WeakIdKeyDictionary()        # parameter -> (noise estimate, squared norm of the average)


def request(param, schedule: RefreshSchedule | None, optimizer, noise: bool = False) -> None:
    """Ask every exchange of ``param``'s gradient to follow ``schedule`` (None: never refresh), counted in
    ``optimizer``'s steps of it, and, with ``noise``, to hand over the ternary noise estimate with each ternary
    average (``attach_noise``); an optimizer calls it for its parameters (the last one to ask is the one counted)."""
    if schedule is not None and not isinstance(schedule, RefreshSchedule):
        raise TypeError(f"schedule must be a RefreshSchedule or None, got {type(schedule).__name__}")
    _requests[param] = (schedule, weakref.ref(optimizer), bool(noise))


def wants_noise(param) -> bool:
    """Whether the exchange should estimate the ternary noise of ``param``'s average (allgather.noise_estimate)."""
    req = _requests.get(param) if param is not None else None
    return req is not None and req[2] and req[1]() is not None


def attach_noise(param, noise, average) -> None:
    """The ternary noise estimate of ``param``'s average, and the average's squared norm then (a 0-d tensor on its
    device): whatever scales the gradient between the exchange and the step (a norm clip, a GradScaler's unscale)
    scales the noise by the same factor squared, which the optimizer recovers from the two norms."""
    _noise[param] = (noise, torch.linalg.vector_norm(average.detach(), dtype=torch.float32).square())


def take_noise(param):
    """(noise, squared norm of the average at the exchange) attached since the last call, or None."""
    return _noise.pop(param, None)


def withdraw(param) -> None:
    _requests.pop(param, None)
    _records.pop(param, None)
    _noise.pop(param, None)


def schedule_of(param) -> RefreshSchedule | None:
    req = _requests.get(param) if param is not None else None
    return None if req is None or req[1]() is None else req[0]


def optimizer_step(optimizer, param) -> int:
    """How many updates ``optimizer`` has applied to ``param`` (its state's ``step``; 0 before the first).  The
    count lives on the host unless the optimizer is capturable or fused: then reading it synchronizes."""
    state = optimizer.state.get(param)      # .get: the state is a defaultdict, and a lookup would add an entry
    step = state.get("step") if state else None
    return 0 if step is None else int(step)


def decide(*params) -> bool:
    """For a gradient the policy would ternarize (the gradients of ``params``, which travel together): whether this
    exchange is a full-precision refresh, i.e. whether the schedule marks the step the requesting optimizer is
    about to take (for any of them).  Records the answer (REFRESH or TERNARY) for the optimizer.  Parameters
    without a request (or None) are always ternary and get no record."""
    refresh, asked = False, []
    for param in params:
        req = _requests.get(param) if param is not None else None
        optimizer = None if req is None else req[1]()
        if optimizer is not None:
            asked.append(param)
            refresh = refresh or (req[0] is not None and req[0].full_precision(optimizer_step(optimizer, param)))
    for param in asked:
        _records[param] = REFRESH if refresh else TERNARY
    return refresh


def record_full(*params) -> None:
    """The gradients of ``params`` went at full precision by policy this exchange."""
    for param in params:
        if param is not None and param in _requests:
            _records[param] = FULL


def record_of(param) -> str | None:
    """What the last exchange of ``param``'s gradient was (None: never exchanged by TernGrad with a request)."""
    return _records.get(param)
