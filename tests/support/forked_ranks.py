"""Scenario launches on ranks forked from a process that has already imported torch, Horovod and this package.

A scenario launch runs one worker script (tests/workers/) on N ranks and the test reads back what the ranks saved.
Through a launcher, each rank's ``import torch`` costs 2-2.5 CPU-seconds on this machine kind and the launcher's own
interpreter 1-2 more, about as much as the scenarios themselves; forked from a preloaded process (multiprocessing's
forkserver, as PyTorch's own distributed tests fork their ranks) a rank starts in a fraction of a second.  The
ranks see what a launcher gives them, nothing more:

* ``torch``: torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
  ``MASTER_ADDR``/``MASTER_PORT`` on a free loopback port) for ``init_process_group``'s env:// rendezvous;
* ``horovod``: horovodrun --gloo's (a Gloo rendezvous server in this process, Horovod's own ``RendezvousServer``
  and its host assignment of ``localhost:N``; ``HOROVOD_RANK``/``SIZE``/``LOCAL_*``/``CROSS_*``, the controller
  and CPU operations ``gloo`` on ``lo``).

What the launchers themselves do (their parsing, their environment, their exit handling) is tested where they are
the subject: tests/test_launch.py, the examples (tests/test_examples.py, tests/test_ecosystem.py), the torchrun
example in tests/test_ddp.py, Horovod's elastic driver (tests/test_elastic.py) and mpirun (tests/test_horovod.py,
tests/test_usage.py).  As a launcher does, the first rank to fail ends the others.

Each rank: the environment replaced by the one given, ``sys.argv`` = [script, *args], stdout and stderr each to a log
file, the script run as ``__main__``; at its end the interpreter's exit handlers run (Horovod's shutdown is one)
and the rank exits with the script's status.  ``OMP_NUM_THREADS`` reaches torch through ``torch.set_num_threads``
(OpenMP read the variable when the forkserver loaded torch).
"""
import atexit
import multiprocessing
import multiprocessing.connection
import os
import runpy
import socket
import sys
import time
import traceback

PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "horovod.torch", "horovod_terngrad",
           "horovod_terngrad.frontends.horovod", "horovod_terngrad.frontends.ddp", "horovod_terngrad.frontends.fsdp"]

_context = None


def _forkserver():
    """multiprocessing's forkserver context with PRELOAD imported once (started on first use, one per process)."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(script: str, args: list, env: dict, cwd: str, log_path: str) -> None:
    """The body of one forked rank (see the module's docstring)."""
    for stream, suffix in ((1, ".out"), (2, ".err")):
        fd = os.open(log_path + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, stream)
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script] + list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    status = 0
    try:
        import torch
        if env.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the rank's failure is its exit status and its log, as under a launcher
        traceback.print_exc()
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _torch_env(rank: int, nproc: int, port: int) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


class _HorovodRendezvous:
    """horovodrun --gloo's rendezvous for ``localhost:N``: Horovod's server and its per-slot environment."""

    def __init__(self, nproc: int):
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
        from horovod.runner.http.http_server import RendezvousServer
        self.server = RendezvousServer()
        self.slots = get_host_assignments(parse_hosts(f"localhost:{nproc}"), nproc)
        port = self.server.start()
        self.server.init(self.slots)
        self.common = {k: str(v) for k, v in create_run_env_vars("127.0.0.1", ["lo"], port).items()}
        self.slot_env = create_slot_env_vars

    def env(self, rank: int) -> dict:
        return dict(self.common, **{k: str(v) for k, v in self.slot_env(self.slots[rank]).items()})

    def stop(self):
        self.server.stop()


def launch(kind: str, nproc: int, script: str, args: list, env: dict, log_dir: str, timeout: float,
           cwd: str | None = None) -> tuple[int, list]:
    """Run ``script args`` on ``nproc`` forked ranks with a ``kind`` ("torch" or "horovod") rendezvous; returns
    (status, logs): 0 when every rank exits 0, else the first failure's status (-1 for a timeout), and each rank's
    (stdout, stderr).  The first rank to fail (or the timeout) terminates the others."""
    ctx = _forkserver()
    rendezvous = _HorovodRendezvous(nproc) if kind == "horovod" else None
    port = _free_port() if kind == "torch" else None
    procs, logs = [], []
    try:
        for r in range(nproc):
            rank_env = dict(env, **(rendezvous.env(r) if rendezvous else _torch_env(r, nproc, port)))
            logs.append(os.path.join(log_dir, f"{os.path.basename(script)}.{kind}{nproc}.rank{r}.log"))
            # not daemonic: a rank may start processes of its own (DataLoader workers, a spawn launcher)
            p = ctx.Process(target=_rank_main, args=(script, list(args), rank_env, cwd or os.getcwd(), logs[-1]))
            p.start()
            procs.append(p)
        status = _wait(procs, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        if rendezvous:
            rendezvous.stop()
    return status, _read_logs(logs)


def _wait(procs: list, timeout: float) -> int:
    """0 once every rank exits 0; the first nonzero status otherwise, or -1 past the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.exitcode for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return 0
        if time.monotonic() > deadline:
            return -1
        multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.5)


def _read_logs(logs: list) -> list:
    def text(path):
        try:
            with open(path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""
    return [(text(path + ".out"), text(path + ".err")) for path in logs]


def labelled(logs: list, tail: int = 3000) -> str:
    """Every rank's stdout and stderr (their last ``tail`` characters), labelled."""
    return "\n".join(f"--- rank {r} stdout ---\n{out[-tail:]}\n--- rank {r} stderr ---\n{err[-tail:]}"
                     for r, (out, err) in enumerate(logs))


def run_scenarios(kind: str, nproc: int, script: str, args: list, log_dir: str, env: dict | None = None,
                  timeout: float = 300, what: str = "") -> list:
    """:func:`launch` for a test: the environment is tests/test_horovod.rank_env's plus ``env``; a failed or
    hung launch fails the test with every rank's output; returns each rank's (stdout, stderr)."""
    from test_horovod import rank_env
    full_env = dict(rank_env(), **(env or {}))
    if kind == "horovod":
        full_env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "120")     # as tests/test_horovod.launcher asks
    status, logs = launch(kind, nproc, script, args, full_env, log_dir, timeout)
    label = what or f"{kind} x{nproc} {os.path.basename(script)}"
    assert status != -1, f"{label} hung for {timeout} s:\n{labelled(logs)}"
    assert status == 0, f"{label} failed (status {status}):\n{labelled(logs)}"
    return logs
