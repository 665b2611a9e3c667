"""PyTorch DDP frontend: TernGrad as a ``DistributedDataParallel`` communication hook.

    import horovod_terngrad.ddp as tg_ddp           # its public names (horovod_terngrad/ddp.py)
    model = torch.nn.parallel.DistributedDataParallel(model)
    state = tg_ddp.register(model, packing="2bit")   # any TernGradConfig setting

or, lower level, ``model.register_comm_hook(TernGradState(model.module.named_parameters()), terngrad_hook)``.
The state, like ``PowerSGDState(process_group=None, ...)``, can be built before ``init_process_group``
(Lightning's ``DDPStrategy(ddp_comm_state=...)``): it makes its process groups and checks at the first
bucket, and it pickles without them (Lightning's spawn launcher).  ``register()`` also takes the model
inside ``torch.compile``, Lightning, Fabric, Accelerate and transformers wrappers (``find_ddp``).

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

A bucket's compressed parameters travel as fused groups of the exchange engine (each: one handshake, one
allgather or alltoall+allgather), cut by ``exchange.fusion.cut`` with a ramp: the first group holds at most
``ddp_bucket.RAMP_NUMEL`` elements, each next one twice as many, up to ``fusion_numel``, so the bucket's first
payload is on the wire after a short encode and the rest is encoded while it travels; fusing never changes a bit.  Everything is keyed on parameter identity and
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
one worker thread per state (ddp_worker.py) runs the exchange, in bucket order, while backward goes on
computing the next buckets.  Pipelining (ddp_bucket.py, which holds what the hook does with a bucket): the
worker starts bucket i (handshake out) before it finishes bucket i-1, and finishes the last bucket
(``bucket.is_last()``) at once; that schedule, and so the order of collectives, is the same on every rank.
``asynchronous=False`` runs the exchange inside the hook and returns a completed future.  TernGrad's collectives run on a process group of their own (made once, on every rank, at the first
bucket: ``TernGradState._ensure_ready``), so they never interleave with DDP's own collectives on the model's
group.

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
import threading
import warnings
import weakref
import zlib

import torch
import torch.distributed as dist

from ..config import TernGradConfig
from ..errors import RankMismatchError, TernGradError
from ..exchange import Engine
from ..exchange.dist_collectives import DistCollectives
from . import ddp_bucket
from .cpu_threads import warn_if_oversubscribed
from .ddp_bucket import BucketJob
from .ddp_worker import BucketWorker
from .hierarchy import dist_engine
from .state import CompressorState, StateOwner, compression_enabled, frontend_config, process_set_key

STEPS_KEY = process_set_key(None)   # the key of the step counters and engine in CompressorState ("global")


class TernGradState(StateOwner):
    """The state of the TernGrad DDP hook: settings, parameter names, step counters, engine and worker.

    named_parameters: ``model.named_parameters()`` of the module DDP wraps (``ddp_model.module``), or that
                      module: the names key the random streams and the ``exclude`` policy (as in the
                      Horovod frontend).  None: ``register()`` takes them from the DDP model; a state
                      handed to ``register_comm_hook`` without names names parameters ``param.<k>`` in
                      the order the hook first meets them (the same on every rank; ``exclude`` needs names).
    process_group:    the group DDP reduces over (None: the default group, WORLD, at the first bucket).
    config / settings: a ``TernGradConfig``, or its settings as keywords.
    asynchronous:     run exchanges on a worker thread so buckets overlap backward (default), or inside
                      the hook.
    dedicated_group:  TernGrad's collectives on a new process group with the same ranks (default), so
                      they cannot interleave with DDP's own; False uses ``process_group`` itself (only
                      safe with ``asynchronous=False``).

    Building the state needs no process group (``torch.distributed`` may be uninitialized, as for
    ``PowerSGDState(process_group=None)``): at the first bucket, on every rank alike (DDP hands every rank
    the same first bucket), ``_ensure_ready`` makes the dedicated group and checks that every rank has the
    same settings and parameters; a disagreement fails that backward on every rank with
    ``RankMismatchError`` (in ``last_error``), and every later bucket with the same error.  A bucket whose
    exchange failed fails DDP's backward on every rank; DDP rethrows a hook's error as a ``RuntimeError``
    whose message holds the original's class and message, and the original exception (e.g.
    ``NonFiniteGradientError``) is kept in ``last_error``.  DDP itself stays usable: the next iteration
    exchanges as usual.  ``state_dict()`` / ``load_state_dict()`` save and restore the step counters of the
    random streams (and counters; the Horovod compressor's format), so a resumed run draws the streams an
    uninterrupted run draws; ``reset()`` forgets them and any exchange in flight.

    Pickling keeps the settings, the parameter names (with the parameters: pickled together with the model,
    as Lightning's spawn launcher does, they stay the model's) and ``state_dict()``; it drops process groups,
    the engine and the worker thread, which the unpickled state makes again at its first bucket (on the
    default group: a ``process_group`` given to the constructor does not travel).
    """

    __slots__ = ("config", "names", "process_group", "collectives", "state", "enabled", "asynchronous",
                 "dedicated_group", "last_error", "_named", "_ready", "_setup_error", "_model", "_lock",
                 "_worker", "_inflight", "_warned_nonfinite", "trace", "__weakref__")

    def __init__(self, named_parameters=None, process_group=None, config: TernGradConfig | None = None,
                 asynchronous: bool = True, dedicated_group: bool = True, **settings):
        self.config = frontend_config(config, settings)
        if asynchronous and not dedicated_group:
            raise ValueError("asynchronous=True needs dedicated_group=True: the worker thread's collectives "
                             "must not share a process group with DDP's own")
        self.enabled = compression_enabled()
        self.names: dict = {}               # id(parameter) -> (parameter, name)
        self._named = False                 # names given (constructor, register()) rather than made up
        if named_parameters is not None:
            self._bind(named_parameters)
        self.process_group = process_group  # None: the default group, resolved by _setup_groups
        self.asynchronous = bool(asynchronous)
        self.dedicated_group = bool(dedicated_group)
        self.state = CompressorState()
        self._runtime()

    def _runtime(self) -> None:
        """What is made again after unpickling: no groups yet, no engine, no worker thread."""
        self.collectives = None             # DistCollectives on TernGrad's group, made by _setup_groups
        self._ready = False
        self._setup_error = None
        self._model = None                  # weak reference to the DDP model register() put the hook on
        self.last_error = None              # the exception behind the last failed bucket (see the docstring)
        self._lock = threading.Lock()       # the engine and the state: the worker, state_dict, reset
        self._worker = BucketWorker(self._step, self._lock)    # the background exchange (ddp_worker.py)
        self._inflight = None               # the bucket started and not yet finished (ddp_bucket.step)
        self._warned_nonfinite = set()      # full-precision tensors zeroed by on_nonfinite='zero' and warned about
        # A list to profile into (examples/ddp_benchmark.py --profile), None (the default) for nothing: the
        # spans of ddp_bucket.trace_hook (when DDP hands each bucket over, the worker's start and finish).
        self.trace = None

    def _bind(self, named_parameters) -> None:
        if isinstance(named_parameters, torch.nn.Module):
            named_parameters = named_parameters.named_parameters()
        names = {}
        for name, p in named_parameters:
            names.setdefault(id(p), (p, name))
        self.names, self._named = names, True

    # -- lazy setup: the first bucket, on every rank alike ------------------------------------------------
    def _ensure_ready(self) -> None:
        """Make TernGrad's process groups and check agreement across ranks, once, at the first bucket (called
        by the hook on DDP's thread, before the bucket is queued).  Every rank calls it at the same bucket, so
        every rank makes the same groups in the same order.  An error is kept and raised again for every later
        bucket, without new collectives, so all ranks keep issuing the same ones."""
        if self._ready:
            return
        if self._setup_error is not None:
            raise self._setup_error
        try:
            if not dist.is_available() or not dist.is_initialized():
                raise TernGradError("TernGrad: torch.distributed is not initialized at the DDP hook's first "
                                    "bucket (call torch.distributed.init_process_group before training)")
            if self.config.exclude and not self._named:
                raise TernGradError("TernGrad: exclude= needs parameter names: build the state with "
                                    "TernGradState(model.named_parameters(), ...) or install it with register()")
            self._setup_groups()
            self._check_agreement()
            # the engine, with the node-aware subgroups where they apply (frontends/hierarchy.py), made here on
            # DDP's thread at the first bucket, after the settings agree: discovering the topology and
            # ``dist.new_group`` are collective, so no rank may make them later or on another thread
            self.engine  # noqa: B018
        except Exception as e:
            self._setup_error = self.last_error = e
            raise
        self._ready = True

    def _setup_groups(self) -> None:
        """Every process group TernGrad uses, made here and only here, in one order on every rank
        (``dist.new_group`` is collective over the members): the hook's group (``process_group``, default
        WORLD) and TernGrad's own group with the same ranks.  The node-aware subgroups (intra- and inter-node)
        are made with the engine, right after the agreement check (``_ensure_ready``)."""
        if self.process_group is None:
            self.process_group = dist.group.WORLD
        group = self.process_group
        if self.dedicated_group:
            group = dist.new_group(ranks=dist.get_process_group_ranks(self.process_group),
                                   backend=dist.get_backend(self.process_group), use_local_synchronization=True)
        # equal_sizes: DDP checks the parameters' shapes across ranks, _check_agreement the settings, and
        # every payload's size is a function of both (codec/sizes.py): no length exchange is needed.
        self.collectives = DistCollectives(group, equal_sizes=True)

    # -- pickling: settings, names and step counters; no groups, engine or thread -------------------------
    def __getstate__(self) -> dict:
        if self.process_group is not None and dist.is_available() and dist.is_initialized() \
                and self.process_group is not dist.group.WORLD:
            warnings.warn("TernGrad: a TernGradState's process group is not pickled; the unpickled state uses "
                          "the default group (pass process_group= again to a new state for a subgroup)",
                          stacklevel=2)
        with self._lock:
            counters = self.state.state_dict()
        return {"config": self.config, "enabled": self.enabled, "asynchronous": self.asynchronous,
                "dedicated_group": self.dedicated_group,
                "names": [(name, p) for p, name in self.names.values()] if self._named else None,
                "state": counters}

    def __setstate__(self, saved: dict) -> None:
        self.config, self.enabled = saved["config"], saved["enabled"]
        self.asynchronous, self.dedicated_group = saved["asynchronous"], saved["dedicated_group"]
        self.names, self._named = {}, False
        if saved["names"] is not None:
            self._bind(saved["names"])
        self.process_group = None
        self.state = CompressorState()
        self.state.load_state_dict(saved["state"])
        self._runtime()

    def __repr__(self):
        where = (f"rank={self.collectives.rank}, size={self.collectives.size}" if self.collectives is not None
                 else "groups made at the first bucket")
        return f"TernGradState({self.config}, {where}, asynchronous={self.asynchronous})"

    # -- state (stats, inspection, uncompressed_elements, state_dict, load_state_dict, reset: StateOwner) ----
    @property
    def steps(self) -> dict:
        """Exchanges started so far per parameter name: the ``step`` word of its random stream."""
        return self.state.steps.setdefault(STEPS_KEY, {})

    @property
    def engine(self) -> Engine:
        """The exchange engine (made on first use, and again after ``reset()``)."""
        return self.state.engine(None, self.config, lambda _: self.collectives,   # kept under STEPS_KEY
                                 hierarchy=self._node_aware)

    def _node_aware(self, flat: Engine):
        """The node-aware engine over ``flat`` where the topology allows it (frontends/hierarchy.py): made at
        the first bucket, on every rank alike, with subgroups of the hook's group on its backend."""
        members = dist.get_process_group_ranks(self.process_group)
        backend = dist.get_backend(self.process_group)

        def make(ranks, intra_node):
            group = dist.new_group(ranks=[members[r] for r in ranks], backend=backend)
            if group == dist.GroupMember.NON_GROUP_MEMBER:
                return None
            # inside a node the shards differ in size (the engine passes them); across nodes every rank of
            # a cross group sends the same pieces, so payload sizes agree as on the hook's own group
            return DistCollectives(group, equal_sizes=not intra_node)
        # every rank agreed on settings and parameters (_check_agreement, before the engine is made) and DDP's
        # buckets are the same on every rank: payloads are decoded at offsets known from this rank's own sizes,
        # without reading the gathered headers on the host (on a GPU, one synchronization less per bucket).
        # on_nonfinite="raise" needs the headers on the host: the header walk then
        flat.layout_known = self.config.on_nonfinite != "raise"
        engine = dist_engine(flat, make)
        if engine is not flat:        # a cross group's ranks send the same pieces; its NaN/Inf goes by status words
            engine.cross_engine.layout_known = True
        return engine

    def _forget_in_flight(self) -> None:
        self._inflight = None

    def close(self, timeout: float | None = None) -> None:
        """Stop the worker thread now, waiting for the bucket it exchanges (at most ``timeout`` seconds).  It
        also ends by itself after ``ddp_worker.IDLE_EXIT_S`` without buckets, and at interpreter exit; the next
        bucket starts another."""
        self._worker.close(timeout)

    # -- the hook's work (ddp_bucket.py) -----------------------------------------------------------------
    def submit(self, bucket) -> torch.futures.Future:
        """Exchange one bucket; the future's value is the bucket's buffer holding the averages."""
        job = BucketJob(bucket)
        ddp_bucket.trace_hook(self, job)
        try:
            self._ensure_ready()
        except Exception as e:  # noqa: BLE001 - reported through the bucket's future, on every rank alike
            return job.fail(e)
        if not self.asynchronous:
            with self._lock:
                self._step(job)
        else:
            self._worker.put(job)
        return job.result

    def _step(self, job: BucketJob) -> None:
        ddp_bucket.step(self, job)

    def _name(self, p, index: int) -> str:
        known = self.names.get(id(p))
        if known is None and not self._named:
            # no names given: the order in which the hook meets parameters, the same on every rank (DDP hands
            # every rank the same buckets, in index order, and rebuilds them after the first iteration only)
            known = self.names[id(p)] = (p, f"param.{len(self.names)}")
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


_WRAPPER_ATTRS = (
    "_orig_mod",           # torch.compile's OptimizedModule (Accelerate's dynamo plugin compiles the DDP model)
    "_forward_module",     # Fabric's _FabricModule; Lightning < 2.1's _LightningModuleWrapperBase (its LightningModule)
    "_original_module",    # Fabric's _FabricModule
    "model_wrapped",       # transformers' Trainer: the DDP model, once training has begun
    "_trainer",            # a LightningModule's Trainer (its `trainer` property raises when detached)
    "strategy",            # Lightning's Trainer -> its strategy, whose `model` is the DDP model
    "model",               # Lightning's strategy; transformers' Trainer before wrapping
    "module",              # other wrappers holding the DDP model as `module`
)


def find_ddp(model):
    """The ``DistributedDataParallel`` object in ``model``: that object itself, or the one inside the wrappers
    of ``torch.compile`` (``_orig_mod``), Lightning (a LightningModule or its Trainer: ``trainer.strategy.model``;
    Lightning < 2.1's ``_LightningModuleWrapperBase``), Fabric (``_FabricModule._forward_module``), Accelerate
    (the prepared model, possibly compiled) and transformers (``Trainer.model_wrapped``); searched breadth
    first.  TypeError if none."""
    from torch.nn.parallel import DistributedDataParallel
    todo, seen = [(model, 0)], set()
    while todo:
        obj, depth = todo.pop(0)
        if isinstance(obj, DistributedDataParallel):
            return obj
        if obj is None or id(obj) in seen or depth >= 6:
            continue
        seen.add(id(obj))
        for attr in _WRAPPER_ATTRS:
            try:
                inner = getattr(obj, attr, None)
            except Exception:  # noqa: BLE001 - a property that refuses (a detached LightningModule's trainer)
                inner = None
            if inner is not None and not callable(inner) or isinstance(inner, torch.nn.Module):
                todo.append((inner, depth + 1))
    raise TypeError(f"register() takes a torch.nn.parallel.DistributedDataParallel model, or a wrapper of one "
                    f"(torch.compile, Lightning, Fabric, Accelerate, transformers' Trainer once training has "
                    f"begun); found none in {type(model).__name__}")


_REGISTERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # DDP model -> its TernGradState


def register(ddp_model, config: TernGradConfig | None = None, asynchronous: bool = True,
             state: TernGradState | None = None, **settings) -> TernGradState:
    """Install the TernGrad hook on a ``DistributedDataParallel`` model (or a wrapper of one: ``find_ddp``) and
    return its state; call it on every rank.  Settings are ``TernGradConfig``'s (``packing``, ``exchange``,
    ``shared_scaler``, ``exclude``, ``seed``, ...), or ``state=`` a ``TernGradState`` built beforehand (its
    parameter names, if it has none, and its process group, if None, are the model's).  Nothing is
    collective here: the state makes its groups at the first bucket.  A model holds one hook: a second
    ``register()`` (or a hook registered by other means) is a ``TernGradError``."""
    ddp = find_ddp(ddp_model)
    hooks = [(getattr(h, "__qualname__", repr(h)), st) for h, st in getattr(ddp, "_comm_hooks", ())]
    if ddp in _REGISTERED or hooks:
        what = ("TernGrad's hook (register() was called for it before)" if ddp in _REGISTERED or any(
            isinstance(st, TernGradState) for _, st in hooks) else f"the communication hook {hooks[0][0]}")
        raise TernGradError(f"TernGrad: this DistributedDataParallel model already has {what}; DDP takes one "
                            "communication hook per model (keep the state the first register() returned)")
    if state is None:
        state = TernGradState(ddp.module.named_parameters(), process_group=ddp.process_group, config=config,
                              asynchronous=asynchronous, **settings)
    else:
        if config is not None or settings:
            raise TypeError("register(..., state=...) takes no settings: they are the state's")
        served = state._model() if state._model is not None else None
        if served is not None and served is not ddp or served is None and state._ready:
            raise TernGradError("TernGrad: this TernGradState already serves another DDP model; build one "
                                "state per model")
        if not state._named:
            state._bind(ddp.module.named_parameters())
        if state.process_group is None and ddp.process_group is not dist.group.WORLD:
            state.process_group = ddp.process_group
    ddp.register_comm_hook(state, terngrad_hook)
    state._model = weakref.ref(ddp)
    _REGISTERED[ddp] = state
    if all(p.device.type == "cpu" for p in ddp.module.parameters()):
        # torchrun sets LOCAL_WORLD_SIZE; without it, count this rank alone
        warn_if_oversubscribed(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return state


__all__ = ["TernGradState", "terngrad_hook", "register", "find_ddp"]
