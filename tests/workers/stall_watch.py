"""A launched Horovod worker whose scenario stops making progress says where, before Gloo's timeout ends the job.

When ranks stop exchanging, Gloo's per-operation timeout (the launch's ``--gloo-timeout-seconds``, 120 s in the
tests) ends every rank with "Application timeout caused pair closure" and nothing about what each rank was doing.
With ``HVD_TEST_STALL_S`` set (seconds; the launching test sets it well under Gloo's timeout), a scenario still
running after that long on this rank writes ``OUTDIR/<scenario>.rank<R>.stall.txt`` (and the same to stderr):

* the collectives TernGrad posted on this rank and has not synchronized yet, oldest first, and the one its main
  thread is waiting on (``HorovodCollectives`` is wrapped for this; Horovod's own ops, e.g. the optimizer's
  placeholder allreduces, are not listed: the stacks show a wait in ``DistributedOptimizer.synchronize``);
* every thread's Python stack (``faulthandler``);
* where gdb is installed, every thread's native stack (``gdb -p``, to the file only): Horovod's background thread
  shows which operation or negotiation step it is in (``PerformOperation``/``gloo::alltoallv``, or the
  controller's ``ComputeResponseList``), which the Python stacks cannot;

then waits until ``GDB_TIMEOUT_S + GRACE_S`` after it began, so that the other ranks, which started the
scenario at about the same time, write theirs, and exits with code 3 (the launcher then ends the job).
Comparing the ranks' files tells a collective some rank never posted (TernGrad: ranks disagree on what they
issue) from ranks that all wait on collectives every rank posted (Horovod or Gloo stuck below TernGrad).  A
C-level backstop (``faulthandler.dump_traceback_later``) dumps the stacks and exits where the watchdog thread
cannot run (a main thread holding the GIL).
"""
import faulthandler
import os
import shutil
import subprocess
import sys
import threading
import time

GRACE_S = 10.0
GDB_TIMEOUT_S = 30.0
_lock = threading.Lock()
_posted: dict = {}        # Horovod handle -> (seconds since the watch began, kind, name)
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
        self.fired = threading.Event()

    def __enter__(self):
        if self.limit > 0:
            self.started = time.monotonic()
            self.timer = threading.Timer(self.limit, self._stalled)
            self.timer.daemon = True
            self.timer.start()
            faulthandler.dump_traceback_later(self.limit + GDB_TIMEOUT_S + GRACE_S + 20, exit=True)
        return self

    def __exit__(self, *exc):
        if self.timer is not None:
            self.timer.cancel()
            if self.fired.is_set():       # over the limit after all: the report ends this rank, as it would a hung one
                time.sleep(GDB_TIMEOUT_S + GRACE_S + 60)
            faulthandler.cancel_dump_traceback_later()
        return False

    def _stalled(self) -> None:
        self.fired.set()
        leave_at = time.monotonic() + GDB_TIMEOUT_S + GRACE_S   # every rank's gdb done, whatever each one took
        path = os.path.join(self.outdir, f"{self.scenario}.rank{self.rank}.stall.txt")
        head = (f"rank {self.rank}: scenario {self.scenario} still running after {self.limit:.0f} s "
                f"(HVD_TEST_STALL_S); stopping this rank before Gloo's timeout.\n"
                f"TernGrad collectives posted on this rank and not synchronized (times since the worker "
                f"started):\n{_in_flight()}\nEvery thread's stack:\n")
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
        time.sleep(max(0.0, leave_at - time.monotonic()))      # the other ranks write theirs
        os._exit(3)


def _native_stacks() -> str:
    """Every thread's native stack of this process, by gdb (which may be absent or not allowed to attach).  Symbols
    of Horovod's library (Gloo is linked into it) and libc only: all of torch's take minutes to load on busy cores."""
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
