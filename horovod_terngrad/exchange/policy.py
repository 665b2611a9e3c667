"""The policy: for a group, which transport carries it, whether it goes node-aware, and across nodes by which
transport.  The one module that resolves the settings: ``TernGradConfig.exchange`` ("default", "auto" or a
transport's name; names.py names them) and ``TernGradConfig.hierarchical`` ("auto", True, False).  It prices its
candidates with cost.py's pure functions; the engine (engine.py), the node-aware exchange (hierarchical.py), the
frontends (frontends/hierarchy.py) and the performance model ask it, so they decide alike.

Words: a *transport* is a wire algorithm (allgather, sharded, reternarized, requantized; joined while a rank is
in ``hvd.join()``, which the engine takes on its own); a *setting* is the user's ``exchange=`` value, which
names a transport or a rule for picking one:

* "default" (``TernGradConfig()``): a pure function of the number of ranks in the exchange
  (:func:`default_transport`), so every rank decides alike without a collective;
* "auto": per group, the transport of :data:`AUTO_TRANSPORTS` the cost model predicts to be fastest on the
  agreed network (:func:`auto_transport`);
* a transport's name: that transport.

Every input is something every rank agrees on (the group's element counts, the number of ranks, the
topology, the configured network or the measured and agreed one), so every rank gets the same plan.

An engine's :class:`ExchangePlan` holds what it decided once, before its first exchange (``Engine.plan_exchange``,
the plan step: any link measurement, then the plan, by every rank at the same point): its per-group reads
(:meth:`ExchangePlan.transport`, :meth:`ExchangePlan.group`, :meth:`ExchangePlan.cross_transport`) apply the rules
below to a group's sizes, and :meth:`ExchangePlan.describe` is rank 0's one line saying what runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from . import cost, names, network_env
from .names import (ALLGATHER, AUTO, DEFAULT, REQUANTIZED, RETERNARIZED,  # noqa: F401 (policy.AUTO, policy.DEFAULT)
                    SHARDED)

#: ``TernGradConfig.hierarchical``'s rule (True and False force it)
HIERARCHY_AUTO = "auto"

# "default": the allgather up to this many ranks in the exchange, the requantized transport above.  Received bits
# per element on GPT-2's tensors: allgather 2·(N-1) (2, 4, 6 at N = 2, 3, 4), requantized (N-1)/N·(2 + 4.25 + 1.25)
# plus shard headers with the noise channel horovod_terngrad.optim asks for (5.63 at N = 4, 6.57 at 8, 7.41 at 64,
# 7.68 at 512; 6.41 at 512 without it): up to N = 4 the allgather has one collective instead of two and no second
# rounding; from N = 5 on the two-stage exchange receives less.  Chosen over the re-ternarized transport in
# 128-element buckets (2 + 2.25 bits: 4.54 at 64, 5.49 at 512) for accuracy over whole runs: its second ternary
# rounding's variance, s'·|a| - a² per element, is up to 49x the requantized one's, and its noise estimate
# s'²·|t'| is the received gradient's own square, which pins Adam's corrected second moment at its floor
# (docs/scale.md, "Whole runs").
DEFAULT_ALLGATHER_MAX_RANKS = 4

# "auto" weighs, per group, the two transports "default" runs (the allgather; above 4 ranks the requantized one),
# both measured accurate over whole runs and both giving horovod_terngrad.optim its noise estimate, by modelled
# time instead of by N alone.  Not the sharded transport (no noise estimate, and the shared scaler's handshake);
# not the re-ternarized one, whose second ternary rounding costs accuracy over whole runs (docs/scale.md).
AUTO_TRANSPORTS = cost.NOISE_TRANSPORTS


@dataclass(frozen=True)
class Plan:
    """What the policy decided for one group.

    ``transport``: the flat exchange's transport among all the group's ranks (None where the flat engine picks
    per group on its own measured link: "auto" in a node-aware plan that stays flat).  ``hierarchical``: whether
    the group goes through the node-aware exchange.  ``cross_transport``: its transport across nodes (None: flat,
    or "auto", where each local rank picks for its own pieces, :func:`cross_transport`).  ``bucket_size``: the
    scaler bucket the transports were priced with.  ``reason``: why, in words."""

    transport: str | None
    hierarchical: bool
    cross_transport: str | None
    bucket_size: int
    reason: str


def default_transport(n_ranks: int) -> str:
    """The transport "default" runs among ``n_ranks`` ranks (the cross group's M for the node-aware exchange)."""
    return ALLGATHER if int(n_ranks) <= DEFAULT_ALLGATHER_MAX_RANKS else REQUANTIZED


def setting_among(setting: str, n_ranks: int) -> str:
    """``setting`` with "default" replaced by the transport it runs among ``n_ranks`` ranks; any other setting
    ("auto" included) itself."""
    return default_transport(n_ranks) if setting == DEFAULT else setting


def transport_among(setting: str | None, n_ranks: int) -> str | None:
    """The transport ``setting`` runs among ``n_ranks`` ranks whatever the group: "default"'s, or the one named;
    None for "auto" (or None), which decides per group (:func:`auto_transport`)."""
    if setting is None or setting == AUTO:
        return None
    return setting_among(setting, n_ranks)


def measures_link(config) -> bool:
    """Whether the flat engine's plan step measures its link, before its first exchange (exchange/link.py): "auto"
    prices the measured link, and leaves the tensors at full precision where ternarizing does not pay there."""
    return config.exchange == AUTO


def measures_node_links(config) -> bool:
    """Whether the node-aware engine may measure its links across and inside nodes (exchange/link.py's
    ``measure_links``): only ``hierarchical="auto"`` prices them; True and False decide without a price."""
    return config.hierarchical == HIERARCHY_AUTO


def auto_candidates(n_ranks: int) -> tuple:
    """The methods "auto" weighs among ``n_ranks`` ranks: the allgather alone at two ranks or fewer."""
    return cost.cheapest_candidates(n_ranks, AUTO_TRANSPORTS)


def auto_transport(numels: Sequence[int], n_ranks: int, packing: str, bucket_size: int = 0,
                   network: cost.Network | None = None, shared_scaler: bool = False) -> str:
    """"auto"'s transport for a group of tensors of these sizes among ``n_ranks`` ranks: the cheaper of
    :data:`AUTO_TRANSPORTS` on ``network`` (default ``network_env.configured_network()``), the allgather at two ranks
    or fewer.  ``shared_scaler``: the allgather's scaler setting (``TernGradConfig.scaler_shared_for``)."""
    return cost.cheapest_transport(numels, n_ranks, packing, bucket_size, network=network,
                                   shared_scaler=shared_scaler, candidates=AUTO_TRANSPORTS)


def flat_plan(config, numels: Sequence[int], n_ranks: int, link=None, network: cost.Network | None = None) -> Plan:
    """The plan of a group exchanged flat among ``n_ranks`` ranks (the engine's, per group).  ``link``: the
    measured and agreed link (``link.LinkDecision``) "auto" prices; else ``network`` (the performance model's),
    else the configured network."""
    setting = config.exchange
    if setting == AUTO:
        priced = link.network(network_env.configured_network().latency_s) if link else network
        transport = auto_transport(numels, n_ranks, config.packing, config.bucket_size, network=priced,
                                   shared_scaler=config.scaler_shared_for(ALLGATHER))
        among = " or the ".join(names.transport_of(m) for m in auto_candidates(n_ranks))
        which = "measured" if link else "configured" if network is None else "given"
        reason = f"exchange='auto': the cheaper of the {among} transport among {n_ranks} ranks on the {which} network"
    elif setting == DEFAULT:
        transport = default_transport(n_ranks)
        reason = (f"exchange='default': the allgather up to {DEFAULT_ALLGATHER_MAX_RANKS} ranks, the requantized "
                  f"transport above ({n_ranks} ranks)")
    else:
        transport, reason = setting, f"exchange={setting!r}"
    return Plan(transport, False, None, config.bucket_size, reason)


def hierarchy_shared_scaler(config) -> bool:
    """The scaler setting the node-aware decision prices: the sharded transport's where it is the setting, else
    the allgather's."""
    return config.scaler_shared_for(SHARDED if config.exchange == SHARDED else ALLGATHER)


def hierarchy_for(setting: str | None, numels: Sequence[int], nodes: int, ranks_per_node: int, packing: str = "2bit",
                  bucket_size: int = 0, network: cost.Network | None = None, shared_scaler: bool = False,
                  step_allreduces: int = 0, intra_width: int = 4) -> bool:
    """Whether ``hierarchical="auto"`` sends a group of these sizes node-aware on M = ``nodes`` nodes of G =
    ``ranks_per_node`` ranks: ``cost.hierarchy_for`` with the transport ``setting`` runs flat among M·G ranks and
    the one it runs across nodes among M ("auto" or None: the cheapest on each side)."""
    M, G = int(nodes), int(ranks_per_node)
    return cost.hierarchy_for(numels, M, G, packing, bucket_size, network=network, shared_scaler=shared_scaler,
                              transport=transport_among(setting, M * G), step_allreduces=step_allreduces,
                              intra_width=intra_width, cross_transport=transport_among(setting, M))


def hierarchy_plan(setting: str | None, groups: Sequence[Sequence[int]], nodes: int, ranks_per_node: int,
                   packing: str = "2bit", bucket_size: int = 0, network: cost.Network | None = None,
                   shared_scaler: bool = False, step_allreduces: int = 0, intra_width: int = 4) -> list[bool]:
    """:func:`hierarchy_for` for a whole step of groups known in advance (``cost.hierarchy_plan``)."""
    M, G = int(nodes), int(ranks_per_node)
    return cost.hierarchy_plan(groups, M, G, packing, bucket_size, network=network, shared_scaler=shared_scaler,
                               transport=transport_among(setting, M * G), step_allreduces=step_allreduces,
                               intra_width=intra_width, cross_transport=transport_among(setting, M))


def world_groups_fit(config) -> bool:
    """Whether ``config``'s cross-node exchange can run over world collectives (exchange/world_groups.py): per-rank
    scalers with the allgather, re-ternarized or requantized transport, whose collectives (one allgather; one
    alltoall and one allgather) every cross group posts whatever its data ("default" picks one of them by the
    number of nodes, the same in every cross group; so does "auto", which would decide per cross group)."""
    return (config.exchange in (ALLGATHER, AUTO, DEFAULT, RETERNARIZED, REQUANTIZED)
            and not config.scaler_shared_for(ALLGATHER))


def _world_cross_transport(config, nodes: int) -> str:
    # every cross group must post the same collectives: no per-group decision ("auto", which would decide per
    # cross group on its own pieces, runs what "default" runs among M)
    setting = config.exchange
    if setting in (DEFAULT, AUTO):
        return default_transport(nodes)
    return setting if setting in (REQUANTIZED, RETERNARIZED) else ALLGATHER


def cross_transport(config, pieces: Sequence[int], nodes: int, ranks_per_node: int,
                    links: cost.Network | None = None, spans_world: bool = False) -> str:
    """The transport of one local rank's ``pieces`` (element counts) among the M = ``nodes`` ranks of its cross
    group.  Over world collectives (``spans_world``) one per setting and M, the same in every cross group; else
    "auto" takes the cheaper for these pieces on a G-th of the inter-node link (G ranks share the node's link:
    ``links``, the measured ones, or the configured network), any other setting what it runs among M."""
    if spans_world:
        return _world_cross_transport(config, nodes)
    if config.exchange == AUTO:
        net = links or network_env.configured_network()
        shared = replace(net, bandwidth_Bps=net.bandwidth_Bps / int(ranks_per_node))
        return auto_transport(list(pieces), nodes, config.packing, config.bucket_size, network=shared,
                              shared_scaler=config.scaler_shared_for(ALLGATHER))
    return setting_among(config.exchange, nodes)


def node_plan(config, numels: Sequence[int], nodes: int, ranks_per_node: int,
              network: "Callable[[], cost.Network]", spans_world: bool = False, step_allreduces: int = 0) -> Plan:
    """The plan of a group on M = ``nodes`` nodes of G = ``ranks_per_node`` ranks (the node-aware engine's, per
    group).  ``network``: called only where the plan is priced (``hierarchical="auto"``), for the inter-node link
    with its intra-node one (it may measure them).  ``spans_world``: the node-aware exchange runs over world
    collectives, where a group of fewer elements than G stays flat (a local rank would own no piece and post
    nothing).  ``step_allreduces``: the 4-byte world allreduces the node-aware engine adds to a step (its presence
    check, its end-of-step sync), charged to the group."""
    M, G = int(nodes), int(ranks_per_node)
    flat = transport_among(config.exchange, M * G)
    across = _world_cross_transport(config, M) if spans_world else transport_among(config.exchange, M)
    if spans_world and sum(int(n) for n in numels) < G:
        return Plan(flat, False, None, config.bucket_size,
                    f"fewer elements than the {G} ranks of a node, over world collectives")
    if config.hierarchical is True:
        return Plan(flat, True, across, config.bucket_size, "hierarchical=True")
    if config.hierarchical is False:
        return Plan(flat, False, None, config.bucket_size, "hierarchical=False")
    # the same setting flat and across nodes ("auto": the cheaper on each side), and the 4-byte world
    # allreduces the node-aware engine adds to a step charged to the group
    node_aware = hierarchy_for(config.exchange, numels, M, G, config.packing, config.bucket_size,
                               network=network(), shared_scaler=hierarchy_shared_scaler(config),
                               step_allreduces=step_allreduces, intra_width=config.intra_node_width)
    if node_aware:
        return Plan(flat, True, across, config.bucket_size,
                    f"hierarchical='auto': node-aware is cheaper on {M} nodes x {G} ranks")
    return Plan(flat, False, None, config.bucket_size,
                f"hierarchical='auto': flat is no slower on {M} nodes x {G} ranks")


def describe(config, n_ranks: int) -> str:
    """Which transport the setting runs among ``n_ranks`` ranks, in words (the frontends' one-time log line: the
    run's first lines say what the defaults chose)."""
    if config.exchange == AUTO:
        among = " or the ".join(names.transport_of(m) for m in auto_candidates(n_ranks))
        return f"exchange='auto': per group the {among} exchange, by the cost model"
    return f"the {setting_among(config.exchange, n_ranks)} exchange among {n_ranks} ranks " \
           f"(exchange={config.exchange!r})"


@dataclass(frozen=True)
class ExchangePlan:
    """What one engine runs, decided once before its first exchange from inputs every rank agrees on.

    ``ranks``: the engine's ranks.  ``link``: the link ``exchange="auto"`` measured and agreed (``link.LinkDecision``;
    None: the configured network).  ``settled``: False where a rank was in ``hvd.join()`` while the plan was made
    (nothing could be measured; it prices the configured network until the next plan step makes it again).
    ``off``: why the node-aware exchange cannot run here, where a frontend found it so, and whether that is quiet
    (one node, or one rank per node).  A node-aware engine's plan adds ``nodes`` x ``ranks_per_node``
    (``topology``: the same in words), the ``network`` it prices (``links``: what was measured, in words; "" for
    the configured one), whether its groups run over world collectives (``spans_world``), the 4-byte world
    allreduces it adds to a step (``step_allreduces``) and what carries its groups (``over``, in words).

    The per-group reads are pure functions of the plan and the group's sizes, kept per list of sizes."""

    config: object
    ranks: int
    link: object = None
    settled: bool = True
    off: tuple = ()
    nodes: int = 0
    ranks_per_node: int = 0
    topology: str = ""
    network: cost.Network | None = None
    links: str = ""
    spans_world: bool = False
    step_allreduces: int = 0
    over: str = ""
    fixed: str | None = None      #: the flat transport whatever the group (None: "auto", priced per group)
    _groups: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def compresses(self) -> bool:
        """Whether tensors the settings would ternarize are: False only where ``exchange="auto"`` measured a link
        on which the full-precision allreduce is faster (until every rank took part in the measurement, True)."""
        return self.link is None or self.link.compresses

    @property
    def node_aware(self) -> bool:
        """Whether this is a node-aware engine's plan (some group sizes may still go flat: :meth:`group`)."""
        return self.nodes > 0

    def transport(self, numels: Sequence[int]) -> str:
        """The transport of a group of these sizes exchanged flat among ``ranks`` (:func:`flat_plan`)."""
        if self.fixed is not None:
            return self.fixed
        key = ("flat", tuple(numels))
        got = self._groups.get(key)
        if got is None:
            got = self._groups[key] = flat_plan(self.config, numels, self.ranks, self.link).transport
        return got

    def group(self, numels: Sequence[int]) -> Plan:
        """A node-aware engine's plan of a group of these sizes (:func:`node_plan`, priced on ``network``)."""
        key = tuple(numels)
        got = self._groups.get(key)
        if got is None:
            got = self._groups[key] = node_plan(self.config, numels, self.nodes, self.ranks_per_node,
                                                lambda: self.network, self.spans_world, self.step_allreduces)
        return got

    def cross_transport(self, pieces: Sequence[int]) -> str:
        """A node-aware engine's transport of one local rank's ``pieces`` across nodes (:func:`cross_transport`,
        on the measured links where they were measured)."""
        return cross_transport(self.config, pieces, self.nodes, self.ranks_per_node,
                               self.network if self.links else None, self.spans_world)

    @property
    def loud(self) -> bool:
        """Whether rank 0 says the plan at WARNING level, which Python shows without any logging setup: where it
        rests on a link measurement, where ternarizing does not pay, or where the node-aware exchange cannot run
        on a job of several nodes of several ranks (else INFO)."""
        return bool(self.links) or not self.compresses or bool(self.off and not self.off[1])

    def statement(self, largest: int = 1 << 30) -> str:
        """The plan in one line, as it runs (rank 0 says it once, ``Engine.plan_exchange``): for a node-aware engine
        which group sizes (powers of two up to ``largest``) go node-aware, and how each side runs."""
        from .link import plan_summary
        cfg = self.config
        flat = describe(cfg, self.ranks)
        auto = f"; {self.link.describe()}" if self.link is not None and self.ranks > 1 else ""
        if not self.node_aware and self.off:
            return (f"TernGrad plan: node-aware exchange off (hierarchical={cfg.hierarchical!r}): {self.off[0]}; every "
                    f"rank exchanges with every other (flat), {flat}{auto}")
        if not self.node_aware:
            return f"TernGrad plan: flat, {flat}{auto}"
        summary = plan_summary(lambda numel: self.group([numel]).hierarchical, largest)
        over = f", {self.over}" if self.over else ""
        node = (f"; node-aware: {cfg.intra_node_dtype} inside a node{over}, across nodes {describe(cfg, self.nodes)}"
                if not summary.startswith("flat") else "")
        flat = f"; flat: {flat}" if not summary.startswith("node-aware for every") else ""
        links = (f"; {self.links} (HOROVOD_TERNGRAD_GBPS and HOROVOD_TERNGRAD_INTRA_GBPS give the rates instead)"
                 if self.links else "")
        return (f"TernGrad plan on {self.topology} (hierarchical={cfg.hierarchical!r}): "
                f"{summary}{node}{flat}{links}{auto}")


def exchange_plan(config, ranks: int, link=None, settled: bool = True, off: tuple = ()) -> ExchangePlan:
    """A flat engine's plan among ``ranks`` ranks (``link``: "auto"'s measured link, None for the configured
    network; ``off``: why the node-aware exchange cannot run here, and whether that is quiet)."""
    return ExchangePlan(config, int(ranks), link, settled, tuple(off), fixed=transport_among(config.exchange, ranks))


def node_exchange_plan(flat: ExchangePlan, nodes: int, ranks_per_node: int, topology: str, network: cost.Network,
                       links: str = "", settled: bool = True, spans_world: bool = False, step_allreduces: int = 0,
                       over: str = "") -> ExchangePlan:
    """A node-aware engine's plan on M = ``nodes`` nodes of G = ``ranks_per_node`` ranks over the flat engine's plan
    ``flat`` (its groups that go flat run that), priced on ``network`` (``links``: what was measured, in words)."""
    return replace(flat, settled=flat.settled and settled, nodes=int(nodes), ranks_per_node=int(ranks_per_node),
                   topology=topology, network=network, links=links, spans_world=spans_world,
                   step_allreduces=int(step_allreduces), over=over, _groups={})
