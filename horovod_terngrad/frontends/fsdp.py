"""FSDP2 frontend: HSDP with TernGrad between nodes (``fully_shard`` inside a node, ternary across nodes).

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import horovod_terngrad.fsdp as tg_fsdp

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])        # sharded inside the node only (a 1-D mesh)
    fully_shard(model, mesh=mesh["shard"])
    state = tg_fsdp.register(model, mesh)             # any TernGradConfig setting as a keyword

What it replaces.  Native HSDP (``fully_shard(..., mesh=mesh)`` on the 2-D mesh) reduce-scatters each FSDP
unit's gradients inside the node (the shard dimension, S ranks) and then all-reduces every rank's shard
across the R nodes (the replicate dimension) at full precision, or in bf16 with
``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``.  Here the model is sharded on the 1-D shard mesh, so
FSDP itself only reduce-scatters; ``register`` sets ``set_all_reduce_hook`` on every FSDP unit, and the hook
averages the unit's reduce-scatter output (this rank's shard of the node's average, one flat tensor) across
the R ranks that hold the same shard on the other nodes (``mesh["replicate"]``), with TernGrad:

* the flat shard is cut back into the parameters it holds, by the offsets FSDP lays them out at: for each
  parameter with a gradient this step, in the unit's order, ``ceil(dim0 / S)`` rows (``padded_sharded_param_size``),
  of which this rank's real part (``sharded_size``; uneven first dimensions leave the last shards short, or
  empty) comes first and FSDP's zero padding after.  Each real part is one tensor for TernGrad, named by the
  parameter's FQN: its own layer-wise scaler s_r = max|g_r| after clipping to ±c·σ_r (σ of this shard), its
  own random stream keyed by (seed, step, FQN, global rank), where step counts this unit's reductions
  (identical on every rank, ``state_dict()``), and the element index within the shard;
* every rank of the replicate group gets out = (Σ_r s_r·t_r)/R (per-rank scalers, the allgather default) or
  (float(Σ_r t_r)·s)/R (shared scaler), the bits ``tests/helpers.expected_average`` gives, written back into
  FSDP's buffer; FSDP then views it as the sharded gradients.  FSDP's reduce-scatter averaged over the S ranks
  of the node already, so the result is the average over all R·S ranks, as native HSDP's;
* parameters the policy keeps at full precision (``min_numel`` of the shard, ``exclude``) are averaged by one
  allreduce-sum of their fp32 values per unit, then / R;
* where the offsets cannot be had (a future FSDP whose internals differ), the whole flat shard, padding
  included, is one tensor with one scaler per ``bucket_size`` elements (65536 if ``bucket_size`` is 0), named
  ``<unit>.shard``; ``state.layout`` says per unit which ("params" or "buckets"), and rank 0 logs it once.

Cost per rank and step, for a unit whose shard holds n compressed elements in m parameters (b = 2 bits, 1.6
for ``base3``): the allgather sends n·b/8 + 24·m bytes and receives R-1 times that, against native HSDP's
ring all-reduce of about 2·(R-1)/R·4n bytes each way (2n in bf16): at R = 2, 1/16 of fp32's bytes, 1/8 of
bf16's.  Intra-node traffic (all-gathers, reduce-scatters) is FSDP's own and unchanged.

Mixed precision: the hook gets the shard in FSDP's reduce dtype (fp32, bf16 or fp16) and writes the average
back in it; the codec computes in fp32.  ``on_nonfinite`` (default ``"propagate"``) makes a NaN/Inf on any
rank's shard that parameter's average NaN on every replica, so GradScaler's ``unscale_`` sees the overflow on
every rank and every rank skips the step, as with native HSDP.  Gradient accumulation
(``set_requires_gradient_sync(False)``) calls no hook until the step that syncs, which averages the
accumulated shard.  A unit with no gradient in a step calls no hook on any rank.

Threads and streams: the hook runs inside FSDP's post-backward, on the autograd thread (on CUDA under FSDP's
all-reduce stream); it returns when the average is in FSDP's buffer, because FSDP views that buffer as the
gradients right after the hook returns.  On CPU/gloo it blocks backward for the exchange (native HSDP's
all-reduce does too).

State: ``TernGradFSDPState`` holds the settings, the counters (``stats``), the per-unit step counters and the
engine.  ``state_dict()`` holds only what every rank has alike (the step counters), so it checkpoints with
``torch.distributed.checkpoint`` beside the model and the optimizer (DCP keeps one copy of a non-tensor
value); a resumed run draws the streams an uninterrupted run draws.

Where TernGrad cannot apply, FSDP's own path runs and rank 0 says why, once: a 1-D mesh (one node: FSDP
only reduce-scatters, there is nothing to average across nodes) or a replicate size of 1.
"""
from __future__ import annotations

import functools
import logging
import os
import weakref
import zlib

import torch
import torch.distributed as dist

from ..config import TernGradConfig
from ..errors import NonFiniteGradientError, RankMismatchError, TernGradError
from ..exchange import Engine, precision, settle_full_precision
from ..exchange.dist_collectives import DistCollectives
from ..exchange.fusion import TensorSpec, cut
from .cpu_threads import warn_if_oversubscribed
from .state import CompressorState, compression_enabled, frontend_config

log = logging.getLogger("horovod_terngrad")
_said: set = set()

STATE_VERSION = 1
FALLBACK_BUCKET = 1 << 16     # scaler bucket of the flat-shard fallback when bucket_size is 0

_REGISTERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # root module -> its state


def _say(key, level: int, msg: str, *args) -> None:
    """Log once per process and key, on global rank 0."""
    if key in _said:
        return
    _said.add(key)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.log(level, msg, *args)


class _Member:
    """One parameter's part of a unit's flat shard: where it lies, what it is called, and the parameter (the
    DTensor the optimizer holds; for the buckets fallback, the unit's parameters, which travel together)."""

    __slots__ = ("name", "offset", "numel", "params")

    def __init__(self, name: str, offset: int, numel: int, params: tuple = ()):
        self.name, self.offset, self.numel, self.params = name, offset, numel, params


class TernGradFSDPState:
    """Settings, counters, step counters and engine of the TernGrad all-reduce hook of one FSDP2 model.

    Built by ``register()`` (or beforehand, with the settings, and handed to ``register(..., state=...)``; it
    needs no process group until then).  ``active`` is False where FSDP's own path runs (1-D mesh, one
    replica).  ``layout`` maps each FSDP unit's name to how its shard is cut ("params" or "buckets").
    """

    def __init__(self, config: TernGradConfig | None = None, **settings):
        self.config = frontend_config(config, settings)
        self.enabled = compression_enabled()
        self.state = CompressorState()
        self.unit_steps: dict[str, int] = {}    # unit name -> reductions so far (the streams' step word)
        self.layout: dict[str, str] = {}
        self.active = False
        self.reason = None                      # why FSDP's own path runs, where it does
        self.replicas = 1                       # R
        self.group = None                       # the replicate process group
        self.engine = None
        self._bucket_engine = None
        self._with_grad: dict = {}              # id(param group) -> its parameters with a gradient this step
        self._warned_nonfinite: set = set()
        self._served = None

    @property
    def stats(self):
        """Bytes sent and received, collectives, codec seconds (``exchange.ExchangeStats``) of this rank."""
        return self.state.stats

    def state_dict(self) -> dict:
        """What a resumed run needs to draw the streams an uninterrupted run draws: the per-unit step counters,
        the same on every rank (so ``torch.distributed.checkpoint`` may keep any rank's copy)."""
        return {"version": STATE_VERSION, "unit_steps": dict(self.unit_steps)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"TernGrad FSDP state of version {state.get('version')!r}; this is version "
                             f"{STATE_VERSION}")
        self.unit_steps.clear()
        self.unit_steps.update({str(k): int(v) for k, v in state["unit_steps"].items()})

    def reset(self) -> None:
        """Forget step counters and counters (keeps the settings and the registration)."""
        self.unit_steps.clear()
        self.state.reset()
        for eng in (self.engine, self._bucket_engine):
            if eng is not None:
                eng.reset()

    # -- setup (register) ---------------------------------------------------------------------------------
    def _attach(self, group, replicas: int) -> None:
        self.group, self.replicas, self.active = group, replicas, True
        coll = DistCollectives(group, equal_sizes=True)
        me = dist.get_rank()
        # streams keyed by the global rank: the R·S ranks of the job each draw their own
        self.engine = Engine(coll, self.config, self.state.stats, self.state.inspection, {}, joins=False,
                               stream_rank=me)
        # the flat shard's buckets: the user's, else FALLBACK_BUCKET
        bucketed = self.config.replace(bucket_size=self.config.bucket_size or FALLBACK_BUCKET)
        self._bucket_engine = Engine(coll, bucketed, self.state.stats, self.state.inspection, {}, joins=False,
                                       stream_rank=me)
        # replicas agree on settings and layout (register's check), so payloads are decoded without reading
        # their headers on the host: on a GPU the hook adds no host synchronization (exchange/allgather.py)
        self.engine.layout_known = self._bucket_engine.layout_known = True

    # -- the hook ---------------------------------------------------------------------------------------
    def _members(self, unit: str, param_group, numel: int):
        """The parameters in a unit's flat shard of ``numel`` elements, or None if the layout cannot be had
        (then the flat shard travels in buckets)."""
        try:
            params = self._with_grad.pop(id(param_group), None)
            if params is None:
                params = list(param_group.fsdp_params)
            members, off = [], 0
            for fp in params:
                members.append(_Member(fp._param_fqn, off, int(torch.Size(fp.sharded_size).numel()),
                                       (getattr(fp, "sharded_param", None),)))
                off += int(torch.Size(fp.padded_sharded_param_size).numel())
            if off == numel and all(m.numel <= numel - m.offset for m in members):
                return members
            why = f"the parameters' padded shards add up to {off} elements, the shard holds {numel}"
        except Exception as e:  # noqa: BLE001 - FSDP internals other than this version's: buckets instead
            why = f"{type(e).__name__}: {e}"
        _say(("buckets", unit), logging.WARNING, "TernGrad FSDP: unit '%s': parameter offsets in its shard "
             "unknown (%s); its shard travels as one tensor with a scaler per %d elements", unit, why,
             self._bucket_engine.config.bucket_size)
        return None

    def reduce(self, unit: str, param_group, out: torch.Tensor) -> None:
        """Average ``out`` (this rank's reduce-scatter output of ``unit``) across the replicate group, in place."""
        if not getattr(param_group, "all_reduce_grads", True):
            raise TernGradError(f"TernGrad FSDP: unit '{unit}': set_requires_all_reduce(False) is not supported "
                                "with TernGrad's all-reduce hook (the next reduction would average only the "
                                "newest gradient); use set_requires_gradient_sync(False) to accumulate")
        step = self.unit_steps.get(unit, 0)
        self.unit_steps[unit] = step + 1
        cfg = self.config
        flat = out.reshape(-1)
        members = self._members(unit, param_group, flat.numel())
        self.layout[unit] = "params" if members is not None else "buckets"
        if members is None:
            eng = self._bucket_engine
            members = [_Member(f"{unit}.shard" if unit else "shard", 0, flat.numel(),
                               tuple(getattr(fp, "sharded_param", None) for fp in param_group.fsdp_params))]
        else:
            eng = self.engine
        compressed, plain, routes = [], [], {}
        for m in members:
            if m.numel == 0:
                continue              # an empty shard (uneven first dimension): the same on every replica
            seg = flat[m.offset:m.offset + m.numel]
            compressible = (self.enabled and cfg.compresses(m.name, m.numel)
                            and eng.plan_exchange(out.device).compresses)
            # decided and recorded for the optimizer of horovod_terngrad.optim that claimed the sharded
            # parameters (the DTensors FSDP holds and the optimizer steps), if any (exchange/precision.py)
            routes[m.name] = precision.route(m.params, compressible)
            if routes[m.name].ternary:
                compressed.append((m.name, seg))
            else:
                plain.append((m.name, seg))
        plain_handle = None
        coll = eng.coll
        if plain:
            values = torch.cat([g.to(torch.float32) for _, g in plain])
            self.state.uncompressed_elements += values.numel()
            plain_handle = coll.allreduce_sum_async(values, f"terngrad.fsdp.plain.{unit}")
        tickets, error = [], None
        try:
            for name, _ in compressed:
                eng.steps[name] = step          # every parameter's stream steps with its unit, on every rank
            segs = dict(compressed)
            plan = cut([TensorSpec(n, g.numel(), str(g.device)) for n, g in compressed], cfg)
            for gi, names in enumerate(plan.groups):
                started = eng.start_group([(segs[n], n) for n in names], f"fsdp.{unit}.{gi}", average=True,
                                          in_place=True, routes=[routes[n] for n in names])
                tickets += [(segs[n], tk) for n, tk in zip(names, started)]
        except Exception as e:  # noqa: BLE001 - raised after every started exchange is finished
            error = e
        for seg, tk in tickets:                # every ticket finished, so every rank leaves the engine alike
            try:
                avg = tk.engine.finish(tk)
                if avg.data_ptr() != seg.data_ptr() or avg.dtype != seg.dtype:
                    seg.copy_(avg.reshape(-1))
                precision.deliver(tk, avg)     # the shard's estimate, to the DTensor parameter's optimizer
            except Exception as e:  # noqa: BLE001
                error = error or e
        if plain_handle is not None:
            try:
                summed = coll.synchronize(plain_handle).div_(self.replicas)
                off = 0
                for name, g in plain:
                    part = summed[off:off + g.numel()]
                    off += g.numel()
                    if self.enabled:
                        try:
                            settle_full_precision(part, name, cfg, self.state.stats, self._warned_nonfinite)
                        except NonFiniteGradientError as e:
                            error = error or e
                    g.copy_(part)
            except Exception as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            raise error

    def _record_with_grad(self, param_group) -> None:
        """Before FSDP's post-backward of ``param_group``: which of its parameters it will reduce (FSDP's own
        rule: an accumulated gradient, a gradient, or, with ``reduce_scatter_unused_params``, any parameter
        that requires one).  Frozen or unused parameters are left out of the flat shard, so the offsets
        follow from this list."""
        try:
            with_grad = []
            for fp in param_group.fsdp_params:
                if not hasattr(fp, "_unsharded_param"):
                    continue
                if (fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None
                        or getattr(param_group, "reduce_scatter_unused_params", False)
                        and fp.unsharded_param.requires_grad):
                    with_grad.append(fp)
            self._with_grad[id(param_group)] = with_grad
        except Exception:  # noqa: BLE001 - internals differ: the hook checks the sizes and falls back
            self._with_grad.pop(id(param_group), None)


def _hook(state_ref, unit: str, param_group, out: torch.Tensor) -> None:
    state = state_ref()
    if state is None:
        raise TernGradError(f"TernGrad FSDP: unit '{unit}': the TernGradFSDPState register() returned was "
                            "dropped; keep a reference to it for as long as the model trains")
    state.reduce(unit, param_group, out)


def _wrap_post_backward(state_ref, param_group) -> None:
    original = param_group.post_backward

    @functools.wraps(original)
    def post_backward(*args, **kwargs):
        state = state_ref()
        if state is not None and getattr(param_group, "reduce_grads", True):
            state._record_with_grad(param_group)
        return original(*args, **kwargs)

    param_group.post_backward = post_backward


def _mesh_dims(mesh) -> tuple[int, int]:
    """(replicate dim, shard dim) of a 2-D mesh: by name where the names say (``replicate``/``dp_replicate``,
    ``shard``/``dp_shard``), else (0, 1) as HSDP's convention."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if len(names) == 2:
        rep = [i for i, n in enumerate(names) if "replicate" in n]
        shard = [i for i, n in enumerate(names) if "shard" in n]
        if len(rep) == 1 and len(shard) == 1 and rep != shard:
            return rep[0], shard[0]
    return 0, 1


def _units(model):
    from torch.distributed.fsdp import FSDPModule
    return [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]


def _check_agreement(state, group, layout) -> None:
    """One all_gather over the replicate group of a checksum of the settings and this shard's layout: replicas
    must agree (payload sizes follow from them); RankMismatchError on every replica otherwise."""
    code = zlib.crc32(repr((state.config, state.enabled, layout)).encode())
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([code], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    codes = [int(c.item()) for c in everyone]
    if len(set(codes)) != 1:
        ranks = dist.get_process_group_ranks(group)
        differ = [ranks[i] for i, c in enumerate(codes) if c != codes[0]]
        raise RankMismatchError(f"TernGrad FSDP: ranks {differ} differ from rank {ranks[0]} (their replicas) in "
                                "TernGrad's settings (TernGradConfig, HOROVOD_TERNGRAD) or in the model's "
                                "sharded parameters")


def register(model, mesh, config: TernGradConfig | None = None, state: TernGradFSDPState | None = None,
             **settings) -> TernGradFSDPState:
    """Average every FSDP unit's gradient shard of ``model`` across the replicate dimension of ``mesh`` with
    TernGrad; call it on every rank after ``fully_shard`` and before the first backward.  ``model``: the root
    module, sharded with ``fully_shard(..., mesh=mesh["shard"])`` (every unit on the 1-D shard mesh);
    ``mesh``: the 2-D ``(replicate, shard)`` DeviceMesh.  Settings are ``TernGradConfig``'s, or ``state=`` a
    ``TernGradFSDPState`` built beforehand.  Collective over each replicate group (one agreement check).
    A 1-D mesh, or one replica, leaves FSDP's own path in place (logged once) and returns an inactive state."""
    if state is None:
        state = TernGradFSDPState(config, **settings)
    elif config is not None or settings:
        raise TypeError("register(..., state=...) takes no settings: they are the state's")
    if state.config.on_nonfinite == "raise":
        # the ranks of a node hold different shards: a NaN in one parameter's rows reaches some of them only, and
        # a rank that raised in backward would leave the others waiting in FSDP's next reduce-scatter
        raise TernGradError("TernGrad FSDP: on_nonfinite='raise' is not supported with FSDP: a NaN/Inf may reach "
                            "only some shards, and ranks raising in backward while their node's other ranks go on "
                            "would hang FSDP's next collective; use 'propagate' (the default: the NaN reaches "
                            "every replica of that shard, and GradScaler skips the step on every rank) or 'zero'")
    if model in _REGISTERED or state._served is not None:
        raise TernGradError("TernGrad FSDP: register() was called for this model (or this state) before; keep "
                            "the state the first register() returned")
    units = _units(model)
    if not units:
        raise TypeError(f"TernGrad FSDP: register() takes a model sharded with torch.distributed.fsdp."
                        f"fully_shard; {type(model).__name__} holds no FSDP module")
    if not dist.is_initialized():
        raise TernGradError("TernGrad FSDP: torch.distributed is not initialized")
    state._served = weakref.ref(model)
    _REGISTERED[model] = state
    if mesh.ndim == 1:
        state.reason = (f"the mesh is 1-D ({mesh.size()} ranks, one node): FSDP's reduce-scatter averages "
                        "over every rank, there is no replica to average across")
        _say(("fsdp-own", state.reason), logging.INFO, "TernGrad FSDP: FSDP's own path: %s", state.reason)
        return state
    if mesh.ndim != 2:
        raise TernGradError(f"TernGrad FSDP: register() takes a 2-D (replicate, shard) mesh; got {mesh.ndim} "
                            "dimensions")
    rep_dim, shard_dim = _mesh_dims(mesh)
    replicas = mesh.size(rep_dim)
    if replicas == 1:
        state.reason = "the mesh's replicate dimension has size 1: FSDP's reduce-scatter averages over every rank"
        _say(("fsdp-own", state.reason), logging.INFO, "TernGrad FSDP: FSDP's own path: %s", state.reason)
        return state
    shard_group = mesh.get_group(shard_dim)
    shard_ranks = dist.get_process_group_ranks(shard_group)
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo
    layout, groups = [], []
    for name, unit in units:
        fsdp_state = unit._get_fsdp_state()
        for pg in fsdp_state._fsdp_param_groups:
            if isinstance(pg.mesh_info, DDPMeshInfo):
                raise TernGradError(f"TernGrad FSDP: unit '{name}' is sharded on the 2-D mesh (native HSDP, which "
                                    "all-reduces across nodes itself); shard it with fully_shard(..., mesh="
                                    "mesh['shard']) so the cross-node average is TernGrad's")
            rs = getattr(pg, "_reduce_scatter_process_group", None)
            if rs is not None and dist.get_process_group_ranks(rs) != shard_ranks:
                raise TernGradError(f"TernGrad FSDP: unit '{name}' is sharded over ranks "
                                    f"{dist.get_process_group_ranks(rs)}, not over this rank's row of the mesh's "
                                    f"shard dimension {shard_ranks}: shard it with mesh=mesh['shard']")
            layout.append((name, [(fp._param_fqn, tuple(fp.sharded_size)) for fp in pg.fsdp_params]))
            groups.append((name, unit, pg))
            # every unit's counter exists from the start, so a fresh state's state_dict() names every key a
            # checkpoint holds (torch.distributed.checkpoint loads only the keys of the state dict it is given)
            state.unit_steps.setdefault(name, 0)
    group = mesh.get_group(rep_dim)
    _check_agreement(state, group, layout)
    state._attach(group, replicas)
    ref = weakref.ref(state)
    for name, unit, pg in groups:
        try:
            unit.set_all_reduce_hook(functools.partial(_hook, ref, name, pg))
        except ValueError as e:
            raise TernGradError(f"TernGrad FSDP: unit '{name}': {e}") from e
        _wrap_post_backward(ref, pg)
    _say(("fsdp-on", replicas, len(shard_ranks)), logging.INFO, "TernGrad FSDP: %d FSDP units, each shard "
         "averaged across %d replicas with TernGrad (%s)", len(groups), replicas, state.config.packing)
    if all(p.device.type == "cpu" for p in model.parameters()):
        warn_if_oversubscribed(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return state


__all__ = ["TernGradFSDPState", "register"]
