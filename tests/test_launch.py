"""Operations: the launcher, the sbatch scripts on a real single-node Slurm, and an emulated 2-host
cluster with a 1 Gbit/s link (network namespaces).  Everything here starts real processes."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from horovod_terngrad.operations import launcher

pytestmark = [pytest.mark.slow,      # every test here runs the launcher (terngrad-launch, sbatch, netns hosts)
              pytest.mark.launch_lane("hosts")]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LAUNCH = os.path.join(ROOT, "launch", "terngrad-launch")
NETNS = os.path.join(ROOT, "launch", "netns-cluster.sh")
RSH = os.path.join(ROOT, "launch", "netns-rsh")
PY = sys.executable
sys.path.insert(0, os.path.join(HERE, "support"))


def env():
    e = dict(os.environ)
    e["PATH"] = os.path.dirname(PY) + os.pathsep + e.get("PATH", "")
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


def run(args, timeout=300, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=kw.pop("env", env()), **kw)


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.one_process      # a dry run: one process, no ranks
@pytest.mark.parametrize("args,message", [
    (["-np", "2", "--network", "token-ring", "--", "true"], "invalid choice: 'token-ring'"),
    (["-np", "9", "-H", "a:4,b:4", "--", "true"], "-np 9 exceeds the 8 slot(s)"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts", "--", "true"], "hostfile '/nonexistent/hosts' does not exist"),
    (["-np", "2", "-H", "a:x", "--", "true"], "bad host entry 'a:x'"),
    (["-np", "2"], "no training command given"),
    (["-np", "0", "--", "true"], "-np must be >= 1"),
])
def test_bad_requests_fail_clearly(args, message):
    p = run([LAUNCH, "--dry-run"] + args)
    assert p.returncode == 2
    assert message in p.stderr, p.stderr


@pytest.mark.one_process      # a dry run: one process, no ranks
def test_hostfile_formats_and_slots(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("# cluster\nnode1 slots=4\nnode2:2\nnode3\n\n")
    assert launcher.read_hostfile(str(hf)) == [("node1", 4), ("node2", 2), ("node3", 1)]
    p = run([LAUNCH, "--dry-run", "-np", "7", "--hostfile", str(hf), "--network", "ethernet", "--iface", "eth9",
             "--launcher", "mpirun", "--", "python", "train.py"])
    assert p.returncode == 0, p.stderr
    assert "-H node1:4,node2:2,node3:1" in p.stdout and "btl_tcp_if_include eth9" in p.stdout
    assert run([LAUNCH, "--dry-run", "-np", "8", "--hostfile", str(hf), "--", "x"]).returncode == 2


@pytest.mark.one_process      # a dry run: one process, no ranks
def test_profiles_set_the_network_settings(tmp_path):
    ib = launcher.mpi_args("infiniband", None, ["mlx5_0:1"])
    assert ib[:4] == ["--mca", "pml", "ucx", "--mca"]
    env = launcher.network_env("infiniband", None, ["mlx5_0:1"], True)
    assert env["UCX_TLS"] == "rc,sm,self" and env["NCCL_IB_HCA"] == "mlx5_0" and env["HOROVOD_CYCLE_TIME"] == "1"
    p = run([LAUNCH, "--dry-run", "-np", "4", "-H", "n1:2,n2:2", "--network", "infiniband", "--launcher", "mpirun",
             "--", "python", "t.py"])
    assert "export NCCL_IB_DISABLE=0" in p.stdout and "--bind-to none" in p.stdout
    # the node-aware exchange's process sets are added after hvd.init(): dynamic sets, and the node's link
    assert "export HOROVOD_DYNAMIC_PROCESS_SETS=1" in p.stdout and "export HOROVOD_TERNGRAD_INTRA_GBPS=160" in p.stdout
    assert "export HOROVOD_TERNGRAD_INTRA_LINKS=3" in p.stdout          # NVLink: fully connected node of 4
    if not launcher.active_ib_devices():   # this machine: no IB, so a loud warning and TCP
        assert "no ACTIVE InfiniBand port" in p.stderr and "--mca pml ob1" in p.stdout
    p = run([LAUNCH, "--dry-run", "-np", "4", "-H", "n1:2,n2:2", "--network", "ethernet", "--iface", "eno1",
             "--no-terngrad", "--", "python", "t.py"])
    # Ethernet pins NCCL's sockets to the interface and leaves IB verbs on: RoCE NICs are driven through them
    assert "export NCCL_SOCKET_IFNAME=eno1" in p.stdout and "NCCL_IB_DISABLE" not in p.stdout
    assert "NCCL_IB_DISABLE" not in launcher.network_env("ethernet", "eno1", [], True, given={})
    assert "--network-interface eno1" in p.stdout and "export HOROVOD_TERNGRAD=0" in p.stdout
    assert "mpi_yield_when_idle" not in p.stdout
    p = run([LAUNCH, "--dry-run", "-np", "2", "-H", "n1:1,n2:1", "--network", "ethernet", "--iface", "eno1",
             "--launcher", "mpirun", "--shared-cores", "--", "python", "t.py"])
    assert "export OMPI_MCA_mpi_yield_when_idle=1" in p.stdout and "-x OMPI_MCA_mpi_yield_when_idle" in p.stdout
    # auto: an ACTIVE port under /sys/class/infiniband means IB
    ib = tmp_path / "ib" / "mlx5_0" / "ports" / "1"
    ib.mkdir(parents=True)
    (ib / "state").write_text("4: ACTIVE\n")
    assert launcher.resolve_network("auto", None, [("n1", 1)], ib_root=str(tmp_path / "ib"))[0] == "infiniband"
    assert launcher.resolve_network("auto", "eth0", [("n1", 1)], ib_root=str(tmp_path / "none"))[0] == "ethernet"


def _without_rates():
    e = env()
    for k in launcher.RATE_SETTINGS:
        e.pop(k, None)
    return e


@pytest.mark.one_process      # a dry run: one process, no ranks
@pytest.mark.parametrize("network,profile_gbps", [("ethernet", "1"), ("infiniband", "100")])
def test_a_rate_the_user_gives_wins_over_the_profile(network, profile_gbps):
    """HOROVOD_TERNGRAD_GBPS (and the other link settings) exported by the user are passed on as they are, also to
    mpirun's remote ranks (-x); --gbps wins over both; the profile fills in only what the user left unset."""
    cmd = [LAUNCH, "--dry-run", "-np", "4", "-H", "n1:2,n2:2", "--network", network, "--iface", "eno1",
           "--launcher", "mpirun", "--", "python", "t.py"]
    p = run(cmd, env=_without_rates())
    assert p.returncode == 0, p.stderr
    assert f"export HOROVOD_TERNGRAD_GBPS={profile_gbps}\n" in p.stdout
    user = dict(_without_rates(), HOROVOD_TERNGRAD_GBPS="25", HOROVOD_TERNGRAD_INTRA_GBPS="7.5")
    p = run(cmd, env=user)
    assert p.returncode == 0, p.stderr
    assert "export HOROVOD_TERNGRAD_GBPS=25\n" in p.stdout and "export HOROVOD_TERNGRAD_INTRA_GBPS=7.5\n" in p.stdout
    assert "-x HOROVOD_TERNGRAD_GBPS" in p.stdout and "-x HOROVOD_TERNGRAD_INTRA_GBPS" in p.stdout
    assert f"export HOROVOD_TERNGRAD_ALPHA_US={'5' if network == 'infiniband' else '50'}\n" in p.stdout
    p = run(cmd[:2] + ["--gbps", "40"] + cmd[2:], env=user)
    assert p.returncode == 0, p.stderr
    assert "export HOROVOD_TERNGRAD_GBPS=40\n" in p.stdout and "export HOROVOD_TERNGRAD_INTRA_GBPS=7.5\n" in p.stdout
    assert launcher.network_env(network, "eno1", [], True, given={"HOROVOD_TERNGRAD_GBPS": "25"},
                                gbps=2.5)["HOROVOD_TERNGRAD_GBPS"] == "2.5"


@pytest.mark.one_process      # a dry run: one process, no ranks
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "fast"])
def test_gbps_must_be_a_positive_rate(value):
    p = run([LAUNCH, "--dry-run", "-np", "2", "--gbps", value, "--", "true"])
    assert p.returncode == 2 and f"--gbps takes a rate in Gbit/s > 0, got '{value}'" in p.stderr, p.stderr


def test_odd_characters_are_passed_through_never_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    odd = ["a b", f"$(touch {marker})", ";", '"q"', "it's", "*", "`id`"]
    code = "import sys, json; print('ARGV=' + json.dumps(sys.argv[1:]))"
    for launcher_name in ("horovodrun", "mpirun"):
        p = run([LAUNCH, "-np", "1", "--no-preflight", "--launcher", launcher_name, "--", PY, "-c", code] + odd)
        assert p.returncode == 0, p.stderr
        line = next(l for l in p.stdout.splitlines() if "ARGV=" in l)
        assert json.loads(line.split("ARGV=", 1)[1]) == odd
    assert not marker.exists()


# -- more than 4 ranks on localhost -----------------------------------------------------------------------------
WIDE = 5        # above exchange/policy.py's DEFAULT_ALLGATHER_MAX_RANKS: exchange="default" runs the requantized one


@pytest.mark.parametrize("launcher_name", ["horovodrun", "mpirun"])
def test_five_ranks_exact_through_the_launcher(tmp_path, launcher_name):
    """5 ranks through either launcher, bit for bit, where the default exchange is the requantized one (4 ranks
    or fewer run the allgather: tests/test_horovod.py).  The preflight (a launch of its own) runs under horovodrun
    here; under mpirun it runs in the sbatch tests below.  --shared-cores: 5 ranks share this machine's cores,
    and Open MPI's ranks must yield while they wait instead of spinning on the cores the others compute on."""
    from test_horovod import check_exact, load_results
    preflight = launcher_name == "horovodrun"
    p = run([LAUNCH, "-np", str(WIDE), "--network", "ethernet", "--launcher", launcher_name, "--shared-cores"]
            + ([] if preflight else ["--no-preflight"])
            + ["--", PY, os.path.join(HERE, "workers", "hvd_scenarios.py"), str(tmp_path), "exact"], timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    if preflight:
        assert p.stdout.count("preflight: rank ") == WIDE and "backend=cpu-fused" in p.stdout
    else:
        assert "preflight: rank " not in p.stdout
    ranks = load_results(tmp_path, "exact", WIDE)
    assert ranks[0]["config"].exchange == "default" and check_exact(ranks) > 0


# -- Slurm ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def slurm():
    from slurm_cluster import SlurmCluster
    missing = SlurmCluster.available()
    assert not missing, f"Slurm/munge programs missing: {missing} (scripts/setup.sh --test installs them)"
    c = SlurmCluster(cpus=2).start()
    yield c
    c.stop()
    shutil.rmtree(c.root, ignore_errors=True)


def job_output(slurm, folder, name: str, job: str) -> tuple[str, str]:
    """An ended job's output file (in ``folder``) and its log folder (logs/NAME-JOB), asserting that the job's
    script reported exit code 0 (slurm/common.sh writes it to job.log as its last line)."""
    out = os.path.join(folder, f"{name}-{job}.out")
    log = open(out).read() if os.path.exists(out) else ""
    logdir = os.path.join(ROOT, "logs", f"{name}-{job}")
    job_log = os.path.join(logdir, "job.log")
    said = open(job_log).read() if os.path.exists(job_log) else ""
    assert said.splitlines()[-1:] == ["exit code 0"], f"job {job}: {slurm.job_state(job)}\n{said[-1000:]}\n{log[-3000:]}\n{slurm.logs()}"
    return log, logdir


# each script once and each launcher once (the Ethernet profile's mpirun command line: the dry runs above)
@pytest.mark.parametrize("script,launcher_name", [("terngrad-ethernet.sbatch", "srun"),
                                                  ("terngrad-infiniband.sbatch", "mpirun")])
def test_sbatch_scripts_run_to_completion(slurm, tmp_path, script, launcher_name):
    e = dict(env(), **slurm.env)
    e.update(SLURM_CONF=slurm.conf, LAUNCHER=launcher_name, TERNGRAD_REPO=ROOT)
    if script.startswith("terngrad-infiniband"):
        e["IFACE"] = "lo"     # no IB here: the profile's settings still apply, bootstrap over loopback
    job = slurm.submit(["-N", "1", "--ntasks-per-node=2", "-t", "10", "-p", "debug",
                        os.path.join(ROOT, "slurm", script), PY, os.path.join(ROOT, "examples", "mnist_lenet.py"),
                        "--epochs", "1", "--max-steps", "15", "--test-limit", "200"], e, tmp_path, timeout=400)
    log, logdir = job_output(slurm, tmp_path, script.rsplit(".", 1)[0], job)
    assert "preflight: rank 1" in log and "compression=terngrad" in log and "bits/element" in log
    assert os.path.exists(os.path.join(logdir, "train.log"))
    shutil.rmtree(logdir)



@pytest.mark.parametrize("launcher_name", ["torchrun", "srun"])
def test_ddp_sbatch_script_trains(slurm, tmp_path, launcher_name):
    """slurm/ddp-terngrad.sbatch: 2 DDP ranks with TernGrad's hook, started by srun + torchrun or by srun alone
    (env rendezvous); the job completes, both ranks trained the same parameters, the loss fell."""
    e = dict(env(), **slurm.env)
    e.update(SLURM_CONF=slurm.conf, LAUNCHER=launcher_name, TERNGRAD_REPO=ROOT)
    result = tmp_path / "result.json"
    job = slurm.submit(["-N", "1", "--ntasks-per-node=2", "-t", "10", "-p", "debug",
                        os.path.join(ROOT, "slurm", "ddp-terngrad.sbatch"), PY,
                        os.path.join(ROOT, "examples", "ddp_mnist.py"), "--hook", "terngrad", "--max-steps", "40",
                        "--test-limit", "200", "--log-every", "10", "--json", str(result)], e, tmp_path, timeout=400)
    log, logdir = job_output(slurm, tmp_path, "ddp-terngrad", job)
    assert f"launcher {launcher_name}" in log and "hook=terngrad" in log and "step 40/40" in log
    res = json.loads(result.read_text())
    assert res["ranks"] == 2 and res["steps"] == 40 and res["params_identical"]
    assert res["loss_last"] < 0.7 * res["loss_first"] and res["terngrad"]["tensors"] == 3 * 40
    shutil.rmtree(logdir)


def test_fsdp_sbatch_script_trains(slurm, tmp_path):
    """slurm/fsdp-terngrad.sbatch: srun starts one torchrun per node with --nproc_per_node = tasks per node, and
    the example's arguments pass through.  One node here, so --replicas 2 makes the (replicate, shard) mesh
    (2, 1): TernGrad between the two ranks; the job completes, ranks = nodes x tasks per node, replicas agree."""
    e = dict(env(), **slurm.env)
    e.update(SLURM_CONF=slurm.conf, TERNGRAD_REPO=ROOT, PYTHON=PY)
    job = slurm.submit(["-N", "1", "--ntasks-per-node=2", "-t", "10", "-p", "debug",
                        os.path.join(ROOT, "slurm", "fsdp-terngrad.sbatch"), "--replicas", "2", "--steps", "6",
                        "--n-layer", "1", "--n-embd", "32", "--seq-len", "32", "--batch-size", "2", "--log-every", "0"],
                       e, tmp_path, timeout=400)
    log, logdir = job_output(slurm, tmp_path, "fsdp-terngrad", job)
    assert "launcher torchrun" in log and "--nnodes 1 --nproc_per_node 2" in log
    res = json.loads(next(l for l in log.splitlines() if l.startswith("result: ")).split(": ", 1)[1])
    assert res["frontend"] == "fsdp" and res["compression"] == "terngrad" and res["steps"] == 6
    assert res["ranks"] == 1 * 2 and res["replicas"] == 2 and res["params_identical"]
    assert res["elements_ternarized"] > 0
    shutil.rmtree(logdir)


# -- emulated 2-host cluster ----------------------------------------------------------------------
@pytest.fixture
def cluster():
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces need root and iproute2 (ip, tc)")
    prefix = f"t{os.getpid() % 100000}"
    subnet = f"10.79.{os.getpid() % 250}"
    p = run([NETNS, "up", "2", "--rate", "1gbit", "--prefix", prefix, "--subnet", subnet])
    assert p.returncode == 0, p.stderr
    try:
        yield prefix
    finally:
        run([NETNS, "down", "--prefix", prefix])
        left = run(["ip", "netns", "list"]).stdout
        assert prefix + "-" not in left


def counters(prefix):
    out = {}
    for line in run([NETNS, "counters", "--prefix", prefix]).stdout.splitlines():
        host, tx, rx = line.split()
        out[host] = (int(tx.split("=")[1]), int(rx.split("=")[1]))
    return out


def test_hosts_with_slots_and_counters_since_a_saved_reading(cluster, tmp_path):
    """hosts --slots K for several ranks per host; traffic between two processes of one host, to the host's
    own address, stays off its eth0 (delivered through lo, unshaped); traffic to the other host is counted
    on both links, and counters --since FILE prints the bytes since a saved reading."""
    prefix = cluster
    h0, h1 = f"{prefix}-h0", f"{prefix}-h1"
    assert run([NETNS, "hosts", "--prefix", prefix, "--slots", "2"]).stdout.strip() == f"{h0}:2,{h1}:2"
    assert run([NETNS, "hosts", "--prefix", prefix, "--slots", "0"]).returncode == 2
    saved = tmp_path / "before"
    saved.write_text(run([NETNS, "counters", "--prefix", prefix]).stdout)
    nbytes = 20_000_000
    send = ("import socket,threading\n"
            "srv=socket.socket();srv.bind((socket.gethostbyname(socket.gethostname()),0));srv.listen(1)\n"
            "def sink():\n c,_=srv.accept()\n while c.recv(1<<20): pass\n"
            "t=threading.Thread(target=sink);t.start()\n"
            f"s=socket.create_connection(srv.getsockname());s.sendall(bytes({nbytes}));s.close();t.join()")
    p = run([NETNS, "exec", h0, PY, "-c", send])
    assert p.returncode == 0, p.stderr
    since = counters_since(prefix, saved)
    assert max(since[h0] + since[h1]) < 100_000, since          # 20 MB inside h0: none of it on eth0
    to_h1 = ("import socket,sys\n"
             f"s=socket.create_connection(('{h1}',int(sys.argv[1])));s.sendall(bytes({nbytes}));s.close()")
    sink = ("import socket\nsrv=socket.socket();srv.bind(('0.0.0.0',0));srv.listen(1);print(srv.getsockname()[1],flush=True)\n"
            "c,_=srv.accept()\nwhile c.recv(1<<20): pass")
    server = subprocess.Popen([NETNS, "exec", h1, PY, "-c", sink], stdout=subprocess.PIPE, text=True, env=env())
    try:
        port = server.stdout.readline().strip()
        p = run([NETNS, "exec", h0, PY, "-c", to_h1, port])
        assert p.returncode == 0, p.stderr
        server.wait(60)
    finally:
        server.kill()
    since = counters_since(prefix, saved)
    assert since[h0][0] >= nbytes and since[h1][1] >= nbytes and since[h0][0] < 1.2 * nbytes, since


def counters_since(prefix, saved):
    out = {}
    for line in run([NETNS, "counters", "--prefix", prefix, "--since", str(saved)]).stdout.splitlines():
        host, tx, rx = line.split()
        out[host] = (int(tx.split("=")[1]), int(rx.split("=")[1]))
    return out


def test_two_hosts_over_an_emulated_1gbit_link(cluster, tmp_path):
    prefix = cluster
    h0, h1 = f"{prefix}-h0", f"{prefix}-h1"
    before = counters(prefix)
    steps = 40
    p = run([NETNS, "exec", h0, LAUNCH, "-np", "2", "-H", f"{h0}:1,{h1}:1", "--launcher", "mpirun",
             "--network", "ethernet", "--iface", "eth0", "--rsh-agent", RSH, "--",
             PY, os.path.join(ROOT, "examples", "mnist_lenet.py"), "--epochs", "1", "--max-steps", str(steps),
             "--test-limit", "200", "--json", str(tmp_path / "h.json")], timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"host={h0}" in p.stdout and f"host={h1}" in p.stdout      # each rank on its own host
    after = counters(prefix)
    hist = json.loads((tmp_path / "h.json").read_text())
    payload_bytes = hist[-1]["bytes_sent_per_step"] * steps
    sent_by_h1 = after[h1][0] - before[h1][0]
    received_by_h0 = after[h0][1] - before[h0][1]
    # rank 1's TernGrad payloads (plus the initial weight broadcast and control traffic) crossed the link
    assert sent_by_h1 >= payload_bytes and received_by_h0 >= payload_bytes
    shaping = run([NETNS, "exec", h0, "tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" in shaping and "1Gbit" in shaping


def test_ddp_torchrun_on_two_emulated_hosts(cluster, tmp_path):
    """launch/ddp-torchrun --netns: one torchrun per host (--nnodes 2 --node_rank i --master_addr h0's eth0)."""
    prefix = cluster
    before = counters(prefix)
    steps = 30
    p = run([os.path.join(ROOT, "launch", "ddp-torchrun"), "--netns", prefix, "--nproc", "1", "--port", "29611", "--",
             os.path.join(ROOT, "examples", "ddp_mnist.py"), "--hook", "terngrad", "--max-steps", str(steps),
             "--test-limit", "200", "--log-every", "0", "--json", str(tmp_path / "d.json")],
            timeout=400, env=dict(env(), PYTHON=PY, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "d.json").read_text())
    assert res["hosts"] == [f"{prefix}-h0", f"{prefix}-h1"] and res["params_identical"]
    assert res["loss_last"] < res["loss_first"]
    # rank 1's ternary payloads crossed the link (430,000 elements at 2 bits per step), and far less than DDP's
    # fp32 allreduce would send (about 4 bytes per element per step at N=2)
    sent_by_h1 = counters(prefix)[f"{prefix}-h1"][0] - before[f"{prefix}-h1"][0]
    assert steps * 430000 * 2 / 8 <= sent_by_h1 < steps * 430000 * 1.0, sent_by_h1


def test_fsdp_hsdp_on_two_emulated_hosts(tmp_path):
    """examples/transformers_lm.py --frontend fsdp under launch/ddp-torchrun --netns: 2 hosts x 2 ranks, the mesh
    (replicate, shard) = (2, 2) from torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE; each shard's TernGrad payloads
    go to its replica on the other host.  A cluster of its own (prefix tgfl*, subnet 10.83.*), torn down after."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces need root and iproute2 (ip, tc)")
    prefix, subnet = f"tgfl{os.getpid() % 1000}", f"10.83.{os.getpid() % 250}"
    h0, h1 = f"{prefix}-h0", f"{prefix}-h1"
    p = run([NETNS, "up", "2", "--rate", "1gbit", "--prefix", prefix, "--subnet", subnet])
    try:
        assert p.returncode == 0, p.stderr
        before = counters(prefix)
        p = run([os.path.join(ROOT, "launch", "ddp-torchrun"), "--netns", prefix, "--nproc", "2", "--port", "29621",
                 "--", os.path.join(ROOT, "examples", "transformers_lm.py"), "--frontend", "fsdp", "--steps", "6",
                 "--n-layer", "1", "--n-embd", "32", "--seq-len", "32", "--batch-size", "2", "--log-every", "0"],
                timeout=300, env=dict(env(), PYTHON=PY, OMP_NUM_THREADS="1"))
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        after = counters(prefix)
    finally:
        run([NETNS, "down", "--prefix", prefix])
    assert prefix + "-" not in run(["ip", "netns", "list"]).stdout
    res = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("result: ")).split(": ", 1)[1])
    assert res["frontend"] == "fsdp" and res["compression"] == "terngrad" and res["steps"] == 6
    assert res["ranks"] == 4 and res["replicas"] == 2 and res["params_identical"]
    # rank 0 (on h0) sent its ternarized shards to its replica, rank 2 on h1: at least its own payload bytes
    payload = res["elements_ternarized"] * res["bits_per_element_ternarized"] / 8
    assert payload > 0
    assert after[h0][0] - before[h0][0] >= payload and after[h1][1] - before[h1][1] >= payload, (before, after)
