"""Settings for the whole test session.

``hierarchical="auto"`` (the default) measures the links at its first group unless a rate is given
(exchange/hierarchical.py, ``measures_links``).  On a test machine's shared cores that measurement of loopback and
memory varies from run to run, and with it which groups go node-aware, so a test that launches ranks on emulated
nodes would assert something timing decides.  They price the configured link instead (1 Gbit/s, the rate used
before links were measured); the measurement itself is tested on thread ranks
(test_hierarchical.py::test_hierarchical_auto_measures_the_links_once_agrees_and_says_so), which lift this.

The ``slow`` marker (pytest.ini) splits the suite into two tiers: ``-m "not slow"`` runs what needs no launcher, no
spawned training and no compiler or installer subprocess.  A module marks its slow tests with ``pytest.mark.slow``
(or ``pytestmark``), and names in ``SLOW_FIXTURES`` the module fixtures that launch ranks: every test that uses one
is marked here, so a new test on a launch is slow without a mark of its own.  pytest.ini runs the suite on a
pytest-xdist worker per core; the slow tests all go to one of them, in order (below).
"""
import os

import pytest

os.environ.setdefault("HOROVOD_TERNGRAD_GBPS", "1")


@pytest.fixture(scope="module")
def fused():
    """The fused CPU backend (kernels/terngrad_cpu.c), for the tests that compare it with the reference."""
    from horovod_terngrad.backends import cpu_fused
    be = cpu_fused()
    assert be is not None, "the fused CPU codec did not build (gcc is installed by scripts/setup.sh)"
    return be


def pytest_collection_modifyitems(config, items):
    for item in items:
        slow_fixtures = getattr(getattr(item, "module", None), "SLOW_FIXTURES", ())
        if slow_fixtures and set(item.fixturenames) & set(slow_fixtures):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow"):
            # pytest-xdist (pytest.ini: --dist loadgroup) runs one group on one worker in order: one launch at a
            # time, each module's launch fixtures once, while the other workers take the fast tests
            item.add_marker(pytest.mark.xdist_group("slow"))
