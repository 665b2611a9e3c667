"""The CPU oversubscription warning (frontends/cpu_threads.py): said once, only when a host's ranks run more
torch threads than it has cores, and by both frontends without changing what they compute."""
import subprocess
import sys

import pytest
import torch

from horovod_terngrad.frontends import cpu_threads

from test_horovod import launcher, rank_env, LAUNCH_TIMEOUT


@pytest.fixture
def machine(monkeypatch):
    """machine(threads, cores, affinity): torch's thread count and this host's cores, as the check sees them."""
    def set_(threads, cores, affinity):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        monkeypatch.setattr(cpu_threads, "_cores_available", lambda: (cores, affinity))
        monkeypatch.setattr(cpu_threads, "_warned", False)
    return set_


def test_two_ranks_with_default_threads_on_two_cores_are_told_what_to_set(machine):
    machine(threads=2, cores=2, affinity=2)
    msg = cpu_threads.oversubscription(2)
    assert "2 rank(s) on this host each run 2 torch threads, on 2 cores" in msg
    assert "OMP_NUM_THREADS=1" in msg and "torch.set_num_threads(1)" in msg


def test_threads_that_fit_are_not_warned_about(machine):
    machine(threads=1, cores=2, affinity=2)
    assert cpu_threads.oversubscription(2) is None
    machine(threads=4, cores=16, affinity=16)
    assert cpu_threads.oversubscription(4) is None


def test_a_rank_pinned_to_one_core_with_many_threads_is_warned(machine):
    machine(threads=8, cores=16, affinity=1)          # mpirun --bind-to core, torch's default thread count
    assert "OMP_NUM_THREADS=1" in cpu_threads.oversubscription(2)


def test_more_ranks_than_cores_at_one_thread_are_not_told_to_set_one_thread(machine):
    """Four ranks on two cores, each already at one thread: the warning says the ranks outnumber the cores,
    not to set OMP_NUM_THREADS=1, which they have."""
    machine(threads=1, cores=2, affinity=2)
    msg = cpu_threads.oversubscription(4)
    assert "4 ranks on this host share 2 cores, one torch thread each" in msg and "at most 2 ranks per host" in msg
    assert "OMP_NUM_THREADS" not in msg and "set_num_threads" not in msg


def test_the_warning_is_logged_once_per_process(machine, caplog):
    machine(threads=2, cores=2, affinity=2)
    with caplog.at_level("WARNING", logger="horovod_terngrad"):
        assert cpu_threads.warn_if_oversubscribed(2) is True
        assert cpu_threads.warn_if_oversubscribed(2) is False
    assert sum("torch threads" in r.getMessage() for r in caplog.records) == 1


RANK_SCRIPT = r"""
import logging, os, sys, torch, horovod.torch as hvd
from horovod_terngrad import TernGradCompressor
logging.basicConfig(stream=sys.stdout, format="LOG %(message)s")   # one stream: the order shows
hvd.init()
torch.set_num_threads(1)
x = torch.arange(5000, dtype=torch.float32) * (hvd.rank() + 1)
a = hvd.allreduce(x.clone(), name="fits", compression=TernGradCompressor(seed=1))
print("CHECKPOINT", flush=True)
torch.set_num_threads((os.cpu_count() or 1) + 1)     # more threads than this host has cores
b = hvd.allreduce(x.clone(), name="fits", compression=TernGradCompressor(seed=1))
assert torch.equal(a, b)                             # the warning changes nothing the exchange computes
print("DONE", flush=True)
"""


@pytest.mark.slow
def test_horovod_frontend_warns_under_horovodrun_only_when_threads_oversubscribe(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    cmd = launcher("gloo", 2) + [sys.executable, str(script)]
    p = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for rank in range(2):       # horovodrun prefixes each rank's lines with [rank]<stdout>:
        lines = [line for line in p.stdout.splitlines() if line.startswith(f"[{rank}]<stdout>:")]
        marks = [("warn" if "torch threads" in line else "check" if "CHECKPOINT" in line else "done")
                 for line in lines if any(k in line for k in ("torch threads", "CHECKPOINT", "DONE"))]
        assert marks == ["check", "warn", "done"], p.stdout[-3000:]     # only after the threads outgrew the cores
        warning = next(line for line in lines if "torch threads" in line)
        assert "2 rank(s) on this host" in warning and "OMP_NUM_THREADS=" in warning
