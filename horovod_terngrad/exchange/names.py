"""The exchange's names, in one table: every method the cost model and the performance model price, with the
setting (``TernGradConfig(exchange=...)``) that runs it, the transport it runs, and the names the performance
model's tables print for it.  cost.py, policy.py and the performance model (horovod_terngrad.modelling) read
their names here, so a transport is named once.

Words (exchange/__init__.py): a *setting* is the user's ``exchange=`` value, a transport's name or one of the
rules "default" and "auto", which only policy.py resolves to a transport; a *transport* is how one group's
payloads travel (one module of this package each); a *method* is what the cost model prices (``"fp32"``,
``"terngrad_allgather"``, ...): fp32 and fp16 (Horovod's allreduce at full or half precision), one method per
transport, one per rule (``"terngrad_default"``, ``"terngrad"``: whatever the policy picks per group), and the
node-aware exchange (``"terngrad_hierarchical"``, which ``TernGradConfig.hierarchical`` turns on, not
``exchange=``), and the owner-step exchange (``"terngrad_owner_step"``: ``optim.OwnerStepOptimizer``'s, which a
user chooses instead of their optimizer; no ``exchange=`` runs it and the policy never picks it).  It imports nothing, so any module reads it without an import cycle.
"""
from __future__ import annotations

from dataclasses import dataclass

#: ``TernGradConfig.exchange``'s rules (the other settings name a transport); policy.py resolves them
DEFAULT = "default"
AUTO = "auto"

#: the transports (exchange/allgather.py, sharded.py, reternarized.py, requantized.py)
ALLGATHER = "allgather"
SHARDED = "sharded"
RETERNARIZED = "reternarized"
REQUANTIZED = "requantized"

#: the cost model's methods
FP32 = "fp32"
FP16 = "fp16"
TERNGRAD_ALLGATHER = "terngrad_allgather"
TERNGRAD_SHARDED = "terngrad_sharded"
TERNGRAD_RETERNARIZED = "terngrad_reternarized"
TERNGRAD_REQUANTIZED = "terngrad_requantized"
#: ``TernGradConfig()``'s exchange, ``exchange="default"``: per group the transport ``policy.default_transport``
#: gives for the ranks in the exchange
TERNGRAD_DEFAULT = "terngrad_default"
#: ``exchange="auto"``: per group the cheapest of ``cost.NOISE_TRANSPORTS`` (``policy.auto_transport``)
TERNGRAD_BEST = "terngrad"
#: the node-aware exchange of a group (exchange/hierarchical.py)
TERNGRAD_HIERARCHICAL = "terngrad_hierarchical"
#: ``optim.OwnerStepOptimizer``'s exchange of every parameter in one step (exchange/owner_step.py): not an engine
#: transport, the optimizer the user swaps in runs it
TERNGRAD_OWNER_STEP = "terngrad_owner_step"


@dataclass(frozen=True)
class Method:
    """One method of the cost model and the names it goes by.

    ``setting``: the ``TernGradConfig.exchange`` that runs it (None: fp32, fp16, the node-aware exchange and the
    owner-step optimizer's exchange, which no ``exchange=`` names).  ``transport``: the one transport it runs (None where it is not one: the
    rules, which the policy resolves per group, and the methods that are not a transport).  ``label``: the
    column heading of the performance model's command-line tables.  ``short``: its name in the tables' list of
    the exchanges a prediction's buffers use."""

    name: str
    setting: str | None
    transport: str | None
    label: str
    short: str


#: every method, full precision first, then the transports, the rules, the node-aware exchange and the owner-step
#: optimizer's exchange
TABLE = (
    Method(FP32, None, None, "fp32", "fp32"),
    Method(FP16, None, None, "fp16", "fp16"),
    Method(TERNGRAD_ALLGATHER, ALLGATHER, ALLGATHER, "allgather", "allgather"),
    Method(TERNGRAD_SHARDED, SHARDED, SHARDED, "sharded", "sharded"),
    Method(TERNGRAD_RETERNARIZED, RETERNARIZED, RETERNARIZED, "reternarized", "reternarized"),
    Method(TERNGRAD_REQUANTIZED, REQUANTIZED, REQUANTIZED, "requantized", "requantized"),
    Method(TERNGRAD_DEFAULT, DEFAULT, None, "default", "default"),
    Method(TERNGRAD_BEST, AUTO, None, "auto", "auto"),
    Method(TERNGRAD_HIERARCHICAL, None, None, "node-aware", "hier"),
    Method(TERNGRAD_OWNER_STEP, None, None, "owner-step (OwnerStepOptimizer)", "owner-step"),
)

_BY_NAME = {m.name: m for m in TABLE}
_BY_TRANSPORT = {m.transport: m for m in TABLE if m.transport is not None}
_BY_SETTING = {m.setting: m for m in TABLE if m.setting is not None}

#: the transports' names, in the table's order
TRANSPORTS = tuple(_BY_TRANSPORT)
#: the settings' names, in the table's order
SETTINGS = tuple(_BY_SETTING)
#: every TernGrad method a setting runs (the transports' and the rules')
TERNGRAD_METHODS = tuple(m.name for m in TABLE if m.setting is not None)


def transport_of(method: str) -> str | None:
    """The transport ``method`` runs ("allgather", ...), None for a method that is not one transport (fp32,
    fp16, the rules, the node-aware exchange, the owner-step optimizer's exchange)."""
    return _BY_NAME[method].transport


def method_of_transport(transport: str) -> str:
    """The cost model's method of ``transport`` (``"allgather"`` -> ``"terngrad_allgather"``)."""
    try:
        return _BY_TRANSPORT[transport].name
    except KeyError:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}") from None


def setting_of(method: str) -> str:
    """The ``TernGradConfig.exchange`` that runs TernGrad ``method``."""
    setting = _BY_NAME[method].setting if method in _BY_NAME else None
    if setting is None:
        raise ValueError(f"method must be one of {TERNGRAD_METHODS}, got {method!r}")
    return setting


def method_of_setting(setting: str) -> str:
    """The method a ``TernGradConfig.exchange`` setting runs (``"auto"`` -> ``"terngrad"``)."""
    try:
        return _BY_SETTING[setting].name
    except KeyError:
        raise ValueError(f"setting must be one of {SETTINGS}, got {setting!r}") from None


def label(method: str) -> str:
    """``method``'s column heading in the command-line tables (a name not in the table: itself)."""
    return _BY_NAME[method].label if method in _BY_NAME else method


def short(method: str) -> str:
    """``method``'s name in the tables' list of the exchanges used (a name not in the table: itself)."""
    return _BY_NAME[method].short if method in _BY_NAME else method
