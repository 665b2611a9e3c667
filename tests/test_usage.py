"""Drop-in for what users do with Horovod: every pattern of tests/workers/hvd_usage.py runs on real ranks
(Gloo: forked ranks with horovodrun --gloo's environment, tests/support/forked_ranks.py; and mpirun) with TernGrad and with hvd.Compression.none, and must work with both.

One launch per launcher runs every pattern (under Gloo with TernGrad and Compression.none in turn, in the same
processes); the checks below read what each rank saved.
With TernGrad the averages are recomputed independently (tests/helpers.py) and must match bit for bit.
"""
import os
import subprocess
import sys

import pytest
import torch

from helpers import expected_average
from support import forked_ranks
from test_horovod import HERE, by_name_and_step, check_exact, launcher, rank_env

pytestmark = [pytest.mark.slow, pytest.mark.launch_lane("hosts")]   # mpirun worlds

WORKER = os.path.join(HERE, "workers", "hvd_usage.py")
LAUNCH_TIMEOUT = 180        # a launch takes ~10 s; a hang must fail, not stall CI
# join runs after the others: in Horovod 0.28.1 a direct hvd.grouped_allreduce after hvd.join() hangs, with
# Compression.none too (not TernGrad's doing; seen while writing these tests).  adasum runs last: under Gloo
# Horovod refuses Adasum mid-step and leaves that step's other ops in flight.
TWO_RANK = ["unnamed_ops_mid_step", "sparse_as_dense", "sparse", "grouped_allreduce", "optimizer_groups_n", "optimizer_groups_list",
            "backward_passes_per_step", "synchronize_clip", "gan_two_optimizers", "params_without_grad",
            "optimizer_state_scheduler", "gradient_predivide_factor", "resume", "join", "adasum"]


def run_usage(folder, kind, np_, compressions, patterns):
    """Launch the worker once; {compression: {pattern: every rank's results}}."""
    args = [str(folder), ",".join(compressions)] + patterns
    if kind == "gloo":
        forked_ranks.run_scenarios("horovod", np_, WORKER, args, str(folder), timeout=LAUNCH_TIMEOUT)
        return _results(folder, np_, compressions, patterns)
    env = rank_env()
    cmd = launcher(kind, np_) + [sys.executable, WORKER] + args
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{kind} -np {np_} {compressions} hung for {LAUNCH_TIMEOUT}s:\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    return _results(folder, np_, compressions, patterns)


def _results(folder, np_, compressions, patterns):
    return {c: {pat: [torch.load(os.path.join(folder, f"{pat}.{c}.rank{r}.pt"), weights_only=False)
                      for r in range(np_)] for pat in patterns} for c in compressions}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launched lazily, once per launcher (Gloo: TernGrad and Compression.none; MPI: TernGrad):
    (launcher, compression) -> pattern -> every rank's results."""
    cache = {}

    def get(kind, compression):
        if kind not in cache:
            compressions = ["terngrad", "none"] if kind == "gloo" else ["terngrad"]
            cache[kind] = run_usage(tmp_path_factory.mktemp(kind), kind, 2, compressions, TWO_RANK)
        return cache[kind][compression]
    return get


def no_crash(ranks):
    for r, res in enumerate(ranks):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"


def same_params(ranks):
    for r in ranks[1:]:
        for a, b in zip(ranks[0]["params"], r["params"]):
            assert torch.equal(a, b)
            assert torch.isfinite(a).all()


# -- TernGrad: results -------------------------------------------------------------------------------------
def check_join(ranks):
    """Rank 0 ran two more steps; in those rank 1 was in hvd.join() and counted as a zero gradient."""
    a, b = ranks
    assert a["join"] == b["join"] and a["join"] in (0, 1)
    cfg = a["config"]
    ins = [by_name_and_step(r["inputs"]) for r in ranks]
    outs = by_name_and_step(a["outputs"])
    joined = 0
    for (name, step), got in outs.items():
        if step < b["steps"]:
            want, _ = expected_average([ins[0][(name, step)], ins[1][(name, step)]], name, step, cfg)
        else:
            want, _ = expected_average([ins[0][(name, step)]], name, step, cfg, ranks=[0], world=2)
            joined += 1
        assert torch.equal(got, want), (name, step)
    assert joined == 2 * len(a["names"])
    same_params(ranks)       # re-aligned by broadcast_parameters after join


def check_sparse(ranks):
    same_params(ranks)
    assert all(r["emb_moved"] for r in ranks)


def check_grouped(ranks):
    from horovod_terngrad import TernGradConfig
    cfg = TernGradConfig()
    for i in range(2):
        want, _ = expected_average([r["inputs"][f"g.{i}"] for r in ranks], f"g.{i}", 0, cfg)
        want_sum, _ = expected_average([r["inputs"][f"g.{i}"] for r in ranks], f"gs.{i}", 0, cfg, average=False)
        for r in ranks:
            assert torch.equal(r["grouped"][i], want) and torch.equal(r["grouped_sum"][i], want_sum)
    want, _ = expected_average([r["inputs"]["scaled"] for r in ranks], "scaled", 0, cfg)
    for r in ranks:
        assert torch.equal(r["scaled"], want * 3.0)          # prescale 2 x postscale 1.5
        for x, y in zip(r["unnamed_group"], ranks[0]["unnamed_group"]):
            assert torch.equal(x, y)


def check_resume(ranks):
    for r in ranks:
        assert r["ckpt_terngrad"]["steps"]["global"], "TernGrad's state_dict holds the step counters"
        for a, b in zip(r["straight"], r["resumed"]):
            assert torch.equal(a, b), "resumed run differs from the uninterrupted one"
        assert any(not torch.equal(a, b) for a, b in zip(r["straight"], r["forgot"])), \
            "without TernGrad's state the resumed run should draw other streams (the test would be vacuous)"


def check_unnamed_mid_step(ranks):
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert ranks[0]["losses"][1::2] == [2.0] * 4
    exact(ranks)


def check_adasum(ranks):
    for r in ranks:
        assert r["error"].startswith("TernGradError") and "Adasum" in r["error"] and "'" in r["error"]


def exact(ranks):
    assert check_exact(ranks) > 0


TERNGRAD_CHECKS = {
    "join": check_join, "sparse_as_dense": check_sparse, "sparse": check_sparse, "grouped_allreduce": check_grouped,
    "optimizer_groups_n": exact, "optimizer_groups_list": exact, "backward_passes_per_step": exact,
    "synchronize_clip": exact, "gan_two_optimizers": exact, "params_without_grad": exact,
    "optimizer_state_scheduler": exact, "gradient_predivide_factor": exact, "adasum": check_adasum,
    "resume": check_resume, "unnamed_ops_mid_step": check_unnamed_mid_step,
}


@pytest.mark.parametrize("kind", ["gloo", "mpi"])
@pytest.mark.parametrize("pattern", TWO_RANK)
def test_terngrad(runs, kind, pattern):
    ranks = runs(kind, "terngrad")[pattern]
    no_crash(ranks)
    TERNGRAD_CHECKS[pattern](ranks)


# -- Compression.none: the same patterns work (the parity the drop-in promise is about) ---------------------
@pytest.mark.parametrize("pattern", TWO_RANK)
def test_compression_none_baseline(runs, pattern):
    ranks = runs("gloo", "none")[pattern]
    no_crash(ranks)
    if pattern == "grouped_allreduce":
        for r in ranks:
            torch.testing.assert_close(r["scaled"], 3.0 * torch.stack([x["inputs"]["scaled"] for x in ranks]).mean(0))
    elif pattern == "resume":
        check_resume_none = all(torch.equal(a, b) for r in ranks for a, b in zip(r["straight"], r["resumed"]))
        assert check_resume_none
    elif pattern == "adasum":
        # works, or Horovod itself refuses: Gloo builds have no Adasum op ("No Adasum operation enabled").
        # A rank still in backward may instead see "Horovod has been shut down": the other rank got the
        # refusal, finished and shut Horovod down before this one enqueued its last gradient (reproduced
        # 2 times in 9 launches under load).  Either is Horovod's own HorovodInternalError; a crash is not.
        errors = [r["error"] for r in ranks]
        assert all(e is None or e.startswith("HorovodInternalError: ") for e in errors), errors
        if all(e is None for e in errors):
            same_params(ranks)
    else:
        same_params(ranks)
    if pattern == "join":
        assert ranks[0]["join"] == ranks[1]["join"]


@pytest.fixture(scope="module")
def process_sets_run(tmp_path_factory):
    return run_usage(tmp_path_factory.mktemp("sets"), "gloo", 4, ["terngrad", "none"], ["process_sets"])


@pytest.mark.parametrize("compression", ["terngrad", "none"])
def test_two_optimizers_on_disjoint_process_sets_gloo4(process_sets_run, compression):
    ranks = process_sets_run[compression]["process_sets"]
    no_crash(ranks)
    for members in ([0, 1], [2, 3]):
        group = [ranks[r] for r in members]
        assert all(r["set_ranks"] == members for r in group)
        assert [r["set_rank"] for r in group] == [0, 1]
        same_params(group)
        if compression == "terngrad":
            assert check_exact(group) > 0
    assert not torch.equal(ranks[0]["params"][0], ranks[2]["params"][0])     # two different models
