"""exchange/names.py: the one table of methods, transports and settings agrees with the modules that run them (the
engine's transports, the config's settings, the cost model's methods, the policy's answers) and its lookups
round-trip."""
import pytest

from horovod_terngrad import TernGradConfig, config
from horovod_terngrad.exchange import cost, engine, names, policy
from horovod_terngrad.modelling import perfmodel as pm
from horovod_terngrad.modelling.timeline import method_of


def test_the_table_names_each_method_once():
    methods = [m.name for m in names.TABLE]
    assert len(set(methods)) == len(methods)
    assert names.TRANSPORTS == ("allgather", "sharded", "reternarized", "requantized")
    assert names.SETTINGS == ("allgather", "sharded", "reternarized", "requantized", "default", "auto")
    assert names.TERNGRAD_METHODS == ("terngrad_allgather", "terngrad_sharded", "terngrad_reternarized",
                                      "terngrad_requantized", "terngrad_default", "terngrad")


def test_the_table_agrees_with_the_modules_that_run_the_names():
    # every setting the config takes, every transport the engine sends a group by (joined aside: the engine
    # takes it on its own while a rank is in hvd.join()), every method the cost model prices
    assert set(names.SETTINGS) == set(config.EXCHANGES)
    assert set(names.TRANSPORTS) == set(engine.TRANSPORTS) - {"joined"}
    assert set(cost.METHODS) | {cost.TERNGRAD_RETERNARIZED, cost.TERNGRAD_REQUANTIZED} <= {m.name for m in names.TABLE}
    assert (policy.DEFAULT, policy.AUTO) == (names.DEFAULT, names.AUTO)
    # the policy answers with transports the table has
    assert {policy.default_transport(n) for n in (1, 4, 5, 512)} <= set(names.TRANSPORTS)
    assert {policy.auto_transport([n], 8, "2bit") for n in (100, 10_000_000)} <= set(names.TRANSPORTS)


@pytest.mark.parametrize("transport", ["allgather", "sharded", "reternarized", "requantized"])
def test_a_transport_its_method_and_its_setting_round_trip(transport):
    method = names.method_of_transport(transport)
    assert method == f"terngrad_{transport}"
    assert names.transport_of(method) == transport
    assert names.setting_of(method) == transport
    assert names.method_of_setting(transport) == method
    assert method_of(TernGradConfig(exchange=transport, shared_scaler=transport == "sharded" or None)) == method
    assert names.label(method) == names.short(method) == transport


def test_the_rules_are_methods_of_no_single_transport():
    assert names.method_of_setting("default") == pm.TERNGRAD_DEFAULT == "terngrad_default"
    assert names.method_of_setting("auto") == pm.TERNGRAD_BEST == "terngrad"
    assert names.transport_of(pm.TERNGRAD_DEFAULT) is None and names.transport_of(pm.TERNGRAD_BEST) is None
    assert [names.label(m) for m in (pm.FP32, pm.FP16, pm.TERNGRAD_DEFAULT, pm.TERNGRAD_BEST)] == [
        "fp32", "fp16", "default", "auto"]
    assert names.short(pm.TERNGRAD_HIERARCHICAL) == "hier"
    assert names.label("terngrad_flat") == names.short("terngrad_flat") == "terngrad_flat"   # not in the table


def test_names_outside_the_table_are_refused():
    for lookup, name in ((names.method_of_transport, "default"), (names.method_of_transport, "joined"),
                         (names.setting_of, "fp32"), (names.setting_of, "terngrad_hierarchical"),
                         (names.method_of_setting, "terngrad")):
        with pytest.raises(ValueError, match="must be one of"):
            lookup(name)
