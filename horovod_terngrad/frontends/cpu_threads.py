"""The CPU oversubscription trap, said once per process.

Every rank's torch runs as many intra-op threads as the machine has cores unless told otherwise
(``OMP_NUM_THREADS``, ``torch.set_num_threads``).  Several ranks on one host then run ranks x cores
threads that spin against each other and against Horovod's and Gloo's own threads: on a 2-core machine a
2-rank job ran 37x slower than one rank until ``OMP_NUM_THREADS=1``.  Neither ``horovodrun`` nor
``torchrun`` sets a thread count for CPU training, so a user's unchanged script falls into this and
blames the network (or TernGrad).  The frontends call :func:`warn_if_oversubscribed` on the first CPU
gradient; it changes nothing, it only says what to set.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("horovod_terngrad")
_warned = False


def _cores_available() -> tuple[int, int]:
    """(cores of the machine, cores this process may run on)."""
    machine = os.cpu_count() or 1
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        mine = machine
    return machine, mine


def oversubscription(local_ranks: int) -> str | None:
    """The warning for ``local_ranks`` ranks on this host with torch's current thread count, or None when
    their threads fit: local_ranks x threads <= the machine's cores, and threads <= the cores this process
    is bound to (a launcher that pins each rank to one core leaves torch's default thread count too high)."""
    threads = torch.get_num_threads()
    machine, mine = _cores_available()
    local_ranks = max(1, int(local_ranks))
    if local_ranks * threads <= machine and threads <= mine:
        return None
    fit = max(1, min(machine // local_ranks, mine))
    if threads <= fit:
        # one thread per rank already: fewer threads cannot help, the ranks themselves outnumber the cores
        return (f"TernGrad: {local_ranks} ranks on this host share {machine} cores, one torch thread each: every "
                f"rank gets less than a core, and that, not the network, will set the step time. Start at most "
                f"{machine} ranks per host (an emulated cluster on one machine is slowed by this, not by its links).")
    return (f"TernGrad: {local_ranks} rank(s) on this host each run {threads} torch threads, on {machine} cores "
            f"({mine} available to this rank): the threads will compete for cores, and that, not the network, "
            f"will set the step time (a 2-rank job on 2 cores ran 37x slower than one rank). Set "
            f"OMP_NUM_THREADS={fit} for every rank, or call torch.set_num_threads({fit}) before training.")


def warn_if_oversubscribed(local_ranks: int) -> bool:
    """Log :func:`oversubscription`'s warning the first time it applies in this process; True if it did."""
    global _warned
    if _warned:
        return False
    msg = oversubscription(local_ranks)
    if msg is None:
        return False
    _warned = True
    log.warning(msg)
    return True
