"""One DDP bucket's exchange: what the TernGrad hook does with each bucket DDP hands over (ddp.py has the math).

* ``start``: each parameter's slice of the bucket goes one of two ways, as the policy and
  ``precision.route`` decide: the compressed ones as fused groups of the exchange engine (``Engine.start_group``;
  groups cut by ``exchange.fusion.cut``, ramped from ``RAMP_NUMEL``), the others as one allreduce-sum of their
  fp32 values;
* ``finish``: wait for both, write the averages into the bucket (the engine decodes in place where it can),
  apply ``on_nonfinite`` to the full-precision ones, and complete the bucket's future, with its value or with
  the first error;
* ``step``: the schedule.  Start bucket i, then finish bucket i-1; finish the last bucket of the iteration
  (``bucket.is_last()``) at once, and every bucket when the state is synchronous.  A pure function of the
  buckets DDP hands in, so every rank issues the same collectives in the same order.

Every function takes the ``TernGradState`` that owns the bucket and runs under its lock (on its worker thread,
ddp_worker.py, or in the hook when synchronous).  With ``state.trace`` a list, each appends its spans (the
format is in ``trace_hook``)."""
from __future__ import annotations

from time import perf_counter as _clock

import torch

from ..errors import NonFiniteGradientError
from ..exchange import precision, settle_full_precision
from ..exchange.fusion import TensorSpec, cut


# The first group of a bucket holds at most this many elements, each next one twice as many, up to
# ``fusion_numel`` (exchange/fusion.py): the bucket's first payload is on the wire after a short encode and the
# rest is encoded while it travels, where one group of fusion_numel elements kept the link idle for its whole
# encode.  Fusing never changes a result; it sets how many collectives a bucket takes (about log2 more).
RAMP_NUMEL = 1 << 18


class BucketJob:
    """One bucket of one iteration: what the hook saw, then the exchange's tickets."""

    __slots__ = ("index", "last", "buffer", "params", "grads", "future", "result", "tickets", "plain",
                 "plain_handle", "error")

    def __init__(self, bucket):
        self.index = bucket.index()
        self.last = bucket.is_last()
        self.buffer = bucket.buffer()
        self.params = bucket.parameters()
        self.grads = bucket.gradients()
        self.future = torch.futures.Future()
        # What the hook returns: the buffer, or the exchange's exception raised by a callback.  DDP rethrows a
        # future's error as it is; a value set with set_exception would reach DDP as a value ("Unable to cast
        # ... to Tensor") and lose the exception's class.
        self.result = self.future.then(_value)
        self.tickets: list = []          # (name, gradient view, ticket); the ticket carries its precision route
        self.plain: list = []            # (name, gradient view) averaged uncompressed
        self.plain_handle = None
        self.error = None

    def fail(self, error: Exception) -> torch.futures.Future:
        """Complete the bucket with ``error`` before any exchange (the state's setup failed)."""
        self.error = error
        self.future.set_exception(error)
        return self.result


def _value(fut):
    return fut.value()


# -- the trace (examples/ddp_benchmark.py --profile) ---------------------------------------------------------------
def trace_hook(state, job: BucketJob) -> None:
    """The trace's entries, appended to ``state.trace``: (what, bucket index, perf_counter at begin, at end,
    the engine's codec_s inside, its gather and handshake wait inside), seconds.  ``what``: "hook" when DDP hands
    the bucket over (backward has computed it; a 7th item: the bucket's elements), "start" the worker's encode and
    launch, "finish" its wait, decode and write-back, "plain" the wait for the full-precision allreduce (inside
    the finish), "copy" the compressed averages' copies into the bucket alone (their sum, from the finish's
    begin; none where the engine decoded in place)."""
    if state.trace is not None:
        now = _clock()
        state.trace.append(("hook", job.index, now, now, 0.0, 0.0, job.buffer.numel()))


def _timed(state, what: str, job: BucketJob, work) -> None:
    if state.trace is None:
        return work(state, job)
    stats, t0 = state.state.stats, _clock()
    codec0, wait0 = stats.codec_s, stats.gather_wait_s + stats.handshake_wait_s
    work(state, job)
    state.trace.append((what, job.index, t0, _clock(), stats.codec_s - codec0,
                        stats.gather_wait_s + stats.handshake_wait_s - wait0))


# -- the schedule ----------------------------------------------------------------------------------------------------
def step(state, job: BucketJob) -> None:
    """Start the bucket, finish the previous one, and finish this one too if it is the last of the iteration
    (and always when synchronous)."""
    _timed(state, "start", job, start)
    previous, state._inflight = state._inflight, job
    if previous is not None:
        _timed(state, "finish", previous, finish)
    if job.last or not state.asynchronous:
        state._inflight = None
        _timed(state, "finish", job, finish)


# -- start ----------------------------------------------------------------------------------------------------------
def start(state, job: BucketJob) -> None:
    """Start the bucket's exchanges: the uncompressed allreduce, then the compressed groups.  An error is kept
    in ``job.error`` for ``finish`` to report."""
    try:
        _check_dense(state, job)
        members, routes = _route(state, job)
        if job.plain:
            flat = torch.cat([g.reshape(-1).to(torch.float32) for _, g in job.plain])
            state.state.uncompressed_elements += flat.numel()
            job.plain_handle = state.collectives.allreduce_sum_async(flat, f"terngrad.ddp.plain.{job.index}")
        grads = dict(members)
        plan = cut([TensorSpec(n, g.numel(), str(g.device)) for n, g in members], state.config,
                   ramp_numel=RAMP_NUMEL)
        for gi, names in enumerate(plan.groups):
            tickets = state.engine.start_group([(grads[n], n) for n in names], f"ddp{job.index}.{gi}.{names[0]}",
                                               average=True, in_place=True, routes=[routes[n] for n in names])
            job.tickets += [(n, grads[n], tk) for n, tk in zip(names, tickets)]
    except Exception as e:  # noqa: BLE001 - reported through the bucket's future
        job.error = e


def _check_dense(state, job: BucketJob) -> None:
    buffer = job.buffer
    if buffer.is_sparse or not buffer.is_floating_point():
        name = state._name(job.params[0], job.index) if job.params else f"bucket {job.index}"
        why = ("is sparse; the DDP hook ternarizes dense gradients only (e.g. nn.Embedding(..., "
               "sparse=False))" if buffer.is_sparse else
               f"has dtype {buffer.dtype}; ternary compression needs a floating-point gradient")
        raise TypeError(f"TernGrad: gradient '{name}' {why}")


def _route(state, job: BucketJob) -> tuple[list, dict]:
    """Which of the bucket's parameters are ternarized ((name, gradient view) in bucket order, returned) and
    which travel at full precision (``job.plain``); each one's ``precision.Route``, by name."""
    cfg, eng = state.config, state.engine
    members, routes = [], {}
    for p, g in zip(job.params, job.grads):
        name = state._name(p, job.index)
        compressible = state.enabled and cfg.compresses(name, g.numel()) and eng.plan_exchange(g.device).compresses
        # decided and recorded for p's optimizer of horovod_terngrad.optim, if any (exchange/precision.py)
        routes[name] = precision.route([p], compressible)
        if routes[name].ternary:
            members.append((name, g))
        else:
            job.plain.append((name, g))
    return members, routes


# -- finish ---------------------------------------------------------------------------------------------------------
def finish(state, job: BucketJob) -> None:
    """Wait for the bucket's exchanges, write the averages into its buffer and complete its future.  Every
    ticket is finished even after an error, so every rank leaves the engine in the same state."""
    began = _clock() if state.trace is not None else 0.0
    copy_s = _finish_tickets(state, job)
    if job.plain_handle is not None:
        try:
            _finish_plain(state, job)
        except Exception as e:  # noqa: BLE001 - the first error goes to the future
            job.error = job.error or e
    if state.trace is not None and copy_s:
        state.trace.append(("copy", job.index, began, began + copy_s, 0.0, 0.0))
    job.tickets = job.plain = []
    if job.error is not None:
        state.last_error = job.error
        job.future.set_exception(job.error)
    else:
        job.future.set_result(job.buffer)


def _finish_tickets(state, job: BucketJob) -> float:
    """The compressed parameters' averages into the bucket (a copy only where the engine could not decode
    in place); returns the copies' seconds when tracing."""
    tracing, copy_s = state.trace is not None, 0.0
    for _, g, tk in job.tickets:
        try:
            out = tk.engine.finish(tk)
            if out.data_ptr() != g.data_ptr() or out.dtype != g.dtype:
                t0 = _clock() if tracing else 0.0
                g.copy_(out.view(g.shape))
                if tracing:
                    copy_s += _clock() - t0
            precision.deliver(tk, out)   # the noise estimate to p's optimizer, where it asked
        except Exception as e:  # noqa: BLE001 - the first error goes to the future
            job.error = job.error or e
    return copy_s


def _finish_plain(state, job: BucketJob) -> None:
    """The full-precision parameters' sum, divided by N, into the bucket, after ``on_nonfinite``."""
    t0 = _clock() if state.trace is not None else 0.0
    summed = state.collectives.synchronize(job.plain_handle).div_(state.collectives.size)
    if state.trace is not None:
        state.trace.append(("plain", job.index, t0, _clock(), 0.0, 0.0))
    # on_nonfinite covers the tensors sent at full precision too; one pass over the whole sum finds a finite one
    # (the usual case) without a pass per tensor
    settle = state.enabled and state.config.on_nonfinite != "propagate" and not bool(torch.isfinite(summed).all())
    off = 0
    for name, g in job.plain:
        part = summed[off:off + g.numel()]
        off += g.numel()
        if settle:
            try:
                settle_full_precision(part, name, state.config, state.state.stats, state._warned_nonfinite)
            except NonFiniteGradientError as e:
                job.error = job.error or e
        g.copy_(part.view(g.shape))
