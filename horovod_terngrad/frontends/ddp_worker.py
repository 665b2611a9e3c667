"""The DDP hook's worker thread: the background exchange of the buckets DDP hands over.

With ``asynchronous=True`` (the default) the hook only queues the bucket and returns a future; one thread per
``TernGradState`` runs the queued buckets in the order DDP handed them in, each under the state's lock, while
backward goes on computing the next buckets (what it does with a bucket: ddp_bucket.py).

The thread ends by itself after ``IDLE_EXIT_S`` without a bucket, so a state that is dropped keeps no thread;
it ends under the hand-off lock, so a bucket handed in meanwhile starts a new thread, and a bucket in flight
stays with the state for the next one.  At interpreter exit every running worker is stopped before the
interpreter finalizes: a daemon thread still alive then is ended by pthread_exit when it next wants the GIL,
and that forced unwind aborts the process ("terminate called without an active exception") if it meets C++
frames, which a rank's last moments (torch, gloo) can put on its stack.  A thread stuck in a collective (a
peer died) is not waited for beyond ``EXIT_JOIN_S``.
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref

IDLE_EXIT_S = 5.0          # the worker thread ends after this long without a bucket
EXIT_JOIN_S = 10.0         # at interpreter exit, how long to wait for a worker thread to end

_RUNNING: "weakref.WeakSet" = weakref.WeakSet()     # the BucketWorkers whose thread runs


def _stop_workers_at_exit() -> None:
    for worker in list(_RUNNING):
        worker.close(timeout=EXIT_JOIN_S)


atexit.register(_stop_workers_at_exit)


class BucketWorker:
    """A queue of buckets and the thread that runs them: ``run(job)`` for each, in order, under ``lock``.

    run:  what to do with one bucket (the state's ``_step``: start it, finish the one before).
    lock: the lock the state's other users take (``state_dict``, ``reset``): they wait for the bucket in
          progress, never for a queued one."""

    __slots__ = ("_run", "_lock", "_handoff", "_queue", "thread", "__weakref__")

    def __init__(self, run, lock: threading.Lock):
        self._run = run
        self._lock = lock
        self._handoff = threading.Lock()    # the queue and whether a thread runs
        self._queue: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None

    def put(self, job) -> None:
        """Queue a bucket; start the thread if none runs."""
        with self._handoff:
            self._queue.put(job)
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, daemon=True, name="terngrad-ddp")
                self.thread.start()
                _RUNNING.add(self)

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread now, waiting for the bucket it runs (at most ``timeout`` seconds)."""
        with self._handoff:
            thread, self.thread = self.thread, None
            if thread is not None:
                self._queue.put(None)
            _RUNNING.discard(self)
        if thread is not None:
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._handoff:
                    if self._queue.empty():
                        self.thread = None
                        _RUNNING.discard(self)
                        return
                continue
            if job is None:
                return
            with self._lock:
                self._run(job)
