"""Settings for the whole test session.

``hierarchical="auto"`` (the default) measures the links in its plan step unless a rate is given
(exchange/hierarchical.py, ``measures_links``).  On a test machine's shared cores that measurement of loopback and
memory varies from run to run, and with it which groups go node-aware, so a test that launches ranks on emulated
nodes would assert something timing decides.  They price the configured link instead (1 Gbit/s, the rate used
before links were measured); the measurement itself is tested on thread ranks
(test_hierarchical.py::test_hierarchical_auto_measures_the_links_once_agrees_and_says_so), which lift this.

The ``slow`` marker (pytest.ini) splits the suite into two tiers: ``-m "not slow"`` runs what needs no launcher, no
spawned training and no compiler or installer subprocess.  A module marks its slow tests with ``pytest.mark.slow``
(or ``pytestmark``), and names in ``SLOW_FIXTURES`` the module fixtures that launch ranks: every test that uses one
is marked here, so a new test on a launch is slow without a mark of its own.  With pytest-xdist (``-n N``) the slow
tests run in two lanes of launches, each lane on one worker, in order (below), except those also marked
``one_process``: they start no ranks (they work in the test's own process, or run one command at a time), so any
worker may take them, beside a launch.
"""
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("HOROVOD_TERNGRAD_GBPS", "1")
# Every launched rank imports the package, the examples and the workers: with PYTHONDONTWRITEBYTECODE set (some
# shells and CI images set it) each of those processes compiles them again, about 0.2 s of CPU per process.  The
# caches are ignored by git (.gitignore).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# Horovod's background thread runs a negotiation cycle every HOROVOD_CYCLE_TIME ms (1 by default), busy or idle: with
# 2-5 ranks on 2 cores that polling takes CPU from the ranks' work.  5 ms is terngrad-launch's Ethernet profile
# (operations/launcher.py); on the Horovod tests it took a tenth off their CPU time and wall time here.
os.environ.setdefault("HOROVOD_CYCLE_TIME", "5")


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


# -- pytest-xdist (-n N): the slow tests in two lanes, each on one worker, in collection order ----------------------
# Two lanes of launches (1-6 ranks each), one launch at a time in each, so at most two launches share the cores; each
# module's launch fixtures run once.  The ``hosts`` lane holds the tests marked ``launch_lane("hosts")``: what
# builds emulated hosts (network namespaces and tc), runs Slurm jobs, mpirun worlds, Horovod's elastic driver or
# installs, which share machine-wide state (slurmctld, mpirun's daemons, the namespaces' names) and so never run
# beside each other; the ``local`` lane holds the other launches (ranks on loopback, each with its own ports).
# The other workers, and each lane's worker once its lane is done, take the fast tests and the slow tests marked
# one_process (no ranks: nothing in them waits on another process's rendezvous or collective, so sharing the cores
# with a launch slows them, never breaks them).  A module fixture is set up once per worker that runs a test using
# it: a module's one_process tests share no launch fixture with its other tests.
# xdist's own --dist loadgroup cannot do it under pytest 9 (it renames node ids through an attribute pytest 9 no
# longer reads), so the workers write the ids of their serialized slow tests with their lane to a folder the
# controller names, and the controller's scheduler (xdist's loadscope scheduling) makes each lane one scope.
LANES = ("local", "hosts")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Controller: the folder the workers write their slow tests' ids to."""
    config = node.config
    if not hasattr(config, "_tg_slow_dir"):
        config._tg_slow_dir = tempfile.mkdtemp(prefix="tg-slow-ids-")
    node.workerinput["tg_slow_dir"] = config._tg_slow_dir


def pytest_unconfigure(config):
    folder = getattr(config, "_tg_slow_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def serialized(item) -> bool:
    """Whether ``item`` runs in a lane of launches: slow, and not marked one_process."""
    return item.get_closest_marker("slow") is not None and item.get_closest_marker("one_process") is None


@pytest.hookimpl(tryfirst=True)      # before the worker reports its collection to the controller
def pytest_collection_finish(session):
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput and "tg_slow_dir" in workerinput:
        ids = [f"{lane(item)}\t{item.nodeid}" for item in session.items if serialized(item)]
        with open(os.path.join(workerinput["tg_slow_dir"], workerinput["workerid"]), "w") as f:
            f.write("\n".join(ids))


def lane(item) -> str:
    """The lane of a serialized slow test: its ``launch_lane`` mark's ("local" without one)."""
    mark = item.get_closest_marker("launch_lane")
    name = mark.args[0] if mark is not None and mark.args else "local"
    if name not in LANES:
        raise pytest.UsageError(f"{item.nodeid}: launch_lane must be one of {LANES}, got {name!r}")
    return name


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class SlowInOrder(LoadScopeScheduling):
        """Each fast or one_process test its own work unit (as --dist load), every other slow test in its lane's
        unit (the largest units go out first: each lane to its own worker)."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            self.slow = {}

        def schedule(self):
            folder = getattr(self.config, "_tg_slow_dir", None)
            if folder and not self.slow:
                for name in os.listdir(folder):
                    with open(os.path.join(folder, name)) as f:
                        for line in f.read().split("\n"):
                            if line:
                                lane_name, nodeid = line.split("\t", 1)
                                self.slow[nodeid] = lane_name
            super().schedule()

        def _split_scope(self, nodeid):
            return f"slow-{self.slow[nodeid]}" if nodeid in self.slow else nodeid

    return SlowInOrder(config, log)
