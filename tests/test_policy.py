"""exchange/policy.py: the plans it makes for each setting, flat and node-aware, pinned as literals; the engine and
the node-aware exchange decide by it; and no other module of the package tests the settings' names."""
import ast
import pathlib

import pytest

from horovod_terngrad import TernGradConfig
from horovod_terngrad.exchange import Engine, ThreadWorld, cost, policy, topology

SETTINGS = ("default", "auto", "allgather", "sharded", "reternarized", "requantized")
TRANSPORTS = ("allgather", "sharded", "reternarized", "requantized")
RANKS = (1, 2, 3, 4, 5, 8, 64)
# one tensor latency-bound, one in between, one bandwidth-bound, and a fused group of three
SIZES = {"small": [100], "mid": [100_000], "big": [10_000_000], "fused": [4_000_000, 5000, 37]}

# exchange="auto" on the configured network (1 Gbit/s, 50 us), per group size, at N = RANKS
AUTO_FLAT = {
    "small": ["allgather"] * 7,
    "mid": ["allgather"] * 5 + ["requantized"] * 2,
    "big": ["allgather"] * 3 + ["requantized"] * 4,
    "fused": ["allgather"] * 3 + ["requantized"] * 4,
}

SHAPES = ("1x4", "2x1", "2x2", "2x4", "3x2", "4x2", "5x2", "8x8", "16x4")
# hierarchical="auto": node-aware (T) or flat (.) per group of SIZES (small, mid, big, fused), on the configured
# network with its intra-node link, charged 0 and 2 (the Horovod frontend's) 4-byte world allreduces per step
NODE_AWARE = {
    (0, "*"): {"1x4": "....", "2x1": "....", "2x2": "TTTT", "2x4": "TTTT", "3x2": "TTTT", "4x2": "TTTT",
               "5x2": "TTTT", "8x8": "TTTT", "16x4": "TTTT"},
    (2, "default"): {"2x2": ".TTT", "2x4": "TTTT", "3x2": ".TTT", "4x2": ".TTT", "5x2": "..TT"},
    (2, "auto"): {"2x2": ".TTT", "2x4": ".TTT", "3x2": ".TTT", "4x2": ".TTT", "5x2": "..TT"},
    (2, "allgather"): {"2x2": ".TTT", "2x4": ".TTT", "3x2": ".TTT", "4x2": ".TTT", "5x2": ".TTT"},
    (2, "sharded"): {"2x2": ".TTT", "2x4": "TTTT", "3x2": ".TTT", "4x2": ".TTT", "5x2": ".TTT"},
    (2, "reternarized"): {"2x2": "..TT", "2x4": ".TTT", "3x2": "..TT", "4x2": "..TT", "5x2": "..TT"},
    (2, "requantized"): {"2x2": ".TTT", "2x4": ".TTT", "3x2": "..TT", "4x2": "..TT", "5x2": "..TT"},
}
# exchange="auto" across nodes (process sets or subgroups): local rank 0's pieces on a G-th of the link
AUTO_CROSS = {"2x2": "AAAA", "2x4": "AAAA", "5x2": "AARR", "8x8": "ARRR", "16x4": "ARRR"}


def shape(s: str) -> tuple:
    M, G = s.split("x")
    return int(M), int(G)


@pytest.fixture(autouse=True)
def configured_network(monkeypatch):
    for name in ("GBPS", "ALPHA_US", "INTRA_GBPS", "INTRA_ALPHA_US", "INTRA_LINKS"):
        monkeypatch.delenv(f"HOROVOD_TERNGRAD_{name}", raising=False)


@pytest.mark.parametrize("setting", SETTINGS)
def test_flat_plans(setting):
    cfg = TernGradConfig(exchange=setting)
    for i, N in enumerate(RANKS):
        for key, sizes in SIZES.items():
            plan = policy.flat_plan(cfg, sizes, N)
            if setting == "auto":
                want = AUTO_FLAT[key][i]
            elif setting == "default":
                want = "allgather" if N <= 4 else "requantized"
            else:
                want = setting
            assert plan.transport == want, (setting, N, key)
            assert (plan.hierarchical, plan.cross_transport, plan.bucket_size) == (False, None, cfg.bucket_size)
            assert plan.reason


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_engine_runs_the_policys_transport(setting):
    cfg = TernGradConfig(exchange=setting, bucket_size=128)
    for N in (2, 5, 8):
        engine = Engine(ThreadWorld(N).ranks()[0], cfg)
        for sizes in SIZES.values():
            assert engine.plan.transport(sizes) == policy.flat_plan(cfg, sizes, N).transport


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("step_allreduces", [0, 2])
def test_node_plans(setting, step_allreduces):
    cfg = TernGradConfig(exchange=setting)
    table = NODE_AWARE.get((step_allreduces, setting), {})
    for s in SHAPES:
        M, G = shape(s)
        priced = []
        want = table.get(s, NODE_AWARE[(0, "*")][s])
        for key, sizes in SIZES.items():
            plan = policy.node_plan(cfg, sizes, M, G, lambda: cost.configured_network(G),
                                    step_allreduces=step_allreduces)
            priced.append("T" if plan.hierarchical else ".")
            assert plan.transport == policy.transport_among(setting, M * G)
            if plan.hierarchical:
                across = {"default": "allgather" if M <= 4 else "requantized", "auto": None}.get(setting, setting)
                assert plan.cross_transport == across
            else:
                assert plan.cross_transport is None
        assert "".join(priced) == want, (setting, step_allreduces, s)


def test_forced_plans_price_nothing():
    def never():
        raise AssertionError("priced")
    on = policy.node_plan(TernGradConfig(hierarchical=True, exchange="default"), [10], 5, 2, never)
    assert (on.hierarchical, on.cross_transport, on.transport) == (True, "requantized", "requantized")
    off = policy.node_plan(TernGradConfig(hierarchical=False), [10], 5, 2, never)
    assert not off.hierarchical
    # over world collectives a group of fewer elements than a node's ranks stays flat, whatever the setting
    small = policy.node_plan(TernGradConfig(hierarchical=True), [3], 2, 4, never, spans_world=True)
    assert not small.hierarchical and "fewer elements" in small.reason


@pytest.mark.parametrize("setting", SETTINGS)
def test_cross_transports(setting):
    cfg = TernGradConfig(exchange=setting)
    for s in ("2x2", "2x4", "5x2", "8x8", "16x4"):
        M, G = shape(s)
        got = []
        for sizes in SIZES.values():
            pieces = [p.numel for p in topology.shard_plan(sizes, G)[0]]
            got.append(policy.cross_transport(cfg, pieces, M, G))
            # over world collectives every cross group posts the same collectives: one transport per setting and M
            world = policy.cross_transport(cfg, pieces, M, G, spans_world=True)
            assert world == {"default": "allgather" if M <= 4 else "requantized",
                             "auto": "allgather" if M <= 4 else "requantized",
                             "sharded": "allgather", "allgather": "allgather"}.get(setting, setting), (setting, s)
        if setting == "auto":
            assert "".join(t[0].upper() for t in got) == AUTO_CROSS[s], s
        elif setting == "default":
            assert got == ["allgather" if M <= 4 else "requantized"] * 4
        else:
            assert got == [setting] * 4


def test_world_groups_fit_and_settings():
    for setting in ("default", "auto", "allgather", "reternarized", "requantized"):
        assert policy.world_groups_fit(TernGradConfig(exchange=setting))
        assert not policy.world_groups_fit(TernGradConfig(exchange=setting, shared_scaler=True))
    assert not policy.world_groups_fit(TernGradConfig(exchange="sharded"))
    assert [policy.default_transport(N) for N in RANKS] == ["allgather"] * 4 + ["requantized"] * 3
    assert [policy.setting_among(s, 8) for s in SETTINGS] == ["requantized", "auto", *TRANSPORTS]
    assert [policy.transport_among(s, 3) for s in SETTINGS] == ["allgather", None, *TRANSPORTS]
    assert policy.transport_among(None, 3) is None
    assert policy.measures_link(TernGradConfig(exchange="auto"))
    assert not any(policy.measures_link(TernGradConfig(exchange=s)) for s in SETTINGS if s != "auto")
    assert policy.auto_candidates(2) == (cost.TERNGRAD_ALLGATHER,)
    assert policy.auto_candidates(3) == policy.AUTO_TRANSPORTS == (cost.TERNGRAD_ALLGATHER, cost.TERNGRAD_REQUANTIZED)


def test_describe():
    assert (policy.describe(TernGradConfig(), 8)
            == "the requantized exchange among 8 ranks (exchange='default')")
    assert (policy.describe(TernGradConfig(exchange="sharded"), 3)
            == "the sharded exchange among 3 ranks (exchange='sharded')")
    assert (policy.describe(TernGradConfig(exchange="auto"), 2)
            == "exchange='auto': per group the allgather exchange, by the cost model")
    assert (policy.describe(TernGradConfig(exchange="auto"), 8)
            == "exchange='auto': per group the allgather or the requantized exchange, by the cost model")


# -- only policy.py (and config.py, which validates them) tests the settings' names -------------------------------
SETTING_NAMES = {"default", "auto"}
PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "horovod_terngrad"
OWNERS = {"exchange/policy.py", "config.py"}
# comparisons with the same words that are no exchange or hierarchical setting: the launcher's network profile
# the same words naming other choices: the launcher's network profile and the examples' --device
NOT_SETTINGS = {("operations/launcher.py", "profile == 'auto'"), ("operations/devices.py", "choice == 'auto'")}


def _names(node) -> list:
    if isinstance(node, ast.Constant) and node.value in SETTING_NAMES:
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in SETTING_NAMES]
    return []


def setting_tests(source: str) -> list:
    """The comparisons, dict keys and ``.get`` lookups in ``source`` that test a string constant "default" or
    "auto" (docstrings and other strings are not tests)."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Compare) and any(_names(o) for o in [n.left] + n.comparators):
            found.append(ast.unparse(n))
        elif isinstance(n, ast.Dict) and any(k is not None and _names(k) for k in n.keys):
            found.append(ast.unparse(n))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args
              and _names(n.args[0])):
            found.append(ast.unparse(n))
    return found


def test_the_scan_finds_setting_tests():
    src = ('"""exchange="auto" in a docstring."""\n'
           'def f(c, m):\n    """default"""\n    if c.exchange == "auto":\n        return 1\n'
           '    x = {"default": 4}.get(m)\n    return c.hierarchical in ("auto", True) or {}.get("auto")\n')
    assert sorted(setting_tests(src)) == sorted(["c.exchange == 'auto'", "{'default': 4}",
                                                 "c.hierarchical in ('auto', True)", "{}.get('auto')"])


def test_only_the_policy_tests_the_setting_names():
    hits = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE).as_posix()
        if rel in OWNERS:
            continue
        hits += [(rel, t) for t in setting_tests(f.read_text(encoding="utf-8")) if (rel, t) not in NOT_SETTINGS]
    assert not hits, hits


def test_the_cost_model_takes_transports_not_settings():
    for setting in ("default", "auto"):
        with pytest.raises(ValueError, match=f"got '{setting}'"):
            cost.hierarchy_for([100_000], 2, 2, network=cost.configured_network(2), transport=setting)
        with pytest.raises(ValueError, match=f"got '{setting}'"):
            cost.hierarchical_cost([100_000], 2, 2, cost.configured_network(2), cross=setting)


def test_a_step_of_groups_is_planned_as_each_group_without_overhead():
    groups = list(SIZES.values())
    for setting in SETTINGS:
        for s in SHAPES:
            M, G = shape(s)
            net = cost.configured_network(G)
            each = [policy.hierarchy_for(setting, g, M, G, network=net) for g in groups]
            assert policy.hierarchy_plan(setting, groups, M, G, network=net) == each, (setting, s)
            assert each == [c == "T" for c in NODE_AWARE[(0, "*")][s]]
