"""User-facing settings of TernGrad, validated once."""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from .codec.sizes import FOUR_LEVEL, PACKINGS
from .errors import NonFiniteGradientError, RankMismatchError, TernGradError  # noqa: F401 (re-exported)

NONFINITE_POLICIES = ("propagate", "raise", "zero")
EXCHANGES = ("default", "allgather", "sharded", "reternarized", "requantized", "auto")
HIERARCHICAL = ("auto", True, False)
LEVELS = (3, 4)                                       # the first stage's code: ternary, or four levels (codec/levels.py)
FOUR_LEVEL_TRANSPORTS = ("requantized", "reternarized")   # the transports whose owners decode each sender's codes
INTRA_NODE_DTYPES = {"float32": 4, "bfloat16": 2}     # the node-aware exchange's stages inside a node: bytes each


@dataclass(frozen=True)
class TernGradConfig:
    """How gradients are ternarized and exchanged.

    clip_factor:   c of Eq. 21; gradients are clipped to ±c·σ before ternarizing. 0 disables.
    packing:       "2bit" (4 elements per byte) or "base3" (5 per byte, 1.6 bits per element).
    levels:        the first stage's code in the shard-owner exchanges ("requantized", the default above 4
                   ranks, "reternarized" and ``OwnerStepOptimizer``'s): 4 (default) = four levels
                   s·{-1, -1/3, 1/3, 1} in 2 bits per element, each rank's dithers stratified against the
                   others' (codec/levels.py): as unbiased as the ternary code, under half its variance per rank,
                   and the ranks' rounding errors negatively correlated, so their average's variance is lower
                   still, at 2 bits per element whatever ``packing`` (which then packs the second stage's ternary
                   codes).  Whole runs at fp32 AdamW's lr (docs/scale.md): the default exchange ends 0.7% below
                   fp32 on the first workload where the ternary code ended 0.9% above, 0.6% above on the third
                   where it ended 3.1% above, and 4.7% below on the second (1.8% below with the ternary code):
                   optim.AdamW's noise estimate over-counts the stratified rounding's variance, so its steps
                   run longer than fp32 AdamW's (median 1.10x on the first workload).  3 = TernGrad's ternary code, packed by ``packing``.  The
                   allgather and sharded exchanges send the ternary code either way (their receivers add codes or
                   share one scaler).
    bucket_size:   0 = one scaler per tensor (layer-wise ternarizing; the two-stage exchanges: per shard);
                   k > 0 = one per k elements.
    min_numel:     tensors with fewer elements travel uncompressed (Horovod's own allreduce, which fuses
                   them).  Default 4096: below it the codec's fixed cost per tensor (statistics, header,
                   scaler, decode: ~0.1-0.2 ms on a CPU core, docs/realshapes.md) exceeds the time its
                   30 saved bits per element buy even at 1 Gbit/s (4096 x 30 bits = 0.12 ms), and such
                   tensors (biases, norms) hold ~0.2% of a ResNet-50's or a transformer's elements but
                   2/3 of their tensors.  0 ternarizes every tensor, as the paper does.
    exclude:       regular expressions; a tensor whose name matches one (re.search) travels
                   uncompressed, e.g. ("fc3",) keeps the last classification layer in fp32 as the
                   paper does for ImageNet models.
    seed:          key of the random stream; with the step, tensor name and rank it fixes every draw.
    shared_scaler: True = all ranks ternarize with s = max over ranks (Eq. 4, one small allreduce-max
                   per group that also checks the ranks agree, a round trip before the payloads may
                   leave); False = each rank its own scaler (no handshake: payloads leave as soon as a
                   group is complete; the payload headers carry scalers and the checks; the decode
                   (Σ_r s_r·t_r)/N is exact, and s_r <= max_r s_r gives each rank's ternary gradient a
                   variance no larger than with the shared scaler).  Default (None): False for the
                   allgather exchange (measured faster on ResNet-50 at 1 Gbit/s, docs/realshapes.md;
                   accuracy in docs/study/), True for "sharded", whose owners add ternary values
                   ("auto": per group, by the exchange it picks); ``scaler_shared_for`` says which
                   applies.  Per-rank scalers cost one 4-byte allreduce per step (is any rank in
                   hvd.join()?); in a step where one is, the groups take the handshake with the max
                   over the active ranks.
    on_nonfinite:  what a NaN/Inf in a gradient on any rank does to that tensor's average, decided on
                   every rank alike.  "propagate" (default) = the average is NaN on every rank, bit for bit
                   (as Horovod's uncompressed allreduce propagates it): a GradScaler (fp16 AMP) sees the
                   overflow on every rank and every rank skips the same step and lowers the scale, and
                   no host synchronization is added on a GPU.  "raise" = NonFiniteGradientError on every
                   rank (for fp32/bf16 training without a loss scaler, where a NaN is a bug; on a GPU it
                   costs one synchronization per tensor sent at full precision); "zero" = the tensor's
                   averaged gradient is zero on every rank this step (counted in the stats, warned once;
                   it hides overflows from a GradScaler, whose scale then never comes down).
    exchange:      "default": "allgather" among up to 4 ranks, "requantized" among more (per exchange: the
                   node-aware exchange decides on its cross group's size), a pure function of N, so no
                   collective decides it; both give horovod_terngrad.optim its noise estimate, both end
                   whole training runs within the accuracy of fp32 (docs/scale.md), and the bits received
                   per element stay under 7.7 at any N (exchange/policy.default_transport).
                   "allgather" (every rank receives every payload: one collective, traffic grows
                   with N), "sharded" (alltoall to shard owners + allgather of their sums: traffic
                   nearly constant in N; needs shared_scaler), "reternarized" (alltoall of each shard's
                   payload to its owner, which averages it and ternarizes the average again; allgather
                   of the owners' 2-bit payloads: about 2 + 2 bits per element at any N, no handshake,
                   but its second ternary rounding costs accuracy over whole runs with AdamW;
                   exchange/reternarized.py), "requantized" (the same first stage; the owners' exact
                   averages travel back in 4-bit groups of 128, with Adam's noise estimate as one bit per
                   element where the optimizer asks: about 2 + 4.25 (+ 1.25) bits at any N;
                   exchange/requantized.py) or "auto" (measures the link once,
                   exchange/link.py: if ternarizing does not pay on it, e.g. a fast link with a CPU
                   codec, gradients travel at full precision and it says so; else per group whichever
                   of the two exchanges "default" runs, the allgather and the requantized one (both give
                   the optimizer's noise estimate), the cost model of exchange/cost.py predicts to be
                   faster on that link, instead of by N alone).  exchange/policy.py decides from this
                   setting, per group.
    fusion_numel:  tensor fusion in the Horovod frontend: the optimizer's compressed parameters, in
                   reverse registration order (about the order backward produces them), are cut into
                   groups of consecutive tensors of at most this many elements in total; a group shares
                   one handshake and one allgather (a tensor larger than this travels alone).  Fusing
                   never changes a result (each tensor keeps its scaler, stream and header); it saves
                   two collectives and their latency per small tensor.  0 disables fusion.
    hierarchical:  node-aware exchange (exchange/hierarchical.py): full-precision reduce-scatter inside a
                   node, TernGrad across nodes on each local rank's shard, allgather inside the node.
                   "auto" (default): where the topology allows it (>= 2 nodes with the same number >= 2
                   of ranks each; not under Horovod elastic) and the policy (exchange/policy.py, pricing
                   with exchange/cost.py) finds it cheaper than the flat exchange for the group; True: wherever the topology allows
                   it; False: never.  Where it cannot apply, the flat exchange runs and rank 0 logs why,
                   once.
    intra_node_dtype: what the node-aware exchange's two stages inside a node carry: "bfloat16" (default:
                   each rank's gradient shard and the averaged shard rounded to nearest bf16 on the wire,
                   half the bytes inside a node, sums still in fp32; the rounding, about 2^-9 relative, is
                   far below the ternary rounding's across nodes, and held-out loss was unchanged within
                   seed noise in docs/scale.md) or "float32" (the node sum and the final average exact).
    """

    clip_factor: float = 2.5
    packing: str = "2bit"
    levels: int = 4
    bucket_size: int = 0
    min_numel: int = 4096
    exclude: tuple = field(default_factory=tuple)
    seed: int = 0
    shared_scaler: bool | None = None
    on_nonfinite: str = "propagate"
    exchange: str = "default"
    fusion_numel: int = 1 << 22
    hierarchical: object = "auto"
    intra_node_dtype: str = "bfloat16"

    def __post_init__(self):
        if isinstance(self.exclude, str):
            object.__setattr__(self, "exclude", (self.exclude,))
        else:
            object.__setattr__(self, "exclude", tuple(self.exclude))
        if not (self.clip_factor >= 0 and self.clip_factor != float("inf")):
            raise ValueError(f"clip_factor must be a finite number >= 0, got {self.clip_factor!r}")
        if self.packing not in PACKINGS:
            raise ValueError(f"packing must be one of {list(PACKINGS)}, got {self.packing!r}")
        if self.levels not in LEVELS:
            raise ValueError(f"levels must be one of {LEVELS}, got {self.levels!r}")
        if int(self.bucket_size) != self.bucket_size or self.bucket_size < 0 or self.bucket_size >= 2 ** 32:
            raise ValueError(f"bucket_size must be an integer in [0, 2^32), got {self.bucket_size!r}")
        if int(self.min_numel) != self.min_numel or self.min_numel < 0:
            raise ValueError(f"min_numel must be an integer >= 0, got {self.min_numel!r}")
        if int(self.fusion_numel) != self.fusion_numel or self.fusion_numel < 0:
            raise ValueError(f"fusion_numel must be an integer >= 0, got {self.fusion_numel!r}")
        if int(self.seed) != self.seed or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_POLICIES}, got {self.on_nonfinite!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if not any(self.hierarchical is h or (isinstance(h, str) and self.hierarchical == h) for h in HIERARCHICAL):
            raise ValueError(f"hierarchical must be 'auto', True or False, got {self.hierarchical!r}")
        if self.intra_node_dtype not in INTRA_NODE_DTYPES:
            raise ValueError(f"intra_node_dtype must be one of {tuple(INTRA_NODE_DTYPES)}, got {self.intra_node_dtype!r}")
        if self.shared_scaler not in (None, True, False):
            raise ValueError(f"shared_scaler must be True, False or None (the exchange's default), "
                             f"got {self.shared_scaler!r}")
        if self.exchange == "sharded" and self.shared_scaler is False:
            raise ValueError(f"exchange={self.exchange!r} needs shared_scaler=True: shard owners add "
                             "ternary values that must share one scaler")
        for pat in self.exclude:
            try:
                re.compile(pat)
            except re.error as e:
                raise ValueError(f"exclude pattern {pat!r} is not a valid regular expression: {e}") from e

    @property
    def shares_scaler(self) -> bool:
        """Whether ranks ternarize with one shared scaler in a group sent by allgather, the exchange of
        every group with ``exchange="allgather"`` (the setting, or the exchange's default)."""
        return self.scaler_shared_for("sharded" if self.exchange == "sharded" else "allgather")

    def scaler_shared_for(self, transport: str) -> bool:
        """Whether a group sent by ``transport`` ("allgather" or "sharded") uses the shared scaler: the
        setting, else only the sharded transport (its owners add ternary values)."""
        return transport == "sharded" if self.shared_scaler is None else bool(self.shared_scaler)

    def first_stage_format(self, transport: str) -> str:
        """The wire format of the payloads a group sent by ``transport`` starts with: "4level" where ``levels`` is 4
        and the transport's owners decode each sender's codes, else the ternary ``packing``."""
        return FOUR_LEVEL if self.levels == 4 and transport in FOUR_LEVEL_TRANSPORTS else self.packing

    def compresses(self, name: str, numel: int) -> bool:
        """Whether a tensor of this name and size is ternarized (else it travels uncompressed)."""
        if numel < self.min_numel:
            return False
        return not any(re.search(p, name) for p in self.exclude)

    @property
    def intra_node_width(self) -> int:
        """Bytes per element of the node-aware exchange's stages inside a node (``intra_node_dtype``)."""
        return INTRA_NODE_DTYPES[self.intra_node_dtype]

    def replace(self, **changes) -> "TernGradConfig":
        return replace(self, **changes)
