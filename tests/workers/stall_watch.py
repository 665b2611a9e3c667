"""A launched Horovod worker whose scenario runs long says where each rank is, before Gloo's timeout ends the job.

When ranks stop exchanging, Gloo's per-operation timeout (the launch's ``--gloo-timeout-seconds``, 120 s in the
tests) ends every rank with "Application timeout caused pair closure" and nothing about what each rank was doing.
With ``HVD_TEST_STALL_S`` set (seconds; the launching test sets it well under Gloo's timeout), a scenario still
running after that long on this rank writes ``OUTDIR/<scenario>.rank<R>.stall.txt`` (and the Python part to
stderr), and the launching test shows those files when the launch fails:

* the collectives TernGrad posted on this rank and has not synchronized yet, oldest first, and the one its main
  thread is waiting on (``HorovodCollectives`` is wrapped for this; Horovod's own ops, e.g. the optimizer's
  placeholder allreduces, are not listed: the stacks show a wait in ``DistributedOptimizer.synchronize``);
* every thread's Python stack (``faulthandler``);
* where gdb is installed, every thread's native stack (``gdb -p``, to the file only): Horovod's background thread
  shows which operation or negotiation step it is in (``PerformOperation``/``gloo::alltoallv``, or the
  controller's ``ComputeResponseList``), which the Python stacks cannot.

The rank then goes on: a long scenario is not a failure by itself (on 2 shared, busy cores a first scenario's
imports alone took over a minute), the job ends as it would have (done, or Gloo's timeout).  Comparing the
ranks' files tells a collective some rank never posted (TernGrad: ranks disagree on what they issue) from ranks
that all wait on collectives every rank posted (Horovod or Gloo stuck below TernGrad).
"""
import faulthandler
import os
import shutil
import subprocess
import sys
import threading
import time

GDB_TIMEOUT_S = 30.0
_lock = threading.Lock()
_posted: dict = {}        # Horovod handle -> (seconds since this module was imported, kind, name)
_waiting: list = []       # the handle the main thread synchronizes, if any
_t0 = time.monotonic()


def limit_s() -> float:
    """``HVD_TEST_STALL_S`` as seconds, or 0 (no watch)."""
    return float(os.environ.get("HVD_TEST_STALL_S", "0") or 0)


def install() -> None:
    """Record TernGrad's Horovod collectives (posted, synchronized) on this rank; once per process."""
    from horovod_terngrad.exchange import hvd_collectives
    cls = hvd_collectives.HorovodCollectives
    if getattr(cls, "_stall_watch", False):
        return
    cls._stall_watch = True

    def recorded(kind, post):
        def wrapper(self, *args, **kwargs):
            handle = post(self, *args, **kwargs)
            name = kwargs.get("name", args[-1] if args else "?")
            where = "" if self._ps is None else f" on process set {self._ps.process_set_id}"
            with _lock:
                _posted[handle] = (time.monotonic() - _t0, kind + where, name)
            return handle
        return wrapper

    for kind in ("allreduce_max_async", "allreduce_sum_async", "allgather_async", "alltoall_async"):
        setattr(cls, kind, recorded(kind.replace("_async", ""), getattr(cls, kind)))
    synchronize = cls.synchronize

    def synchronize_recorded(self, handle):
        with _lock:
            _waiting[:] = [handle]
        try:
            return synchronize(self, handle)
        finally:
            with _lock:
                _posted.pop(handle, None)
                _waiting[:] = []
    cls.synchronize = synchronize_recorded


def _in_flight() -> str:
    with _lock:
        posted = sorted(_posted.items(), key=lambda kv: kv[1][0])
        waiting = list(_waiting)
    lines = [f"  {'WAITING ON ' if h in waiting else ''}{kind} '{name}' (posted at {t:.1f} s)"
             for h, (t, kind, name) in posted]
    if waiting and waiting[0] not in dict(posted):
        lines.append(f"  WAITING ON handle {waiting[0]} (not recorded as posted)")
    return "\n".join(lines) or "  none"


class watch:
    """``with watch(outdir, scenario, rank):`` around one scenario (see the module docstring)."""

    def __init__(self, outdir: str, scenario: str, rank: int):
        self.outdir, self.scenario, self.rank = outdir, scenario, rank
        self.limit = limit_s()
        self.timer = None

    def __enter__(self):
        if self.limit > 0:
            self.timer = threading.Timer(self.limit, self._report)
            self.timer.daemon = True
            self.timer.start()
        return self

    def __exit__(self, *exc):
        if self.timer is not None:
            self.timer.cancel()
        return False

    def _report(self) -> None:
        path = os.path.join(self.outdir, f"{self.scenario}.rank{self.rank}.stall.txt")
        head = (f"rank {self.rank}: scenario {self.scenario} still running after {self.limit:.0f} s "
                f"(HVD_TEST_STALL_S).\nTernGrad collectives posted on this rank and not synchronized (times since "
                f"the worker's start):\n{_in_flight()}\nEvery thread's stack:\n")
        with open(path, "w") as f:
            f.write(head)
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        sys.stderr.write(head)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        native = _native_stacks()
        with open(path, "a") as f:
            f.write(f"\nNative stacks (gdb):\n{native}\n")
        sys.stderr.write(f"rank {self.rank}: native stacks (gdb) in {path}\n")
        sys.stderr.flush()


def _native_stacks() -> str:
    """Every thread's native stack of this process, by gdb (which may be absent or not allowed to attach).  Symbols
    of Horovod's library (Gloo is linked into it) and libc only: all of torch's take minutes to load on busy cores
    (and while gdb is attached this process, the timeout's clock included, stands still)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "  (gdb not installed)"
    cmd = [gdb, "-p", str(os.getpid()), "-batch", "-nx", "-iex", "set auto-load off", "-iex", "set auto-solib-add off",
           "-ex", "sharedlibrary mpi_lib", "-ex", "sharedlibrary libc", "-ex", "thread apply all bt 25"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=GDB_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"  (gdb failed: {e})"
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("Thread ", "#"))]
    return "\n".join(lines) or f"  (gdb gave no stack: {p.stderr.strip()[-500:]})"
