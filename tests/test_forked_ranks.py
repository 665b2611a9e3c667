"""tests/support/forked_ranks.py, the scenario launches' ranks: each kind's rendezvous works, a rank's failure ends
the launch with its status and the other ranks, and a hang ends at the timeout."""
import os
import time

import pytest

from support import forked_ranks

pytestmark = pytest.mark.slow       # forks ranks that rendezvous

WORKER = """
import os, sys, time
kind, out = sys.argv[1], sys.argv[2]
if kind == "torch":
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    rank, size = dist.get_rank(), dist.get_world_size()
else:
    import torch, horovod.torch as hvd
    hvd.init()
    x = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
    rank, size = hvd.rank(), hvd.size()
print(f"rank {rank} of {size}: {x.item()} threads {torch.get_num_threads()}")
with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
    f.write(f"{size} {x.item()} {torch.get_num_threads()}")
if "fail" in sys.argv and rank == 1:
    sys.exit(3)
if "hang" in sys.argv and rank == 0:
    time.sleep(600)
"""


@pytest.fixture()
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


@pytest.mark.parametrize("kind", ["torch", "horovod"])
def test_ranks_rendezvous_and_see_one_thread(tmp_path, worker, kind):
    logs = forked_ranks.run_scenarios(kind, 3, worker, [kind, str(tmp_path)], str(tmp_path))
    for r in range(3):
        assert (tmp_path / f"rank{r}.txt").read_text() == "3 6.0 1"          # OMP_NUM_THREADS=1 reached torch
        assert f"rank {r} of 3: 6.0" in logs[r][0]


def test_a_failed_rank_ends_the_launch_with_its_status(tmp_path, worker):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = time.monotonic()
    status, logs = forked_ranks.launch("torch", 2, worker, ["torch", str(tmp_path), "fail", "hang"], env,
                                       str(tmp_path), timeout=120)
    assert status == 3                       # rank 1's, while rank 0 would sleep for 600 s: it was ended
    assert time.monotonic() - started < 100
    with pytest.raises(AssertionError, match="failed \\(status 3\\)"):
        forked_ranks.run_scenarios("torch", 2, worker, ["torch", str(tmp_path), "fail"], str(tmp_path))


def test_a_hang_ends_at_the_timeout(tmp_path, worker):
    status, _ = forked_ranks.launch("torch", 2, worker, ["torch", str(tmp_path), "hang"],
                                    dict(os.environ, OMP_NUM_THREADS="1"), str(tmp_path), timeout=8)
    assert status == -1
