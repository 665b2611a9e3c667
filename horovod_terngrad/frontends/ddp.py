"""PyTorch DDP frontend: TernGrad as a ``DistributedDataParallel`` communication hook.

    from horovod_terngrad import ddp as tg_ddp      # (the same module as horovod_terngrad.frontends.ddp)
    model = torch.nn.parallel.DistributedDataParallel(model)
    state = tg_ddp.register(model, packing="2bit")   # any TernGradConfig setting

or, lower level, ``model.register_comm_hook(TernGradState(model.module.named_parameters()), terngrad_hook)``.

What the hook computes.  DDP hands the hook one bucket at a time: a flat buffer holding the gradients of
several parameters (``bucket.parameters()``; ``bucket.gradients()`` are views of the buffer).  Each
parameter's slice is one tensor for TernGrad, exactly as the Horovod frontend treats one parameter:

* its own layer-wise scaler s (Eq. 4: s_r = max|g_r| after clipping g_r to ±c·σ_r; with the shared scaler
  s = max_r s_r, agreed by the handshake allreduce-max), its own random stream keyed by (seed, step,
  parameter name, rank), where step counts the exchanges of that parameter so far (``state_dict()``);
* t_r = ternarize(g_r) in {-1, 0, 1}; every rank gets the same average
  out = (float(Σ_r t_r)·s) / N  (shared scaler)  or  (Σ_r s_r·t_r) / N in fp32, rank order (per-rank),
  the bits the Horovod frontend and tests/helpers.expected_average give for the same gradients, and the
  average DDP expects (divided by the world size N) is written back into the bucket;
* parameters the policy keeps at full precision (``exclude``, ``min_numel``) are averaged uncompressed:
  one allreduce-sum of their fp32 values per bucket, then / N.

A bucket's compressed parameters travel as one fused group of the exchange engine (one handshake, one
allgather or alltoall+allgather; groups cut by ``exchange.fusion.cut`` when a bucket holds more than
``fusion_numel`` elements): fusing never changes a bit.  Everything is keyed on parameter identity and
name, never on the bucket index, so DDP's bucket rebuild after the first iteration changes nothing.

Cost per step, per rank, for n compressed elements in a bucket of m parameters (b = 2 bits for ``2bit``,
1.6 for ``base3``; 20 bytes of header and 4 per scaler per parameter):

* per-rank scalers (the default with ``allgather``): no handshake, the allgather alone (below); DDP has
  no ``hvd.join()``, so not even the Horovod frontend's per-step presence check;
* shared scaler (``shared_scaler=True``, and the ``sharded`` exchange's default): handshake
  8·(4 + 3·m) bytes (fp64 slots; 8·9 for a lone parameter) by allreduce-max, then
  - ``allgather``: sends n·b/8 + 24·m bytes, receives N-1 times that;
  - ``sharded``: sends (N-1)/N·n·b/8 bytes by alltoall and receives as many, then the owners' sums of
    L = ceil(log2(2N+1)) bits: receives (N-1)/N·n·L/8 bytes;
* against DDP's fp32 allreduce (about 2·(N-1)/N·4n bytes each way): 16x fewer bytes sent with 2bit at N=2.

Asynchrony (``asynchronous=True``, the default): the hook only records the bucket and returns a future;
one worker thread per state runs the exchange, in bucket order, while backward goes on computing the next
buckets.  Pipelining: the worker starts bucket i (handshake out) before it finishes bucket i-1, and
finishes the last bucket (``bucket.is_last()``) at once; that schedule, and so the order of collectives,
is the same on every rank.  ``asynchronous=False`` runs the exchange inside the hook and returns a completed
future.  TernGrad's collectives run on a process group of their own (made once, on every rank, by the
state's constructor), so they never interleave with DDP's own collectives on the model's group.

Errors (NaN/Inf with ``on_nonfinite="raise"``, bad gradients) are set on the bucket's future, so every
bucket is still exchanged on every rank and backward raises on every rank alike (DDP rethrows the hook's
exception as a ``RuntimeError`` that names the original; ``state.last_error`` is the original).
``on_nonfinite="zero"`` zeroes the parameter's average on every rank for that step instead.

Uneven inputs (``torch.distributed.algorithms.join.Join([ddp_model])``): a joined rank's DDP runs this hook
on zero buckets, in bucket order, so it issues the same collectives as the training ranks; the average is
always divided by the group's size N (as PyTorch's ``allreduce_hook``), whatever DDP's
``divide_by_initial_world_size``.  ``torch.compile(ddp_model)`` leaves the hook to DDP's reducer, unchanged.
"""
import os
import queue
import threading
import zlib

import torch
import torch.distributed as dist

from ..config import TernGradConfig
from ..errors import RankMismatchError, TernGradError
from ..exchange import Exchange, ExchangeStats, Inspection
from ..exchange.dist_collectives import DistCollectives
from ..exchange.fusion import TensorSpec, cut
from .cpu_threads import warn_if_oversubscribed
from .state import CompressorState, process_set_key

STEPS_KEY = process_set_key(None)   # the key of the step counters and engine in CompressorState ("global")
IDLE_EXIT_S = 5.0          # the worker thread ends after this long without a bucket


class _Job:
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
        self.tickets: list = []          # (name, gradient view, ticket)
        self.plain: list = []            # (name, gradient view) averaged uncompressed
        self.plain_handle = None
        self.error = None


def _value(fut):
    return fut.value()


class TernGradState:
    """The state of the TernGrad DDP hook: settings, parameter names, step counters, engine and worker.

    named_parameters: ``model.named_parameters()`` of the module DDP wraps (``ddp_model.module``): the
                      names key the random streams and the ``exclude`` policy (as in the Horovod frontend).
    process_group:    the group DDP reduces over (default: WORLD).
    config / settings: a ``TernGradConfig``, or its settings as keywords.
    asynchronous:     run exchanges on a worker thread so buckets overlap backward (default), or inside
                      the hook.
    dedicated_group:  TernGrad's collectives on a new process group with the same ranks (default), so
                      they cannot interleave with DDP's own; False uses ``process_group`` itself (only
                      safe with ``asynchronous=False``).

    The constructor is collective: every rank of ``process_group`` must call it (it makes the dedicated
    group, and it checks that every rank has the same settings and parameters, raising
    ``RankMismatchError`` on every rank when not).  A bucket whose exchange failed fails DDP's backward on
    every rank; DDP rethrows a hook's error as a ``RuntimeError`` whose message holds the original's class
    and message, and the original exception (e.g. ``NonFiniteGradientError``) is kept in ``last_error``.
    DDP itself stays usable: the next iteration exchanges as usual.  ``state_dict()`` / ``load_state_dict()``
    save and restore the step counters of the random streams (and counters; the Horovod compressor's format),
    so a resumed run draws the streams an uninterrupted run draws; ``reset()`` forgets them and any exchange
    in flight.
    """

    __slots__ = ("config", "names", "process_group", "collectives", "state", "enabled", "asynchronous",
                 "last_error", "_lock", "_handoff", "_queue", "_worker", "_inflight", "__weakref__")

    def __init__(self, named_parameters, process_group=None, config: TernGradConfig | None = None,
                 asynchronous: bool = True, dedicated_group: bool = True, **settings):
        if config is not None and settings:
            raise TypeError("pass either a TernGradConfig or keyword settings, not both")
        self.config = config if config is not None else TernGradConfig(**settings)
        self.enabled = os.environ.get("HOROVOD_TERNGRAD", "1").strip().lower() not in ("0", "off", "false", "no")
        self.names: dict = {}               # id(parameter) -> (parameter, name)
        for name, p in named_parameters:
            self.names.setdefault(id(p), (p, name))
        if not dist.is_available() or not dist.is_initialized():
            raise TernGradError("TernGrad: torch.distributed is not initialized (call "
                                "torch.distributed.init_process_group before building the DDP hook's state)")
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        group = self.process_group
        if dedicated_group:
            group = dist.new_group(ranks=dist.get_process_group_ranks(self.process_group),
                                   backend=dist.get_backend(self.process_group), use_local_synchronization=True)
        elif asynchronous:
            raise ValueError("asynchronous=True needs dedicated_group=True: the worker thread's collectives "
                             "must not share a process group with DDP's own")
        # equal_sizes: DDP checks the parameters' shapes across ranks, _check_agreement the settings, and
        # every payload's size is a function of both (codec/sizes.py): no length exchange is needed.
        self.collectives = DistCollectives(group, equal_sizes=True)
        self.asynchronous = bool(asynchronous)
        self.state = CompressorState()
        self.last_error = None              # the exception behind the last failed bucket (see the docstring)
        self._lock = threading.Lock()       # the engine and the state: the worker, state_dict, reset
        self._handoff = threading.Lock()    # the queue and whether a worker runs
        self._queue = queue.Queue()
        self._worker = None
        self._inflight = None
        self._check_agreement()

    def __repr__(self):
        return (f"TernGradState({self.config}, rank={self.collectives.rank}, size={self.collectives.size}, "
                f"asynchronous={self.asynchronous})")

    # -- state -----------------------------------------------------------------------------------
    @property
    def stats(self) -> ExchangeStats:
        return self.state.stats

    @property
    def inspection(self) -> Inspection:
        return self.state.inspection

    @property
    def steps(self) -> dict:
        """Exchanges started so far per parameter name: the ``step`` word of its random stream."""
        return self.state.steps.setdefault(STEPS_KEY, {})

    @property
    def engine(self) -> Exchange:
        """The exchange engine (made on first use, and again after ``reset()``)."""
        return self.state.engine(None, self.config, lambda _: self.collectives)   # kept under STEPS_KEY

    def state_dict(self) -> dict:
        """Step counters of the random streams and counters (plain values); waits for the worker."""
        with self._lock:
            return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.state.load_state_dict(state)

    def reset(self) -> None:
        """Forget exchanges in flight, step counters and counters (keeps the settings)."""
        with self._lock:
            self._inflight = None
            self.state.reset()

    def close(self) -> None:
        """Stop the worker thread now (it also ends by itself after IDLE_EXIT_S without buckets; the next
        bucket starts another)."""
        with self._handoff:
            worker, self._worker = self._worker, None
            if worker is not None:
                self._queue.put(None)
        if worker is not None:
            worker.join()

    # -- the hook's work ---------------------------------------------------------------------------
    def submit(self, bucket) -> torch.futures.Future:
        """Exchange one bucket; the future's value is the bucket's buffer holding the averages."""
        job = _Job(bucket)
        if not self.asynchronous:
            with self._lock:
                self._step(job)
            return job.result
        with self._handoff:
            self._queue.put(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, daemon=True, name="terngrad-ddp")
                self._worker.start()
        return job.result

    def _work(self) -> None:
        """The worker thread: the buckets in the order DDP hands them in.  It ends after IDLE_EXIT_S without
        a bucket (so a state that is dropped does not keep a thread), under the hand-off lock, so a bucket
        handed in meanwhile starts a new worker; a bucket in flight stays in ``_inflight`` for it."""
        while True:
            try:
                job = self._queue.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._handoff:
                    if self._queue.empty():
                        self._worker = None
                        return
                continue
            if job is None:
                return
            with self._lock:
                self._step(job)

    def _step(self, job: _Job) -> None:
        """Start the bucket, finish the previous one, and finish this one too if it is the last of the
        iteration (``bucket.is_last()``; and always when synchronous).  A pure function of the buckets DDP
        hands in, so every rank issues the same collectives in the same order."""
        self._start(job)
        previous, self._inflight = self._inflight, job
        if previous is not None:
            self._finish(previous)
        if job.last or not self.asynchronous:
            self._inflight = None
            self._finish(job)

    def _start(self, job: _Job) -> None:
        """Start the bucket's exchanges: the uncompressed allreduce, then the compressed groups."""
        try:
            cfg, eng = self.config, self.engine
            buffer = job.buffer
            if buffer.is_sparse or not buffer.is_floating_point():
                name = self._name(job.params[0], job.index) if job.params else f"bucket {job.index}"
                why = ("is sparse; the DDP hook ternarizes dense gradients only (e.g. nn.Embedding(..., "
                       "sparse=False))" if buffer.is_sparse else
                       f"has dtype {buffer.dtype}; ternary compression needs a floating-point gradient")
                raise TypeError(f"TernGrad: gradient '{name}' {why}")
            members = []
            for p, g in zip(job.params, job.grads):
                name = self._name(p, job.index)
                if self.enabled and cfg.compresses(name, g.numel()) and eng.compression_pays(g.device):
                    members.append((name, g))
                else:
                    job.plain.append((name, g))
            if job.plain:
                flat = torch.cat([g.reshape(-1).to(torch.float32) for _, g in job.plain])
                self.state.uncompressed_elements += flat.numel()
                job.plain_handle = self.collectives.allreduce_sum_async(flat, f"terngrad.ddp.plain.{job.index}")
            grads = dict(members)
            plan = cut([TensorSpec(n, g.numel(), str(g.device)) for n, g in members], cfg)
            for gi, names in enumerate(plan.groups):
                tickets = eng.start_group([(grads[n], n) for n in names], f"ddp{job.index}.{gi}.{names[0]}",
                                          average=True, in_place=True)
                job.tickets += [(n, grads[n], tk) for n, tk in zip(names, tickets)]
        except Exception as e:  # noqa: BLE001 - reported through the bucket's future
            job.error = e

    def _finish(self, job: _Job) -> None:
        """Wait for the bucket's exchanges, write the averages into its buffer and complete its future.
        Every ticket is finished even after an error, so every rank leaves the engine in the same state."""
        N = self.collectives.size
        for name, g, tk in job.tickets:
            try:
                out = tk.engine.finish(tk)
                if out.data_ptr() != g.data_ptr() or out.dtype != g.dtype:
                    g.copy_(out.view(g.shape))
            except Exception as e:  # noqa: BLE001 - the first error goes to the future
                job.error = job.error or e
        if job.plain_handle is not None:
            try:
                summed = self.collectives.synchronize(job.plain_handle).div_(N)
                off = 0
                for _, g in job.plain:
                    g.copy_(summed[off:off + g.numel()].view(g.shape))
                    off += g.numel()
            except Exception as e:  # noqa: BLE001
                job.error = job.error or e
        job.tickets = job.plain = []
        if job.error is not None:
            self.last_error = job.error
            job.future.set_exception(job.error)
        else:
            job.future.set_result(job.buffer)

    def _name(self, p, index: int) -> str:
        known = self.names.get(id(p))
        if known is None or known[0] is not p:
            raise TernGradError(f"TernGrad: DDP bucket {index} holds a parameter of shape {tuple(p.shape)} that is "
                                "not among the named_parameters the TernGradState was given (pass "
                                "ddp_model.module.named_parameters())")
        return known[1]

    def _check_agreement(self) -> None:
        """Every rank must hold the same settings and parameters (names, sizes): payload sizes follow from
        them, and torch.distributed's collectives need equal sizes.  One all_gather of a checksum at
        construction; a disagreement raises ``RankMismatchError`` on every rank."""
        layout = [(name, tuple(p.shape)) for p, name in self.names.values()]
        code = zlib.crc32(repr((self.config, self.enabled, layout)).encode())
        coll = self.collectives
        mine = torch.tensor([code], dtype=torch.int64, device=coll.size_device())
        everyone = coll.synchronize(coll.allgather_async(mine, "terngrad.ddp.check")).cpu().tolist()
        if len(set(everyone)) != 1:
            differ = [r for r, c in enumerate(everyone) if c != everyone[0]]
            raise RankMismatchError(f"TernGrad: ranks {differ} differ from rank 0 in TernGrad's settings "
                                    "(TernGradConfig, HOROVOD_TERNGRAD) or in the model's parameter names and "
                                    f"shapes (this rank {coll.rank}: {self.config})")


def terngrad_hook(state: TernGradState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: TernGrad average of every parameter's gradient in ``bucket`` (see the module
    docstring for the math and the cost).  ``ddp_model.register_comm_hook(state, terngrad_hook)``."""
    return state.submit(bucket)


def register(ddp_model, config: TernGradConfig | None = None, asynchronous: bool = True, **settings) -> TernGradState:
    """Install the TernGrad hook on a ``DistributedDataParallel`` model (collective: call it on every rank)
    and return its state.  Settings are ``TernGradConfig``'s (``packing``, ``exchange``, ``shared_scaler``,
    ``exclude``, ``seed``, ...)."""
    if not hasattr(ddp_model, "register_comm_hook") or not hasattr(ddp_model, "module"):
        raise TypeError(f"register() takes a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}")
    state = TernGradState(ddp_model.module.named_parameters(), process_group=ddp_model.process_group,
                          config=config, asynchronous=asynchronous, **settings)
    ddp_model.register_comm_hook(state, terngrad_hook)
    if all(p.device.type == "cpu" for p in ddp_model.module.parameters()):
        # torchrun sets LOCAL_WORLD_SIZE; without it, count this rank alone
        warn_if_oversubscribed(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return state


__all__ = ["TernGradState", "terngrad_hook", "register"]
