"""HSDP: the step model of FSDP2 sharded inside a node, each rank's gradient shard averaged across nodes.

HSDP (FSDP2 sharded inside a node, each rank's gradient shard averaged across nodes)

The step of one rank of a job of N = R·G GPUs, R nodes of G GPUs (``network.ranks_per_node``), the model
sharded by FSDP2 on the G GPUs of a node (one FSDP unit per transformer block, plus the root unit holding
the embeddings and the final LayerNorm) and replicated across the R nodes:

    T_step = T_compute + T_intra + T_cross + T_codec - min(T_intra + T_cross + T_codec, overlap · T_compute)

the same step formula as :func:`predict_step` (overlap 0 by default: nothing hides under backward, as the
DDP/Horovod tables).  Per FSDP unit u with padded shard S_u = sum over its parameters of ceil(d0/G)·rest
elements (FSDP2 shards every parameter on dim 0 and pads each to ceil(d0/G) rows):

* T_intra (intra-node link, ``network.intra_node``; L = min(peer_links, G-1) links per GPU):
    reduce-scatter of the gradients: (G-1)·alpha + (G-1)·w·S_u·beta/L   (ring; w = 4, or 2 for bf16 HSDP,
      whose MixedPrecisionPolicy(reduce_dtype=bf16) reduce-scatters in bf16 too),
    parameter all-gathers: a·(ceil((G-1)/L)·alpha + (G-1)/L·4·S_u·beta) (``ring_allgather_time``), with
      a = 2 for a block (forward, and again in backward: reshard_after_forward=None is True for non-root
      units) and 1 for the root; fp32 parameters, the same in all three configurations.
* T_cross: every rank averages its shard with the R-1 ranks of the same local index on the other nodes;
  the G ranks of a node do so at once through the node's one NIC, so each is charged on
  ``exchange.cost.cross_network`` (the inter-node link at a G-th of its bandwidth, as the node-aware
  exchange is):
    fp32 HSDP:  one allreduce of 4·S_u bytes among R ranks per unit (ring 2(R-1)·alpha + 2(R-1)/R·4·S_u·G·beta
                with beta the node link's, or the tree where cheaper: ``exchange.cost.allreduce_cost``);
    bf16 HSDP:  the same with 2·S_u bytes;
    TernGrad (frontends/fsdp.py): the real part of each parameter's shard (ceil(d0/G) rows, fewer or none
                on the last local ranks) is one tensor; those of at least ``min_numel`` elements are cut into
                groups by ``exchange.fusion.cut`` in the unit's order (the frontend's own call), and each
                group is one allgather among R ranks of P = sum_i ``codec.sizes.payload_size``(n_i) bytes per
                rank (20-byte header + 4-byte scaler + ceil(n_i·b/8) codes): (R-1)·alpha + (R-1)·P·beta
                (``exchange.cost.terngrad_allgather_cost``, per-rank scalers: no handshake; the FSDP engine
                runs with joins=False, so no presence check either); the rest (LayerNorm weights and biases,
                biases: all under 4096 elements per shard) is one fp32 allreduce per unit.  The slowest
                local rank sets each unit's time.  ``exchange="sharded"``, "reternarized", "requantized" (settings
                the frontend passes to its engine) charge ``terngrad_sharded_cost``, ``..._reternarized_cost``,
                ``..._requantized_cost`` instead; the default, ``TernGradConfig()``'s ``exchange="default"``
                (:data:`HSDP_TERNGRAD_DEFAULT`), is ``default_transport(R)``: the allgather among R <= 4
                replicas, the requantized exchange among more.
                Owner-step (:data:`HSDP_TERNGRAD_OWNER_STEP`; modelled, not built for HSDP: ``optim.OwnerStepOptimizer``
                runs on flat data parallelism): the reduction of the replicated dimension done the owner-step way,
                each local rank's shard of a unit stepped in R pieces, one per replica, each by its owner:
                per unit one ``exchange.cost.terngrad_owner_step_cost`` of the unit's compressed real parts among
                the R ranks (the gradients' alltoall to the owners, their weight differences back by allgather,
                the flags' allreduce; base-3 unless the config says otherwise, as its optimizer), the rest one fp32
                allreduce per unit as above.
* T_codec (optional, ``codec_elements_per_s``; off by default as in :func:`predict_step`): per rank
  ``codec_work_elements`` of its shard: TernGrad allgather n_c·(1 + R) (encode + decode of R payloads),
  sharded 3·n_c, bf16 2·S (cast out and back), fp32 0, over the given rate.

Compute: forward + backward of ``sequences`` sequences of ``context`` tokens per GPU, at the Megatron-LM
count F = 72·s·l·h²·(1 + s/(6h) + V/(12·l·h)) FLOPs per sequence (Narayanan et al. 2021, eq. 3 without
activation recomputation: the matmuls of the blocks and the logits, 2 FLOPs a multiply-add, backward twice
forward), divided by the FLOP rate the model's own VGG-A time implies on that GPU (:func:`achieved_flops`:
3·2·MACs of VGG-A's forward x 32 images / ``MODELS["vgga"].compute_s[gpu]``), i.e. a GPU runs the GPT's
dense fp32 matmuls as efficiently as the cuDNN convolutions behind the published VGG-A time.  Memory is not
modelled (a 1.3B model in fp32 with AdamW state sharded over 4 GPUs needs about 5.3 GB per GPU before
activations: the GTX 1080's 8 GB are tight).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from ..codec import sizes as wire
from ..config import TernGradConfig
from ..exchange import fusion
from ..exchange.cost import (ExchangeCost, FP16, Network, TERNGRAD_ALLGATHER, TERNGRAD_OWNER_STEP, TERNGRAD_REQUANTIZED,
                             TERNGRAD_RETERNARIZED, TERNGRAD_SHARDED, allreduce_cost, cross_network, ring_allgather_time,
                             ring_allreduce_time, terngrad_allgather_cost, terngrad_owner_step_cost,
                             terngrad_requantized_cost, terngrad_reternarized_cost, terngrad_sharded_cost)
from ..exchange.names import TERNGRAD_DEFAULT, method_of_transport
from ..exchange.policy import default_transport
from .perfmodel import Cluster, MODELS, codec_work_elements, payload_bytes, terngrad_config

HSDP_FP32 = "hsdp_fp32"
HSDP_BF16 = "hsdp_bf16"
HSDP_TERNGRAD = "hsdp_terngrad"                  #: TernGradConfig(exchange="allgather"): per-rank scalers
HSDP_TERNGRAD_SHARDED = "hsdp_terngrad_sharded"  #: TernGradConfig(exchange="sharded") across nodes (what-if)
HSDP_TERNGRAD_RETERNARIZED = "hsdp_terngrad_reternarized"  #: TernGradConfig(exchange="reternarized") across nodes
HSDP_TERNGRAD_REQUANTIZED = "hsdp_terngrad_requantized"    #: TernGradConfig(exchange="requantized") across nodes
#: the frontend's default, TernGradConfig(): exchange="default" among the R replicas, ``default_transport(R)``
#: (the allgather up to 4 nodes, the requantized exchange above)
HSDP_TERNGRAD_DEFAULT = "hsdp_terngrad_default"
#: the owner-step optimizer's exchange across the R replicas (modelled, not built for HSDP)
HSDP_TERNGRAD_OWNER_STEP = "hsdp_terngrad_owner_step"
HSDP_TERNGRAD_METHODS = (HSDP_TERNGRAD_DEFAULT, HSDP_TERNGRAD, HSDP_TERNGRAD_SHARDED, HSDP_TERNGRAD_RETERNARIZED,
                         HSDP_TERNGRAD_REQUANTIZED, HSDP_TERNGRAD_OWNER_STEP)
HSDP_METHODS = (HSDP_FP32, HSDP_BF16) + HSDP_TERNGRAD_METHODS
# the flat Horovod/DDP method each HSDP TernGrad method's cross-node exchange is (for its cost and codec work)
_HSDP_FLAT = {HSDP_TERNGRAD: TERNGRAD_ALLGATHER, HSDP_TERNGRAD_SHARDED: TERNGRAD_SHARDED,
              HSDP_TERNGRAD_RETERNARIZED: TERNGRAD_RETERNARIZED, HSDP_TERNGRAD_REQUANTIZED: TERNGRAD_REQUANTIZED,
              HSDP_TERNGRAD_DEFAULT: TERNGRAD_DEFAULT, HSDP_TERNGRAD_OWNER_STEP: TERNGRAD_OWNER_STEP}


def _config(config: TernGradConfig | None, method: str) -> TernGradConfig:
    """``config``, or the default of ``method``'s runner: ``TernGradConfig()``, or for owner-step its optimizer's
    (base-3: ``perfmodel.terngrad_config``)."""
    return config if config is not None else terngrad_config(method=_HSDP_FLAT.get(method))


def hsdp_exchange(method: str, replicas: int) -> str:
    """The flat method (``TERNGRAD_ALLGATHER``, ...) that an HSDP TernGrad method runs among R = ``replicas``
    ranks across nodes: the default's is ``default_transport(R)``'s."""
    flat = _HSDP_FLAT[method]
    return method_of_transport(default_transport(int(replicas))) if flat == TERNGRAD_DEFAULT else flat
HSDP_WORKERS = (8, 16, 32, 64, 128, 256, 512)


def _linear(name: str, n_in: int, n_out: int) -> list[tuple[str, tuple]]:
    """A GPT-2 ``Conv1D``: weight (in, out), FSDP2 shards its dim 0 = in; bias (out,)."""
    return [(f"{name}.weight", (n_in, n_out)), (f"{name}.bias", (n_out,))]


@dataclass(frozen=True)
class GPTConfig:
    """A GPT in Hugging Face ``GPT2LMHeadModel``'s layout (pre-LN blocks, learned positions, Conv1D weights
    stored (in, out), LM head tied to the token embedding)."""

    name: str
    layers: int
    d_model: int
    vocab: int
    context: int
    d_ff: int = 0            #: 0: 4·d_model

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    def units(self) -> list[tuple[str, list[tuple[str, tuple]]]]:
        """FSDP units as the frontend's example shards them (every block, then the root), each with its
        parameters (name, shape) in registration order (the order FSDP2 lays out a unit's flat shard)."""
        d = self.d_model
        out = []
        for i in range(self.layers):
            p = f"transformer.h.{i}"
            out.append((p, [(f"{p}.ln_1.weight", (d,)), (f"{p}.ln_1.bias", (d,))]
                        + _linear(f"{p}.attn.c_attn", d, 3 * d) + _linear(f"{p}.attn.c_proj", d, d)
                        + [(f"{p}.ln_2.weight", (d,)), (f"{p}.ln_2.bias", (d,))]
                        + _linear(f"{p}.mlp.c_fc", d, self.ff) + _linear(f"{p}.mlp.c_proj", self.ff, d)))
        out.append(("", [("transformer.wte.weight", (self.vocab, d)), ("transformer.wpe.weight", (self.context, d)),
                         ("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]))
        return out

    def tensors(self) -> list[tuple[str, tuple]]:
        """Every parameter tensor (name, shape), in ``GPT2LMHeadModel.named_parameters()``'s order."""
        units = self.units()
        return units[-1][1][:2] + [t for _, ts in units[:-1] for t in ts] + units[-1][1][2:]

    @property
    def parameters(self) -> int:
        return sum(math.prod(s) for _, s in self.tensors())

    def flops_per_sequence(self, context: int | None = None) -> float:
        """Forward + backward FLOPs of one sequence of s tokens (Megatron-LM's count, 4h feed-forward):
        72·s·l·h²·(1 + s/(6h) + V/(12·l·h)).  Cost: O(1)."""
        s, l, h, V = int(context or self.context), self.layers, self.d_model, self.vocab
        return 72.0 * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


#: GPT-3 1.3B ("GPT-3 XL", Brown et al. 2020, Table 2.1: 24 layers, d_model 2048, 16 heads, context 2048) with
#: GPT-2's vocabulary of 50257 and layout: 1,315,723,264 parameters in 292 tensors.
GPT3_1P3B = GPTConfig("GPT-3 1.3B", 24, 2048, 50257, 2048)
GPT_MODELS = {"gpt3-1.3b": GPT3_1P3B}


def vgga_forward_macs(image: int = 224) -> int:
    """Multiply-adds of one VGG-A (VGG-11) forward pass on an image x image input: the 8 3x3 convolutions at
    their feature-map sizes (a 2x2 pool after convolutions 1, 2, 4, 6 and 8) and the 3 fc layers
    (7,609,090,048 at 224)."""
    macs, c_in, hw = 0, 3, image
    for i, c_out in enumerate((64, 128, 256, 256, 512, 512, 512, 512), 1):
        macs += hw * hw * c_out * c_in * 9
        c_in = c_out
        if i in (1, 2, 4, 6, 8):
            hw //= 2
    return macs + c_in * hw * hw * 4096 + 4096 * 4096 + 4096 * 1000


def achieved_flops(gpu: str) -> float:
    """FLOP/s the model's compute assumptions give a GPU kind: VGG-A's training FLOPs (3 x 2 x forward
    multiply-adds) per batch of 32 over ``MODELS["vgga"].compute_s[gpu]`` (GTX 1080: 5.98e12, 0.67 of its
    8.9 TFLOP/s fp32 peak; P100: 1.2 times that, the model's P100/GTX 1080 ratio)."""
    vgg = MODELS["vgga"]
    return 6.0 * vgga_forward_macs() * vgg.batch_per_gpu / vgg.compute_s[gpu]


def hsdp_compute_s(model: GPTConfig, gpu: str, sequences: int = 1) -> float:
    """Forward + backward of ``sequences`` sequences of ``model.context`` tokens on one GPU of kind ``gpu``:
    ``sequences · model.flops_per_sequence() / achieved_flops(gpu)``."""
    return sequences * model.flops_per_sequence() / achieved_flops(gpu)


def fsdp_shard_numel(shape: Sequence[int], G: int, local_rank: int) -> int:
    """Elements of local rank j's real part of a parameter sharded by FSDP2 on dim 0 over G ranks:
    rows min(d0, (j+1)·c) - j·c (at least 0), c = ceil(d0/G), times the other dimensions."""
    d0, rest = int(shape[0]), math.prod(int(x) for x in shape[1:])
    c = -(-d0 // G)
    return max(0, min(d0, (local_rank + 1) * c) - local_rank * c) * rest


def fsdp_padded_numel(shape: Sequence[int], G: int) -> int:
    """Elements of every rank's padded shard of a parameter: ceil(d0/G)·(other dimensions)."""
    return -(-int(shape[0]) // G) * math.prod(int(x) for x in shape[1:])


@dataclass(frozen=True)
class HSDPUnitShard:
    """One FSDP unit as local rank ``local_rank`` of G sends it across nodes: ``padded`` = its flat shard's
    elements (what FSDP reduce-scatters to it and native HSDP all-reduces), ``groups`` = the TernGrad groups
    (``exchange.fusion.cut`` of the compressed real parts, in the unit's order; tuples of element counts),
    ``plain`` = elements the policy keeps at fp32 (one allreduce)."""

    name: str
    local_rank: int
    padded: int
    groups: tuple
    plain: int
    root: bool = False

    @property
    def compressed(self) -> int:
        return sum(sum(g) for g in self.groups)


def hsdp_unit_shards(model: GPTConfig, G: int, local_rank: int,
                     config: TernGradConfig | None = None) -> list[HSDPUnitShard]:
    """Every unit of ``model`` on local rank j of G, cut as ``frontends/fsdp.py`` cuts it: empty real parts
    skipped, ``config.compresses`` (min_numel, exclude) on each real part, ``fusion.cut`` of the rest."""
    cfg = config or TernGradConfig()
    out = []
    units = model.units()
    for k, (name, params) in enumerate(units):
        real = [(n, fsdp_shard_numel(s, G, local_rank)) for n, s in params]
        real = [(n, x) for n, x in real if x > 0]
        plan = fusion.cut([fusion.TensorSpec(n, x) for n, x in real], cfg)
        plain = set(plan.uncompressed)
        out.append(HSDPUnitShard(name, local_rank, sum(fsdp_padded_numel(s, G) for _, s in params),
                                 tuple(tuple(plan.numel[n] for n in g) for g in plan.groups),
                                 sum(x for n, x in real if n in plain), k == len(units) - 1))
    return out


@dataclass(frozen=True)
class HSDPStep:
    """Predicted HSDP iteration of one rank (seconds).  ``cross_bytes``: bytes one rank receives across nodes
    per step (the slowest local rank's; the node's link carries G times that), ``payload_bytes``: what that
    rank puts in its TernGrad allgathers (sum of ``codec.sizes.payload_size``; 0 for fp32/bf16)."""

    method: str
    workers: int
    gpus_per_node: int
    compute_s: float
    intra_s: float
    cross_s: float
    codec_s: float
    step_s: float
    cross_bytes: float
    payload_bytes: int
    shard_elements: int
    tokens_per_worker: int
    speedup_vs_bf16: float = float("nan")
    limit_s: float = float("nan")     #: compute + intra-node + the 2-bit payload at the cross link's rate

    @property
    def nodes(self) -> int:
        return self.workers // self.gpus_per_node

    @property
    def tokens_per_s(self) -> float:
        return self.workers * self.tokens_per_worker / self.step_s

    @property
    def comm_s(self) -> float:
        return self.intra_s + self.cross_s


def hsdp_intra_s(units: Sequence[HSDPUnitShard], G: int, network: Network, reduce_bytes: int = 4) -> float:
    """Intra-node time of one step: per unit a ring reduce-scatter of the gradients,
    (G-1)·alpha + (G-1)·reduce_bytes·S_u·beta/L (half a ring allreduce of the unpadded G·S_u), and 2 (a block)
    or 1 (the root) fp32 parameter all-gathers, ``ring_allgather_time(4·S_u, G)``, on ``network.intra_node``."""
    t = 0.0
    for u in units:
        gather, scatter = hsdp_unit_intra_s(u, G, network, reduce_bytes)
        t += scatter
        t += (1 if u.root else 2) * gather
    return t


def hsdp_unit_intra_s(unit: HSDPUnitShard, G: int, network: Network, reduce_bytes: int = 4) -> tuple[float, float]:
    """(one fp32 parameter all-gather, the gradient reduce-scatter) of one unit on ``network.intra_node``
    (``hsdp_intra_s``'s terms); (0, 0) on a node of one GPU."""
    if G <= 1:
        return 0.0, 0.0
    intra = network.intra_node or network
    return (ring_allgather_time(4 * unit.padded, G, intra),
            ring_allreduce_time(reduce_bytes * unit.padded * G, G, intra) / 2)


def _hsdp_replicas(network: Network, workers: int) -> tuple[int, int, int]:
    """(G, N, R) of an HSDP job: GPUs per node, workers, replicas; N must be a multiple of G."""
    G = max(1, int(network.ranks_per_node))
    N = int(workers)
    if N < G or N % G:
        raise ValueError(f"workers must be a multiple of the {G} GPUs of a node, got {N}")
    return G, N, N // G


def _hsdp_payload(method: str, units: Sequence[HSDPUnitShard], cfg: TernGradConfig, replicas: int) -> int:
    """Bytes this rank puts in its TernGrad payloads per step (0 for fp32/bf16)."""
    if method not in HSDP_TERNGRAD_METHODS:
        return 0
    k = cfg.bucket_size
    return sum(wire.payload_size(x, cfg.packing, k) for u in units for g in u.groups for x in g)


def _hsdp_limit(compute_s: float, intra_s: float, payload: int, cross: Network, R: int) -> float:
    """The limit of a TernGrad step: compute, the intra-node stages and this rank's 2-bit payload once over its
    share of the node's link (no latency, no second stage): what no cross-node exchange can beat."""
    return compute_s + intra_s + (payload / cross.bandwidth_Bps if R > 1 else 0.0)


def hsdp_cross_cost(method: str, units: Sequence[HSDPUnitShard], replicas: int, network: Network,
                    config: TernGradConfig | None = None) -> ExchangeCost:
    """Cross-node exchange of one local rank's shards among R = ``replicas`` ranks, on ``network`` as its
    cross link (the caller passes ``cross_network(network, G)``): the sum over units (see the section comment
    above).  Returns the ``ExchangeCost`` sum (time, bytes received, messages, elements)."""
    cfg = _config(config, method)
    R = int(replicas)
    total = ExchangeCost(method, 0.0, 0.0, 0, 0)
    for u in units:
        if method in (HSDP_FP32, HSDP_BF16):
            total = total + allreduce_cost(u.padded, R, network, 4 if method == HSDP_FP32 else 2)
            continue
        if method not in HSDP_TERNGRAD_METHODS:
            raise ValueError(f"method must be one of {HSDP_METHODS}, got {method!r}")
        flat, k = hsdp_exchange(method, R), cfg.bucket_size
        # the owner-step way: the unit's compressed parts in one exchange, as the optimizer fuses a step's tensors
        groups = [[x for g in u.groups for x in g]] if flat == TERNGRAD_OWNER_STEP and u.groups else u.groups
        for g in groups:
            if flat == TERNGRAD_ALLGATHER:
                total = total + terngrad_allgather_cost(list(g), R, network, cfg.packing, k,
                                                        cfg.scaler_shared_for("allgather"))
            elif flat == TERNGRAD_RETERNARIZED:
                total = total + terngrad_reternarized_cost(list(g), R, network, cfg.packing, k,
                                                           cfg.scaler_shared_for("reternarized"),
                                                           cfg.first_stage_format("reternarized"))
            elif flat == TERNGRAD_REQUANTIZED:      # with the noise channel: the optimizer's default recipe
                total = total + terngrad_requantized_cost(list(g), R, network, cfg.packing, k,
                                                          first=cfg.first_stage_format("requantized"))
            elif flat == TERNGRAD_OWNER_STEP:       # with the squares for the noise estimate, as above
                total = total + terngrad_owner_step_cost(list(g), R, network, cfg.packing, k,
                                                         first=cfg.first_stage_format("requantized"))
            else:
                total = total + terngrad_sharded_cost(list(g), R, network, cfg.packing, k)
        if u.plain:
            total = total + allreduce_cost(u.plain, R, network, 4)
    return replace(total, method=method)


def predict_hsdp_step(model: GPTConfig, workers: int, network: Network, method: str = HSDP_TERNGRAD, *,
                      compute_s: float, sequences: int = 1, overlap: float = 0.0,
                      codec_elements_per_s: float | None = None,
                      config: TernGradConfig | None = None) -> HSDPStep:
    """One HSDP step on N = ``workers`` GPUs in nodes of G = ``network.ranks_per_node`` (N a multiple of G;
    R = N/G replicas).  T_step = T_compute + T_intra + T_cross + T_codec - min(T_intra + T_cross + T_codec,
    overlap·T_compute), the terms of the section comment; the slowest local rank's T_cross + T_codec.
    Cost: O(G · tensors)."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError("overlap must be in [0, 1]")
    G, N, R = _hsdp_replicas(network, workers)
    cfg = _config(config, method)
    cross = cross_network(network, G)
    worst = None
    for j in range(G):
        units = hsdp_unit_shards(model, G, j, cfg)
        cost = hsdp_cross_cost(method, units, R, cross, cfg)
        codec = 0.0
        if codec_elements_per_s and R > 1:
            n_c = sum(u.compressed for u in units)
            if method == HSDP_FP32:
                work = 0.0
            elif method == HSDP_BF16:
                work = codec_work_elements(FP16, sum(u.padded for u in units), R)
            else:
                work = codec_work_elements(hsdp_exchange(method, R), n_c, R)
            codec = work / codec_elements_per_s
        payload = _hsdp_payload(method, units, cfg, R)
        if worst is None or cost.time_s + codec > worst[0].time_s + worst[1]:
            worst = (cost, codec, payload, units)
    cost, codec, payload, units = worst
    intra = hsdp_intra_s(units, G, network, 2 if method == HSDP_BF16 else 4)
    exposed = intra + cost.time_s + codec
    step = compute_s + exposed - min(exposed, overlap * compute_s)
    return HSDPStep(method, N, G, compute_s, intra, cost.time_s, codec, step, cost.bytes_received, payload,
                    sum(u.padded for u in units), sequences * model.context,
                    limit_s=_hsdp_limit(compute_s, intra, payload, cross, R))


def scheduled_hsdp_step(model: GPTConfig, workers: int, network: Network, method: str = HSDP_TERNGRAD, *,
                        compute_s: float, sequences: int = 1, backward_fraction: float = 2 / 3,
                        config: TernGradConfig | None = None) -> HSDPStep:
    """One HSDP step scheduled unit by unit, as FSDP2 runs it on a GPU, with three resources: the compute
    stream, the intra-node link (FSDP's parameter all-gathers and gradient reduce-scatters, one at a time in
    the order they are issued) and the cross-node link (the replicas' all-reduce of each unit's shard: native
    HSDP's, or TernGrad's exchange through the all-reduce hook, which runs on FSDP's all-reduce stream).

    Forward, units in order: unit k's all-gather is issued at once (FSDP prefetches; the link takes them one
    after another) and its compute (its share of the forward time, by its parameters) starts when that
    all-gather is done and unit k-1 has computed.  Backward, units in reverse: a unit other than the root
    gathers its parameters again (issued when the unit after it starts its backward: one unit of prefetch),
    computes its backward share, then its reduce-scatter is issued, then its cross-node exchange (the cost
    ``hsdp_cross_cost`` charges for that unit alone).  The step ends when the compute and the last exchange
    are done (the optimizer and the codec, free on a GPU in these tables, are not charged).  The slowest local
    rank's schedule is returned; ``intra_s`` / ``cross_s`` are the links' busy times, ``limit_s`` as in
    ``predict_hsdp_step``.  What ``predict_hsdp_step`` adds up (overlap 0) this lets overlap where FSDP2 does;
    both charge the same bytes and latencies."""
    if not 0.0 <= backward_fraction <= 1.0:
        raise ValueError("backward_fraction must be in [0, 1]")
    G, N, R = _hsdp_replicas(network, workers)
    cfg = _config(config, method)
    cross = cross_network(network, G)
    reduce_bytes = 2 if method == HSDP_BF16 else 4
    worst = None
    for j in range(G):
        units = hsdp_unit_shards(model, G, j, cfg)
        total = sum(u.padded for u in units) or 1
        gather, scatter = zip(*(hsdp_unit_intra_s(u, G, network, reduce_bytes) for u in units))
        costs = [hsdp_cross_cost(method, [u], R, cross, cfg) for u in units] if R > 1 else []
        across = [c.time_s for c in costs] or [0.0] * len(units)
        fwd = [compute_s * (1 - backward_fraction) * u.padded / total for u in units]
        bwd = [compute_s * backward_fraction * u.padded / total for u in units]
        link_free = cross_free = t = 0.0
        for k in range(len(units)):                       # forward
            link_free = link_free + gather[k]             # prefetched back to back from the step's start
            t = max(t, link_free) + fwd[k]
        order = list(range(len(units)))[::-1]
        ready = {}
        if not units[order[0]].root:
            link_free = max(link_free, t) + gather[order[0]]
            ready[order[0]] = link_free
        for i, k in enumerate(order):                     # backward
            if i + 1 < len(order) and not units[order[i + 1]].root:     # prefetch the next unit's parameters
                link_free = max(link_free, t) + gather[order[i + 1]]
                ready[order[i + 1]] = link_free
            t = max(t, ready.get(k, 0.0)) + bwd[k]
            link_free = max(link_free, t) + scatter[k]
            cross_free = max(cross_free, link_free) + across[k]
        step = max(t, link_free, cross_free)
        if worst is None or step > worst[0]:
            worst = (step, units, costs)
    step, units, costs = worst
    payload = _hsdp_payload(method, units, cfg, R)
    intra = hsdp_intra_s(units, G, network, reduce_bytes)       # the intra-node link's busy time
    return HSDPStep(method, N, G, compute_s, intra, sum(c.time_s for c in costs), 0.0, step,
                    sum(c.bytes_received for c in costs), payload, sum(u.padded for u in units),
                    sequences * model.context, limit_s=_hsdp_limit(compute_s, intra, payload, cross, R))


def scheduled_hsdp(model: GPTConfig, cluster: Cluster, workers: Iterable[int] = HSDP_WORKERS,
                   methods: Sequence[str] = HSDP_METHODS, sequences: int = 1, compute_s: float | None = None,
                   **kwargs) -> list[dict[str, HSDPStep]]:
    """``predict_hsdp``'s rows from :func:`scheduled_hsdp_step` (``speedup_vs_bf16`` against the scheduled
    bf16 step)."""
    c = hsdp_compute_s(model, cluster.gpu, sequences) if compute_s is None else compute_s
    rows = []
    for N in workers:
        steps = {m: scheduled_hsdp_step(model, N, cluster.network, m, compute_s=c, sequences=sequences, **kwargs)
                 for m in methods}
        base = steps.get(HSDP_BF16) or scheduled_hsdp_step(model, N, cluster.network, HSDP_BF16, compute_s=c,
                                                           sequences=sequences, **kwargs)
        rows.append({m: replace(p, speedup_vs_bf16=base.step_s / p.step_s) for m, p in steps.items()})
    return rows


def predict_hsdp(model: GPTConfig, cluster: Cluster, workers: Iterable[int] = HSDP_WORKERS,
                 methods: Sequence[str] = HSDP_METHODS, sequences: int = 1, compute_s: float | None = None,
                 **kwargs) -> list[dict[str, HSDPStep]]:
    """For each N, {method: HSDPStep} with ``speedup_vs_bf16`` = T_step(bf16 HSDP) / T_step(method); compute
    from :func:`hsdp_compute_s` on ``cluster.gpu`` unless given.  ``kwargs`` go to :func:`predict_hsdp_step`."""
    c = hsdp_compute_s(model, cluster.gpu, sequences) if compute_s is None else compute_s
    rows = []
    for N in workers:
        base = predict_hsdp_step(model, N, cluster.network, HSDP_BF16, compute_s=c, sequences=sequences, **kwargs)
        row = {}
        for m in methods:
            p = base if m == HSDP_BF16 else predict_hsdp_step(model, N, cluster.network, m, compute_s=c,
                                                                 sequences=sequences, **kwargs)
            row[m] = replace(p, speedup_vs_bf16=base.step_s / p.step_s)
        rows.append(row)
    return rows


def format_hsdp_table(model: GPTConfig, cluster: Cluster, rows: list[dict[str, HSDPStep]],
                      markdown: bool = False) -> str:
    """GPUs x step time of fp32 and bf16 HSDP, of ``default`` (TernGrad as ``TernGradConfig()`` runs it across
    nodes: ``default_transport(R)``) with its ratio to the limit and its speedup over bf16 HSDP, of TernGrad with
    each exchange named (TG: allgather, TG-sh: sharded, TG-rt: re-ternarized, TG-rq: requantized, TG-os: the
    owner-step optimizer's exchange, modelled, not built for HSDP), the limit
    (compute, intra-node, the 2-bit payload once at the cross link's rate; the same for every TernGrad exchange)
    and the re-ternarized exchange against it, speedups over bf16 HSDP, and the cross-node MB one rank receives
    per step.  A method the rows do not hold shows "-"."""
    first = rows[0][HSDP_BF16]
    head = (f"HSDP {model.name} ({model.parameters / 1e9:.3f}B parameters in {len(model.tensors())} tensors) on "
            f"{cluster.name} ({cluster.network.describe()}); {first.tokens_per_worker} tokens/GPU; compute "
            f"{first.compute_s:.2f} s/iteration")
    cols = ["GPUs", "nodes", "fp32 s", "bf16 s", "default", "default / limit", "default vs bf16", "TG s", "TG-sh s",
            "TG-rt s", "TG-rq s", "TG-os s", "TG-rt limit s", "TG-rt / limit", "TG vs bf16", "TG-sh vs bf16",
            "TG-rt vs bf16", "TG-rq vs bf16", "TG-os vs bf16", "limit vs bf16", "intra s", "bf16 MB", "TG MB",
            "TG-rt MB", "TG-rq MB", "TG-os MB", "default MB"]
    out = []

    def sec(p):
        return f"{p.step_s:.2f}" if p else "-"

    def vs(p):
        return f"{p.speedup_vs_bf16:.2f}x" if p else "-"

    def mb(p):
        return f"{p.cross_bytes / 1e6:.0f}" if p else "-"

    for r in rows:
        tg, bf = r[HSDP_TERNGRAD], r[HSDP_BF16]
        sh, rt = r.get(HSDP_TERNGRAD_SHARDED), r.get(HSDP_TERNGRAD_RETERNARIZED)
        rq, df = r.get(HSDP_TERNGRAD_REQUANTIZED), r.get(HSDP_TERNGRAD_DEFAULT)
        os_ = r.get(HSDP_TERNGRAD_OWNER_STEP)
        out.append([f"{bf.workers}", f"{bf.nodes}", f"{r[HSDP_FP32].step_s:.2f}", f"{bf.step_s:.2f}",
                    sec(df), f"{df.step_s / df.limit_s:.2f}x" if df else "-", vs(df),
                    f"{tg.step_s:.2f}", sec(sh), sec(rt), sec(rq), sec(os_),
                    f"{rt.limit_s:.2f}" if rt else "-", f"{rt.step_s / rt.limit_s:.2f}x" if rt else "-",
                    vs(tg), vs(sh), vs(rt), vs(rq), vs(os_), f"{bf.step_s / tg.limit_s:.2f}x",
                    f"{tg.intra_s:.2f}", mb(bf), mb(tg), mb(rt), mb(rq), mb(os_), mb(df)])
    if markdown:
        lines = [f"**{head}**", "", "| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
        return "\n".join(lines + ["| " + " | ".join(v) + " |" for v in out])
    width = [max(len(c), *(len(v[i]) for v in out)) for i, c in enumerate(cols)]
    lines = [head, "  ".join(f"{c:>{w}}" for c, w in zip(cols, width))]
    return "\n".join(lines + ["  ".join(f"{v:>{w}}" for v, w in zip(vals, width)) for vals in out])
