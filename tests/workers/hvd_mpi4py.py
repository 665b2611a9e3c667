"""Horovod initialized on an mpi4py communicator, with TernGrad (launched by tests/test_mpi4py.py under mpirun).

    python hvd_mpi4py.py OUTFILE world|split

world: ``hvd.init(comm=MPI.COMM_WORLD)``.  split: COMM_WORLD split by rank parity into interleaved
sub-communicators, each of them its own Horovod world (``hvd.init(comm=sub)``).  Every rank trains the test
MLP for 3 steps with TernGrad and records what it handed the compressor and got back; the records are gathered
through mpi4py on COMM_WORLD (not through files) and rank 0 saves them all to OUTFILE.
"""
import os
import sys
import traceback

import torch
from mpi4py import MPI

import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hvd_scenarios import Recording, names_in_order, train_steps  # noqa: E402


def main():
    outfile, mode = sys.argv[1], sys.argv[2]
    world = MPI.COMM_WORLD
    comm = world.Split(color=world.rank % 2, key=world.rank) if mode == "split" else world
    torch.set_num_threads(1)
    rec = {"world_rank": world.rank, "comm_rank": comm.rank, "comm_size": comm.size}
    try:
        hvd.init(comm=comm)
        rec.update(size=hvd.size(), rank=hvd.rank())
        comp = Recording(seed=11)
        model = train_steps(comp, steps=3, prefix=f"{mode}.")
        rec.update(config=comp.config, inputs=comp.inputs, outputs=comp.outputs,
                   names=[f"{mode}.{n}" for n in names_in_order(model)],
                   params=[p.detach().clone() for p in model.parameters()])
    except Exception:  # noqa: BLE001 - a crash is a result too
        rec["crash"] = traceback.format_exc()
    everyone = world.gather(rec, root=0)
    if world.rank == 0:
        torch.save(everyone, outfile)
    try:
        hvd.shutdown()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    main()
