"""A real single-node Slurm (munge + slurmctld + slurmd from Debian) configured in a temporary folder.

Nothing outside that folder is written: the daemons get their own ports, sockets, state and logs, and
clients find them through SLURM_CONF.  Used by tests/test_slurm.py; also runnable by hand:
    python tests/support/slurm_cluster.py   # starts one, prints SLURM_CONF, waits for Ctrl-C
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, root: str | None = None, cpus: int | None = None):
        self.root = root or tempfile.mkdtemp(prefix="tg-slurm-")
        self.host = socket.gethostname()
        self.cpus = cpus or os.cpu_count() or 2
        self.procs: list[subprocess.Popen] = []
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    @staticmethod
    def available() -> list[str]:
        """Missing programs (empty when everything needed is installed)."""
        return [p for p in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol")
                if shutil.which(p) is None]

    def start(self, timeout: float = 60.0) -> "SlurmCluster":
        r = self.root
        for d in ("state", "spool", "munge"):
            os.makedirs(os.path.join(r, d), exist_ok=True)
        os.chmod(os.path.join(r, "munge"), 0o700)
        key = os.path.join(r, "munge", "munge.key")
        subprocess.run(["mungekey", "--create", "--keyfile", key, "--force"], check=True, capture_output=True)
        os.chmod(key, 0o600)
        self.munge_socket = os.path.join(r, "munge", "munge.socket")
        self.procs.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
             f"--pid-file={r}/munge/munged.pid", f"--log-file={r}/munge/munged.log", f"--seed-file={r}/munge/seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(lambda: os.path.exists(self.munge_socket), timeout, "munged socket")
        # MinJobAge=16: `sbatch --wait` sleeps 2 s, then multiplies its sleep by 4 while it is under MinJobAge/2
        # (capped at 32 s), so that a finished job cannot be purged before it looks again.  With 16 it polls
        # every 8 s (2, 10, 18, ... s); with a long MinJobAge (3600) at 2, 10, 42 s, which made every job of
        # 11-40 s take 42 s.  Tests submit with submit() (polls every 0.5 s) and read a job's result from what
        # the job wrote, not from the record Slurm purges.
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=tgtest
SlurmctldHost={self.host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=16
InactiveLimit=0
KillWait=5
NodeName={self.host} CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        self.procs.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", self.conf], env=self.env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.procs.append(subprocess.Popen(["slurmd", "-D", "-f", self.conf, "-N", self.host], env=self.env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(self._node_ready, timeout, "slurm node to become idle")
        return self

    def _node_ready(self) -> bool:
        p = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True)
        return p.returncode == 0 and p.stdout.strip().startswith("idle")

    def job_state(self, job_id: str) -> str:
        p = subprocess.run(["scontrol", "show", "job", job_id], env=self.env, capture_output=True, text=True)
        for tok in p.stdout.split():
            if tok.startswith("JobState="):
                return tok.split("=", 1)[1]
        return "UNKNOWN"

    RUNNING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")

    def submit(self, args: list, env: dict, cwd, timeout: float) -> str:
        """``sbatch --parsable ARGS``, then wait until the job is no longer queued, running or completing; its
        id.  Polled every 0.5 s with squeue (``sbatch --wait`` sleeps 8 s between looks here): the job's result
        is for the caller to read from what the job wrote (its log's "exit code N"), never from the job record,
        which Slurm purges MinJobAge after the end (squeue then answers nothing, or an invalid-id error: both
        mean the job ended)."""
        p = subprocess.run(["sbatch", "--parsable"] + list(args), env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=60)
        if p.returncode != 0:
            raise RuntimeError(f"sbatch failed ({p.returncode}): {p.stderr}")
        job = p.stdout.strip().split(";")[0]

        def ended() -> bool:
            q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True)
            return q.returncode != 0 or q.stdout.strip() not in self.RUNNING
        _wait(ended, timeout, f"job {job} to end\n{self.logs()}")
        return job

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    out.append(f"== {name}\n" + f.read()[-3000:])
        return "\n".join(out)

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 15
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()


def _wait(cond, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.3)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


if __name__ == "__main__":
    c = SlurmCluster().start()
    print(f"export SLURM_CONF={c.conf}", flush=True)
    try:
        signal.pause()
    finally:
        c.stop()
