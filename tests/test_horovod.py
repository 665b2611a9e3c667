"""Layer 4 on real Horovod: multi-process runs on Gloo (forked ranks with horovodrun --gloo's environment,
tests/support/forked_ranks.py) and under mpirun (MPI).

Each run executes tests/workers/hvd_scenarios.py on every rank; the ranks save what they fed to and got
from TernGrad, and this process recomputes every rank's ternary vector independently (tests/helpers.py)
to check the averages bit for bit.
"""
import collections
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import expected_average, expected_exchange

pytestmark = [pytest.mark.slow, pytest.mark.launch_lane("hosts")]   # mpirun worlds

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "workers", "hvd_scenarios.py")
BIN = os.path.dirname(sys.executable)
LAUNCH_TIMEOUT = 300


def launcher(kind, np_):
    if kind == "gloo":
        # gloo's per-operation timeout (30 s by default) is for a peer that is gone; here up to 4 ranks and
        # their Horovod threads share 2 cores, and under load a rank can be descheduled longer than that
        return [os.path.join(BIN, "horovodrun"), "--gloo", "--gloo-timeout-seconds", "120", "-np", str(np_), "-H",
                f"localhost:{np_}"]
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: scripts/setup.sh installs OpenMPI (openmpi-bin)"
    return [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(np_), "--bind-to", "none",
            "--mca", "btl_vader_single_copy_mechanism", "none", "-x", "PATH", "-x", "PYTHONPATH"]


def rank_env():
    """Environment of launched ranks: this package importable, this venv's launchers first, one thread per
    rank and yielding MPI waits (ranks share the machine's cores), never ssh (one host)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env.setdefault("OMPI_MCA_plm_rsh_agent", "false")
    return env


def launch(tmp_path, kind, np_, scenarios):
    """``kind`` "gloo": forked ranks with horovodrun --gloo's environment (tests/support/forked_ranks.py); "mpi":
    mpirun itself."""
    if kind == "gloo":
        from support import forked_ranks
        forked_ranks.run_scenarios("horovod", np_, WORKER, [str(tmp_path)] + scenarios, str(tmp_path))
        return {sc: load_results(tmp_path, sc, np_) for sc in scenarios}
    env = rank_env()
    cmd = launcher(kind, np_) + [sys.executable, WORKER, str(tmp_path)] + scenarios
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{kind} -np {np_} hung for {LAUNCH_TIMEOUT}s:\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    return {sc: load_results(tmp_path, sc, np_) for sc in scenarios}


def load_results(folder, scenario, np_):
    """Every rank's saved results of one scenario (checked for crashes and the world size)."""
    ranks = [torch.load(os.path.join(folder, f"{scenario}.rank{r}.pt"), weights_only=False) for r in range(np_)]
    # every rank's crash: the first rank's is often only Horovod's shutdown after another rank's error
    crashes = [f"{scenario} rank {r}:\n{res['crash']}" for r, res in enumerate(ranks) if "crash" in res]
    assert not crashes, "\n".join(crashes)
    assert all(res["size"] == np_ for res in ranks)
    return ranks


def by_name_and_step(pairs):
    """[(name, tensor)] in call order -> {(name, step): tensor}."""
    seen = collections.Counter()
    out = {}
    for name, t in pairs:
        out[(name, seen[name])] = t
        seen[name] += 1
    return out


def check_exact(ranks):
    N = len(ranks)
    cfg = ranks[0]["config"]
    inputs = [by_name_and_step(r["inputs"]) for r in ranks]
    outputs = [by_name_and_step(r["outputs"]) for r in ranks]
    assert set(inputs[0]) == set(outputs[0]) and len(inputs[0]) >= 3 * len(ranks[0]["names"])
    checked = 0
    for (name, step) in sorted(inputs[0]):
        grads = [inputs[r][(name, step)] for r in range(N)]
        if cfg.compresses(name, grads[0].numel()):
            want = expected_exchange(grads, name, step, cfg)
            for r in range(N):
                got = outputs[r][(name, step)]
                assert got.dtype == grads[r].dtype
                assert torch.equal(got, want), f"{name} step {step} rank {r}"
            checked += 1
        else:
            mean = torch.stack([g.float() for g in grads]).mean(0)
            for r in range(N):
                torch.testing.assert_close(outputs[r][(name, step)].float(), mean)
    for r in range(1, N):   # the models stayed identical on every rank
        for a, b in zip(ranks[0]["params"], ranks[r]["params"]):
            assert torch.equal(a, b)
    return checked


ALL = ["auto_on", "auto_off", "fusion_partial", "exact", "exact_unfused", "exact_sharded_unfused", "exact_small_groups", "exact_base3_buckets", "exact_sharded", "exact_reternarized", "exact_requantized", "exact_per_rank_bpps2", "exclude", "bf16", "nan_raise", "nan_zero",
       "fp_inf_min_numel", "fp_inf_exclude", "fp_inf_auto_off", "fp_inf_min_numel_zero", "fp_inf_auto_off_zero",
       "mismatch", "functional"]


@pytest.fixture(scope="module")
def gloo2(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("gloo2"), "gloo", 2, ALL)


@pytest.mark.parametrize("sc", ["exact", "exact_unfused", "exact_small_groups", "exact_base3_buckets",
                                "exact_per_rank_bpps2", "bf16", "exact_sharded", "exact_sharded_unfused",
                                "exact_reternarized", "exact_requantized"])
def test_gloo2_exact(gloo2, sc):
    assert check_exact(gloo2[sc]) > 0


def test_gloo2_tensor_fusion_cuts_collectives_not_bits(gloo2):
    """The 4-layer MLP has 8 tensors: unfused, each costs an allgather per step (per-rank scalers, the
    default; plus one presence check per step).  With fusion the plan is cut from the optimizer's
    parameters at the first gradient (no extra round, no unfused first step), so all 8 share one allgather
    from step 1; with groups of <= 1000 elements (the 1024-element weights travel alone) there are 5
    exchanges per step.  Same seed, same inputs: identical results."""
    stats = {sc: gloo2[sc][0]["stats"] for sc in ("exact", "exact_unfused", "exact_small_groups")}
    assert stats["exact_unfused"]["collectives"] == 3 * (8 + 1)
    assert stats["exact"]["collectives"] == 3 * (1 + 1)
    assert stats["exact_small_groups"]["collectives"] == 3 * (5 + 1)
    # sharded: handshake + alltoall + allgather per group
    assert gloo2["exact_sharded"][0]["stats"]["collectives"] == 3 * 3 * 1
    assert gloo2["exact_sharded_unfused"][0]["stats"]["collectives"] == 3 * 3 * 8
    for sc in ("exact", "exact_small_groups"):
        assert stats[sc]["elements"] == stats["exact_unfused"]["elements"]
        assert stats[sc]["payload_bytes_sent"] == stats["exact_unfused"]["payload_bytes_sent"]
        for a, b in zip(gloo2[sc][0]["params"], gloo2["exact_unfused"][0]["params"]):
            assert torch.equal(a, b)


def test_gloo2_fused_group_with_a_member_gone_still_completes(gloo2):
    a, b = gloo2["fusion_partial"]
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    # one group of 8 from step 0 (2 collectives per step); from step 2 the bias is gone and the other 7
    # go as the group's '.partial' exchange, still 2 collectives
    assert a["collectives"] == b["collectives"] == 4 * 2


def test_gloo2_auto_measures_the_link_and_ternarizes_where_it_pays(gloo2):
    """exchange="auto" measured the link on both ranks (agreed: identical figures); with a free codec it
    ternarizes (per-rank scalers at N = 2, bit-exact); with a codec slower than the bytes it saves every
    tensor travels by Horovod's full-precision allreduce, on every rank, and nothing is ternarized."""
    on, off = gloo2["auto_on"], gloo2["auto_off"]
    assert check_exact(on) > 0 and on[0]["stats"]["elements"] > 0
    for ranks in (on, off):
        links = [r["link"] for r in ranks]
        assert links[0] is not None and links[0] == links[1] and links[0]["ranks"] == 2
        assert links[0]["allreduce_Bps"] > 0
    assert on[0]["link_compresses"] and not off[0]["link_compresses"]
    assert "compression OFF" in off[0]["link_text"]
    for r in off:
        assert r["stats"]["elements"] == 0 and r["stats"]["collectives"] == 0
    ins = [by_name_and_step(r["inputs"]) for r in off]
    for key, got in by_name_and_step(off[0]["outputs"]).items():
        torch.testing.assert_close(got, (ins[0][key] + ins[1][key]) / 2)
    for a, b in zip(off[0]["params"], off[1]["params"]):
        assert torch.equal(a, b)


def test_gloo2_excluded_tensors_travel_uncompressed(gloo2):
    ranks = gloo2["exclude"]
    cfg = ranks[0]["config"]   # exclude "^6\." (the last Linear), min_numel 10
    assert not cfg.compresses("6.weight", 128) and cfg.compresses("4.weight", 1024)
    assert check_exact(ranks) > 0
    last_layer = sum(t.numel() for t in ranks[0]["params"][-2:])
    per_step = sum(t.numel() for t in ranks[0]["params"])
    assert ranks[0]["stats"]["elements"] == 3 * (per_step - last_layer)


def test_gloo2_nan_on_one_rank_raises_on_all(gloo2):
    for r in gloo2["nan_raise"]:
        assert r["error"] and "NaN or Inf on rank 1" in r["error"]


def test_gloo2_nan_zero_policy_keeps_ranks_in_step(gloo2):
    a, b = gloo2["nan_zero"]
    assert a["zeroed"] > 0 and a["zeroed"] == b["zeroed"]
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y) and torch.isfinite(x).all()


@pytest.mark.parametrize("case", ["min_numel", "exclude", "auto_off"])
def test_gloo2_inf_in_a_full_precision_tensor_raises_on_every_rank(gloo2, case):
    """on_nonfinite covers the tensors that travel at full precision (under min_numel, excluded, or where
    exchange="auto" finds compression does not pay): rank 1's Inf reaches every rank's reduced result, and
    every rank raises, naming the tensor, instead of stepping into non-finite weights."""
    for r in gloo2[f"fp_inf_{case}"]:
        assert r["error"] and f"'fp_inf_{case}.2.weight'" in r["error"] and "full precision" in r["error"], r
        assert r["uncompressed"] >= 1024


@pytest.mark.parametrize("case", ["min_numel", "auto_off"])
def test_gloo2_inf_in_a_full_precision_tensor_zeroed_alike(gloo2, case):
    a, b = gloo2[f"fp_inf_{case}_zero"]
    assert a["error"] is None and a["zeroed"] == b["zeroed"] == 1
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y) and torch.isfinite(x).all()


def test_gloo2_mismatched_shapes_error_not_hang(gloo2):
    for r in gloo2["mismatch"]:
        assert r["optimizer"] and "disagree" in r["optimizer"]
        assert r["functional"] and "'functional.x'" in r["functional"]


def test_gloo2_functional_api(gloo2):
    from horovod_terngrad import TernGradConfig
    ranks = gloo2["functional"]
    cfg = TernGradConfig()
    for key in ["f16", "bf16", "f64", "noncontig", "zero"]:
        want, _ = expected_average([r["inputs"][key] for r in ranks], f"fn.{key}", 0, cfg)
        for r in ranks:
            assert r[key].dtype == r["inputs"][key].dtype and r[key].shape == r["inputs"][key].shape
            assert torch.equal(r[key], want), key
    for r in ranks:
        assert r["empty"].shape == (0, 4)
        assert "integer" in r["int"] or "dtype torch.int64" in r["int"]
    bases = [r["inputs"]["noncontig"].t() for r in ranks]
    want, _ = expected_average(bases, "fn.direct", 0, cfg)
    want_sum, _ = expected_average(bases, "fn.directsum", 0, cfg, average=False)
    for r in ranks:   # hvd.allreduce(..., compression=TernGrad): named, out of place, op respected
        assert r["direct_input_kept"] and torch.equal(r["direct"], want) and torch.equal(r["direct_sum"], want_sum)
    for k in range(3):
        want, _ = expected_average([r["async_inputs"][k] for r in ranks], f"fn.async{k}", 0, cfg)
        assert all(torch.equal(r["async"][k], want) for r in ranks)


def test_gloo4_exact(tmp_path):
    res = launch(tmp_path, "gloo", 4, ["exact", "exact_base3_buckets", "nan_raise", "exact_sharded"])
    assert check_exact(res["exact"]) > 0
    assert check_exact(res["exact_sharded"]) > 0
    assert check_exact(res["exact_base3_buckets"]) > 0
    assert all("NaN or Inf on rank 1" in r["error"] for r in res["nan_raise"])


def test_mpirun2_exact(tmp_path):
    res = launch(tmp_path, "mpi", 2, ["exact", "exact_per_rank_bpps2", "mismatch", "nan_raise", "exact_sharded"])
    assert check_exact(res["exact_sharded"]) > 0
    assert check_exact(res["exact"]) > 0
    assert check_exact(res["exact_per_rank_bpps2"]) > 0
    assert all(r["optimizer"] and r["functional"] for r in res["mismatch"])
    assert all("NaN or Inf on rank 1" in r["error"] for r in res["nan_raise"])
