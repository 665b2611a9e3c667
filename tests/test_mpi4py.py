"""Horovod on an mpi4py communicator (``hvd.init(comm=...)``) with TernGrad, under mpirun: COMM_WORLD, and
interleaved sub-communicators of COMM_WORLD, each its own Horovod world.  The ranks gather their records
through mpi4py; the averages are checked bit for bit against tests/helpers.expected_average."""
import os
import subprocess
import sys

import pytest
import torch

from test_horovod import LAUNCH_TIMEOUT, check_exact, launcher, rank_env

pytestmark = [pytest.mark.slow, pytest.mark.launch_lane("hosts")]       # launches ranks (mpirun)

pytest.importorskip("mpi4py", reason="mpi4py is installed by scripts/setup.sh")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "hvd_mpi4py.py")


@pytest.mark.parametrize("mode,np_", [("world", 2), ("split", 4)])
def test_terngrad_on_horovod_initialized_with_an_mpi4py_communicator(tmp_path, mode, np_):
    out = tmp_path / "everyone.pt"
    cmd = launcher("mpirun", np_) + [sys.executable, WORKER, str(out), mode]
    try:
        p = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"mpirun hung:\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    everyone = torch.load(out, weights_only=False)
    assert [r["world_rank"] for r in everyone] == list(range(np_))
    crashes = [r["crash"] for r in everyone if "crash" in r]
    assert not crashes, crashes[0]
    worlds = [everyone] if mode == "world" else [everyone[0::2], everyone[1::2]]   # split by rank parity
    for members in worlds:
        assert [r["rank"] for r in members] == list(range(len(members)))            # Horovod's ranks: the comm's
        assert all(r["size"] == r["comm_size"] == len(members) for r in members)
        assert check_exact(members) > 0
