"""The node-aware exchange on real ranks: Gloo (forked ranks with horovodrun --gloo's environment,
tests/support/forked_ranks.py) and mpirun with 4 ranks as 2 nodes x 2 (node names per rank, contiguous and
interleaved), on 2 emulated hosts x 2 ranks (network namespaces), and every
fallback; averages checked bit for bit against tests/helpers.expected_hierarchical."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import expected_hierarchical
from support import forked_ranks
from horovod_terngrad.exchange.topology import Topology
from test_horovod import LAUNCH_TIMEOUT, by_name_and_step, launcher, load_results, rank_env

pytestmark = [pytest.mark.slow,      # every test here launches ranks (horovodrun, mpirun, torchrun)
              pytest.mark.launch_lane("hosts")]    # emulated hosts and mpirun worlds

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "hvd_hier.py")


# a scenario still running after this long on a rank writes where that rank is (the TernGrad collectives it
# posted and has not synchronized, every thread's Python and native stack; workers/stall_watch.py), and a failed
# launch shows those reports: well under Gloo's 120 s timeout (test_horovod.launcher), which ends a stuck job
# without a word on where.  It only reports: a long scenario is not a failure (imports alone took over a minute on
# 2 overloaded cores), the launch still ends as it would
STALL_S = 60


def stall_reports(tmp_path) -> str:
    """What ranks whose scenario ran long wrote (workers/stall_watch.py), rank by rank."""
    return "\n".join(f.read_text() for f in sorted(tmp_path.glob("*.stall.txt")))


def ranks_env(env=None) -> dict:
    """What every launch here gives its ranks, then ``env``: process sets may be added (the sharded exchange across
    nodes needs them; tests of their absence say "0"), and the stall watch's threshold."""
    return dict({"HOROVOD_DYNAMIC_PROCESS_SETS": "1", "HVD_TEST_STALL_S": str(STALL_S)}, **(env or {}))


def launch(tmp_path, kind, hosts, scenarios, np_=4, env=None):
    env = ranks_env(env)
    forward = [a for k in env for a in ("-x", k)] if kind == "mpirun" else []
    cmd = launcher(kind, np_) + forward + [sys.executable, WORKER, str(tmp_path), hosts] + scenarios
    try:
        p = subprocess.run(cmd, env=dict(rank_env(), **env), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{kind} hung for {LAUNCH_TIMEOUT}s:\n{stall_reports(tmp_path)}\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, (f"{' '.join(cmd)}\n{stall_reports(tmp_path)}\nstdout:\n{p.stdout[-4000:]}\n"
                               f"stderr:\n{p.stderr[-4000:]}")
    return {sc: load_results(tmp_path, sc, np_) for sc in scenarios}, p


def launch_cases(tmp_path, cases: dict, scenarios: list, env=None):
    """One launch (Gloo, 4 forked ranks: tests/support/forked_ranks.py) running ``scenarios`` ("SCENARIO@CASE"), each case as a job of its own would
    (tests/workers/hvd_hier.py): ``cases`` maps CASE to its node names and environment.  Returns the results
    and, per case, the lines rank 0 wrote to stderr while it ran."""
    env = ranks_env(dict(env or {}, HIER_TEST_CASES=json.dumps(cases)))
    try:
        logs = forked_ranks.run_scenarios("horovod", 4, WORKER, [str(tmp_path), "-"] + scenarios, str(tmp_path),
                                          env=env, timeout=LAUNCH_TIMEOUT)
    except AssertionError as e:
        raise AssertionError(f"{stall_reports(tmp_path)}\n{e}") from None
    rank0_err = logs[0][1]
    said, case = {}, None
    for text in rank0_err.splitlines():
        if text.startswith("=== ") and text.endswith(" ==="):
            case = text[4:-4].partition("@")[2]
            said[case] = []
        elif case is not None:
            said[case].append(text)
    assert set(said) == {sc.partition("@")[2] for sc in scenarios}, rank0_err[-3000:]
    return {sc: load_results(tmp_path, sc, 4) for sc in scenarios}, said


def check_against_reference(ranks, fused: bool):
    cfg = ranks[0]["config"]
    topo = Topology(tuple(tuple(n) for n in ranks[0]["nodes"]))
    inputs = [by_name_and_step(r["inputs"]) for r in ranks]
    outputs = [by_name_and_step(r["outputs"]) for r in ranks]
    groups = ranks[0]["groups"] if fused else [[n] for n in ranks[0]["names"]]
    steps = max(s for _, s in inputs[0]) + 1
    ref_steps: dict = {}
    checked = 0
    for step in range(steps):
        for group in groups:
            per_rank = [[inputs[r][(n, step)] for n in group] for r in range(len(ranks))]
            want = expected_hierarchical(per_rank, group, topo, cfg, ref_steps)
            for r in range(len(ranks)):
                for n, w in zip(group, want):
                    assert torch.equal(outputs[r][(n, step)], w), (n, step, r)
                    checked += 1
    assert checked >= 3 * len(ranks) * len(ranks[0]["names"])


def check_bit_exact(res: dict, hosts: str, scenarios: list):
    want_nodes = [list(n) for n in Topology.from_hosts(hosts.split(",")).nodes]
    for sc in scenarios:
        assert all(r["hierarchical"] and r["nodes"] == want_nodes for r in res[sc]), sc
        check_against_reference(res[sc], fused=(sc.partition("@")[0] in ("fused", "fp32inside")))
        assert all(r["stats"]["intra_node_bytes_sent"] > 0 for r in res[sc])
    assert len(res[next(sc for sc in scenarios if sc.startswith("fused"))][0]["groups"]) == 1


# Gloo (forked ranks), 2 nodes x 2 given by node name per rank, contiguous and interleaved: one launch
GLOO_2X2 = {"contiguous": "h0,h0,h1,h1", "interleaved": "h0,h1,h0,h1"}
# "exact", "fused", "sharded": the default's bf16 inside the node; "fp32inside": fp32 there
BIT_EXACT = {"contiguous": ["exact", "fused", "sharded", "fp32inside"], "interleaved": ["exact", "fused", "sharded"]}


@pytest.fixture(scope="module")
def gloo_2x2_launch(tmp_path_factory):
    cases = {k: {"hosts": h} for k, h in GLOO_2X2.items()}
    # the sharded exchange's last: it adds process sets, and unfused collectives after that ran several times
    # slower here (Horovod coordinating each set every cycle, we think; not measured in isolation)
    scenarios = ([f"{sc}@{k}" for k, scs in BIT_EXACT.items() for sc in scs if sc != "sharded"]
                 + ["nan@contiguous", "join@contiguous", "resume@contiguous"]
                 + [f"sharded@{k}" for k in BIT_EXACT])
    return launch_cases(tmp_path_factory.mktemp("gloo-2x2"), cases, scenarios)[0]


@pytest.mark.parametrize("case", list(GLOO_2X2), ids=[f"gloo-{k}" for k in GLOO_2X2])
def test_bit_exact_on_real_ranks(gloo_2x2_launch, case):
    check_bit_exact(gloo_2x2_launch, GLOO_2X2[case], [f"{sc}@{case}" for sc in BIT_EXACT[case]])


def test_bit_exact_on_real_ranks_mpirun_crossed(tmp_path):
    scenarios = ["exact", "fused", "sharded"]
    res, _ = launch(tmp_path, "mpirun", "h0,h1,h1,h0", scenarios)
    check_bit_exact(res, "h0,h1,h1,h0", scenarios)


def test_nan_join_and_resume_on_real_ranks(gloo_2x2_launch):
    res = {k.partition("@")[0]: v for k, v in gloo_2x2_launch.items() if k.endswith("@contiguous")}
    # NaN on rank 3 (node 1) only: every rank raises, nobody hangs
    assert [r["raised"] for r in res["nan"]] == ["NonFiniteGradientError"] * 4, [r.get("message") for r in res["nan"]]
    # rank 2 joined after 2 steps: the others' last 2 steps went by the flat join transport; all agree
    join = res["join"]
    assert all(r["hierarchical"] for r in join) and {r["last_joined"] for r in join} == {join[0]["last_joined"]}
    for r in (1, 3):
        assert all(torch.equal(a, b) for a, b in zip(join[0]["params"], join[r]["params"]))
    assert len(join[0]["outputs"]) == 4 * len(join[0]["params"])
    # resumed from a checkpoint: the same parameters as the uninterrupted run, bit for bit
    for r in res["resume"]:
        assert r["hierarchical"] and all(torch.equal(a, b) for a, b in zip(r["whole"], r["resumed"]))


@pytest.mark.parametrize("kind", ["gloo", "mpirun"])
def test_a_killed_rank_ends_the_job_with_horovods_error(tmp_path, kind):
    """Nobody hangs: the job ends with an error.  A survivor that gets to save its record (the launcher may end
    it first) raised Horovod's HorovodInternalError, as under the flat exchange: the node-aware exchange runs
    on world collectives (world_groups.py).  (Over Horovod process sets, Gloo aborted the survivors from
    Horovod's background thread instead: "gloo::IoException ... Connection closed by peer".)"""
    cmd = launcher(kind, 4) + [sys.executable, WORKER, str(tmp_path), "h0,h0,h1,h1", "kill"]
    try:
        p = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the survivors hung after a rank died:\n{e.stdout}\n{e.stderr}")
    assert p.returncode != 0
    saved = [tmp_path / f"kill.rank{r}.pt" for r in range(3)]
    out = p.stdout + p.stderr
    assert any(f.exists() for f in saved) or "gloo::IoException" in out or kind == "mpirun", out[-3000:]
    for f in saved:             # the launcher may end a survivor before it saved
        if f.exists():
            res = torch.load(f, weights_only=False)
            assert "HorovodInternalError" in res["error_type"] and res["hierarchical"], res


FALLBACK = "node-aware exchange off"


# where the node-aware exchange cannot run, with process sets allowed: (nodes, environment, the reason rank 0
# gives, whether it shows without any logging setup); "*-true" ask for it (hierarchical=True) and must raise
FALLBACKS = {
    "one-node": ("h0,h0,h0,h0", {}, "one node", False),
    "one-rank-per-node": ("h0,h1,h2,h3", {}, "every node has one rank", False),
    "one-node-true": ("h0,h0,h0,h0", {"HIER_TEST_SETTING": "true"}, "one node", True),
    "uneven": ("h0,h0,h0,h1", {}, "different rank counts", True),
    "uneven-true": ("h0,h0,h0,h1", {"HIER_TEST_SETTING": "true"}, None, None),
}
# without dynamic process sets (HOROVOD_DYNAMIC_PROCESS_SETS=0), the topology h0,h0,h1,h1's groups registered
# at hvd.init(); h0,h1,h0,h1 has the same groups, h0,h1,h1,h0 (nodes {0, 3}, {1, 2}) has groups never registered
NO_DYNAMIC_SETS = {
    "registered": ("h0,h0,h1,h1", {"HOROVOD_TERNGRAD_NODE_GROUPS": "process_sets"}),
    "no-dynamic-sets": ("h0,h1,h0,h1", {}),
    "elastic": ("h0,h1,h0,h1", {"HOROVOD_ELASTIC": "1"}),
    "process-sets-asked-but-off": ("h0,h1,h1,h0", {"HOROVOD_TERNGRAD_NODE_GROUPS": "process_sets"}),
    "shared-scaler-without-process-sets": ("h0,h1,h1,h0", {"HIER_TEST_SHARED": "1"}),
    "shared-scaler-without-process-sets-true": ("h0,h1,h1,h0", {"HIER_TEST_SHARED": "1", "HIER_TEST_SETTING": "true"}),
}
WORLD_GROUPS = ("no-dynamic-sets", "elastic", "process-sets-asked-but-off")


@pytest.fixture(scope="module")
def fallback_launch(tmp_path_factory):
    cases = {k: {"hosts": h, "env": e} for k, (h, e, _, _) in FALLBACKS.items()}
    return launch_cases(tmp_path_factory.mktemp("fallbacks"), cases, [f"fallback@{k}" for k in FALLBACKS])


@pytest.fixture(scope="module")
def no_dynamic_sets_launch(tmp_path_factory):
    cases = {k: {"hosts": h, "env": e} for k, (h, e) in NO_DYNAMIC_SETS.items()}
    scenarios = (["exact@registered"] + [f"{sc}@{k}" for k in WORLD_GROUPS for sc in ("exact", "fused")]
                 + ["fallback@shared-scaler-without-process-sets", "fallback@shared-scaler-without-process-sets-true"])
    return launch_cases(tmp_path_factory.mktemp("no-dynamic-sets"), cases, scenarios,
                        env={"HOROVOD_DYNAMIC_PROCESS_SETS": "0", "HIER_TEST_STATIC_SETS": "0.1,2.3,0.2,1.3"})


@pytest.mark.parametrize("case", ["one-node", "one-rank-per-node", "one-node-true", "uneven",
                                  "shared-scaler-without-process-sets"])
def test_fallbacks_run_flat_and_say_why_once_at_warning_where_it_matters(fallback_launch, no_dynamic_sets_launch,
                                                                         case):
    """Without any logging setup (as a training script has none): where the job has several nodes of several
    ranks and the node-aware exchange still does not run, rank 0's WARNING shows, once; one node or one rank
    per node stays quiet (unless hierarchical=True asked for it).  A shared scaler without process sets (none
    can be added, and the topology's are not registered): flat, saying Horovod cannot add them."""
    if case in FALLBACKS:
        (res, said), (_, _, reason, warned) = fallback_launch, FALLBACKS[case]
    else:
        (res, said), reason, warned = no_dynamic_sets_launch, "cannot add process sets", True
    ranks = res[f"fallback@{case}"]
    assert not any(r["hierarchical"] or r["error"] for r in ranks)
    outs = [r["outputs"] for r in ranks]
    assert all(torch.equal(a[1], b[1]) for o in outs[1:] for a, b in zip(outs[0], o))
    lines = [line for line in said[case] if FALLBACK in line]
    if warned:
        assert len(lines) == 1 and reason in lines[0], lines
    else:
        assert lines == []


@pytest.mark.parametrize("case", ["uneven-true", "shared-scaler-without-process-sets-true"])
def test_hierarchical_true_where_a_multi_node_job_cannot_have_it_raises_on_every_rank(fallback_launch,
                                                                                    no_dynamic_sets_launch, case):
    res, _ = fallback_launch if case in FALLBACKS else no_dynamic_sets_launch
    ranks = res[f"fallback@{case}"]
    errors = [r["error"] for r in ranks]
    assert all(r["error_type"] == "TernGradError" for r in ranks), errors
    assert len(set(errors)) == 1 and "hierarchical=True" in errors[0] and "hierarchical='auto'" in errors[0]


@pytest.mark.parametrize("case", WORLD_GROUPS)
def test_node_aware_without_process_sets_runs_over_world_collectives_bit_for_bit(no_dynamic_sets_launch, case):
    """No process set can be added (HOROVOD_DYNAMIC_PROCESS_SETS off at hvd.init(), Horovod elastic), or the
    topology's are not among those registered: the node and cross groups run as world alltoalls, the same bits
    as the reference; asked for process sets (HOROVOD_TERNGRAD_NODE_GROUPS=process_sets), rank 0 says so once."""
    res, said = no_dynamic_sets_launch
    for sc in ("exact", "fused"):
        ranks = res[f"{sc}@{case}"]
        assert all(r["hierarchical"] and r["world_groups"] for r in ranks), sc
        check_against_reference(ranks, fused=(sc == "fused"))
    lines = [line for line in said[case] if "world collectives instead" in line]
    assert len(lines) == (1 if "HOROVOD_TERNGRAD_NODE_GROUPS" in NO_DYNAMIC_SETS[case][1] else 0), lines


def test_process_sets_registered_at_init_are_reused_without_dynamic_sets(no_dynamic_sets_launch):
    res, _ = no_dynamic_sets_launch
    assert all(r["hierarchical"] and not r["world_groups"] for r in res["exact@registered"])
    check_against_reference(res["exact@registered"], fused=False)


# -- 2 emulated hosts x 2 ranks (network namespaces; real host names) ---------------------------------------
def test_two_emulated_hosts_of_two_ranks_mpirun(tmp_path):
    """mpirun through launch/netns-rsh on 2 network-namespace hosts, 2 ranks each, mapped by node (ranks 0, 2
    on h0 and 1, 3 on h1: the topology is learned from the host names); bit for bit; and the hierarchical
    exchange's traffic between the hosts is the cross-node payloads, not the intra-node fp32."""
    from test_launch import NETNS, RSH, counters
    from test_launch import run as run_cmd
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces need root and iproute2 (ip, tc)")
    prefix = f"q{os.getpid() % 100000}"
    subnet = f"10.81.{os.getpid() % 250}"
    p = run_cmd([NETNS, "up", "2", "--rate", "1gbit", "--prefix", prefix, "--subnet", subnet])
    assert p.returncode == 0, p.stderr
    try:
        h0, h1 = f"{prefix}-h0", f"{prefix}-h1"
        before = counters(prefix)
        mpirun = shutil.which("mpirun")
        cmd = [NETNS, "exec", h0, mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "4", "-H", f"{h0}:2,{h1}:2",
               "--map-by", "node", "--bind-to", "none", "--mca", "plm_rsh_agent", RSH,
               "--mca", "pml", "ob1", "--mca", "btl", "tcp,self,vader", "--mca", "btl_vader_single_copy_mechanism", "none",
               "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
               "-x", "PATH", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "OMPI_MCA_mpi_yield_when_idle",
               sys.executable, WORKER, str(tmp_path), "-", "exact", "fused"]
        p = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        after = counters(prefix)
    finally:
        run_cmd([NETNS, "down", "--prefix", prefix])
    res = {sc: load_results(tmp_path, sc, 4) for sc in ("exact", "fused")}
    for sc, ranks in res.items():
        assert all(r["hierarchical"] and r["nodes"] == [[0, 2], [1, 3]] for r in ranks), sc
        check_against_reference(ranks, fused=(sc == "fused"))
    # h1's ranks (1, 3) sent their cross-node payloads over h1's link; the fp32 of the intra-node stages
    # stayed inside the host (the tiny model's bytes are too few to weigh against MPI's and Horovod's own
    # traffic here: examples/emulated_cluster_benchmark.py measures the bytes per host link)
    sent_h1 = after[h1][0] - before[h1][0]
    payload_h1 = sum(ranks[r]["stats"]["payload_bytes_sent"] for ranks in res.values() for r in (1, 3))
    assert payload_h1 > 0 and sent_h1 >= payload_h1, (sent_h1, payload_h1)


def test_script_that_imports_terngrad_after_hvd_init_on_two_emulated_hosts(tmp_path):
    """The pattern of Horovod's own examples on a real multi-host job: hvd.init() first, TernGrad imported
    afterwards, every setting at its default, mpirun across 2 network-namespace hosts (each its own host name)
    x 2 ranks.  The node-aware exchange runs (over world collectives: no process set was registered or can be
    added), bit for bit against the reference, ranks identical; and each host link carries at most about half
    of what the flat exchange (hierarchical=False, run the same way) puts on it."""
    from test_launch import NETNS, RSH, counters
    from test_launch import run as run_cmd
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces need root and iproute2 (ip, tc)")
    worker = os.path.join(HERE, "workers", "hvd_init_first.py")
    prefix = f"i{os.getpid() % 100000}"
    subnet = f"10.85.{os.getpid() % 250}"
    p = run_cmd([NETNS, "up", "2", "--rate", "1gbit", "--prefix", prefix, "--subnet", subnet])
    assert p.returncode == 0, p.stderr
    link = {}
    try:
        h0, h1 = f"{prefix}-h0", f"{prefix}-h1"
        for config in ("defaults", "flat"):
            before = counters(prefix)
            cmd = [NETNS, "exec", h0, shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", "4",
                   "-H", f"{h0}:2,{h1}:2", "--bind-to", "none", "--mca", "plm_rsh_agent", RSH,
                   "--mca", "pml", "ob1", "--mca", "btl", "tcp,self,vader", "--mca", "btl_vader_single_copy_mechanism",
                   "none", "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
                   "-x", "PATH", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "OMPI_MCA_mpi_yield_when_idle",
                   sys.executable, worker, str(tmp_path), config]
            env = rank_env()
            env.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
            after = counters(prefix)
            link[config] = {h: (after[h][0] - before[h][0], after[h][1] - before[h][1]) for h in (h0, h1)}
            assert "node-aware exchange off" not in p.stdout + p.stderr
    finally:
        run_cmd([NETNS, "down", "--prefix", prefix])
    res = {c: load_results(tmp_path, c, 4) for c in ("defaults", "flat")}
    ranks = res["defaults"]
    assert all(r["hierarchical"] and r["world_groups"] and r["nodes"] == [[0, 1], [2, 3]] for r in ranks)
    assert not any(r["hierarchical"] for r in res["flat"])
    assert ranks[0]["groups"] and all(r["stats"]["intra_node_bytes_sent"] > 0 for r in ranks)
    check_against_reference(ranks, fused=True)
    for c in ("defaults", "flat"):
        assert all(torch.equal(a, b) for r in res[c][1:] for a, b in zip(res[c][0]["params"], r["params"])), c
        assert all(torch.isfinite(p).all() for p in res[c][0]["params"])
    # bytes each host sent and received on its link: the node-aware exchange crosses about a quarter of the flat
    # exchange's payload bytes here; Horovod's and MPI's own traffic is the same in both runs
    for h in link["flat"]:
        for d in (0, 1):
            assert link["defaults"][h][d] < 0.55 * link["flat"][h][d], link
    print("host-link bytes (sent, received):", link)


def test_two_emulated_hosts_of_two_ranks_horovodrun_gloo(tmp_path):
    """horovodrun --gloo from host h0 to h1 through launch/netns-ssh (ssh's stand-in), 2 ranks per host."""
    from test_launch import NETNS
    from test_launch import run as run_cmd
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces need root and iproute2 (ip, tc)")
    prefix = f"g{os.getpid() % 100000}"
    subnet = f"10.83.{os.getpid() % 250}"
    shim = tmp_path / "bin"
    shim.mkdir()
    os.symlink(os.path.join(os.path.dirname(HERE), "launch", "netns-ssh"), shim / "ssh")
    p = run_cmd([NETNS, "up", "2", "--rate", "1gbit", "--prefix", prefix, "--subnet", subnet])
    assert p.returncode == 0, p.stderr
    try:
        h0, h1 = f"{prefix}-h0", f"{prefix}-h1"
        env = rank_env()
        env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
        env.pop("OMPI_MCA_plm_rsh_agent", None)
        cmd = [NETNS, "exec", h0, os.path.join(os.path.dirname(sys.executable), "horovodrun"), "--gloo", "--gloo-timeout-seconds", "120", "-np", "4",
               "-H", f"{h0}:2,{h1}:2", "--network-interface", "eth0", "--start-timeout", "60",
               sys.executable, WORKER, str(tmp_path), "-", "exact"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    finally:
        run_cmd([NETNS, "down", "--prefix", prefix])
    ranks = load_results(tmp_path, "exact", 4)
    assert all(r["hierarchical"] and r["nodes"] == [[0, 1], [2, 3]] for r in ranks)
    check_against_reference(ranks, fused=False)


@pytest.mark.parametrize("hosts,intra", [("h0,h0,h1,h1", "float32"), ("h0,h1,h0,h1", "bfloat16")],
                         ids=["contiguous-fp32-inside", "interleaved-bf16-inside"])
def test_ddp_hook_node_aware_under_torchrun(tmp_path, hosts, intra):
    worker = os.path.join(HERE, "workers", "ddp_hier.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", worker,
           str(tmp_path), hosts, intra]
    try:
        p = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun hung:\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"ddp_hier.rank{r}.pt", weights_only=False) for r in range(4)]
    assert not [r["crash"] for r in ranks if "crash" in r], [r["crash"] for r in ranks if "crash" in r][0]
    want_nodes = [list(n) for n in Topology.from_hosts(hosts.split(",")).nodes]
    assert all(r["hierarchical"] and r["nodes"] == want_nodes for r in ranks)
    assert all(torch.equal(a, b) for r in ranks[1:] for a, b in zip(ranks[0]["params"], r["params"]))
    cfg, topo = ranks[0]["config"], Topology(tuple(tuple(n) for n in want_nodes))
    inputs = [by_name_and_step(r["inputs"]) for r in ranks]
    outputs = [by_name_and_step(r["outputs"]) for r in ranks]
    groups = ranks[0]["groups"]
    assert len(groups) >= 6 and all(r["groups"] == groups for r in ranks)      # several buckets, 3 steps
    ref_steps, seen, checked = {}, {}, 0
    for group in groups:
        step = seen.get(group[0], 0)
        for n in group:
            seen[n] = step + 1
        want = expected_hierarchical([[inputs[r][(n, step)] for n in group] for r in range(4)], group, topo, cfg,
                                     ref_steps)
        for r in range(4):
            for n, w in zip(group, want):
                assert torch.equal(outputs[r][(n, step)], w), (n, step, r)
                checked += 1
    assert checked >= 4 * 3 * len(ranks[0]["params"])
