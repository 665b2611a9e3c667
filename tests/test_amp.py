"""Mixed precision on real ranks with TernGrad at its defaults: fp16 autocast with torch.amp.GradScaler in
each frontend's recipe, bf16 autocast, and fp16 / bf16 models.

Launches (one per world; each runs several scenarios, tests/workers/amp_hvd.py and amp_ddp.py, on forked ranks with
a launcher's environment: tests/support/forked_ranks.py):
  Horovod (Gloo), 2 ranks (twice: the second is the fresh process that resumes from the first's checkpoint),
  Horovod, 4 ranks as 2 emulated nodes of 2 (HOROVOD_TERNGRAD_HOST), hierarchical=True;
  DDP (gloo), 2 ranks, and 4 ranks as 2 emulated nodes of 2 (interleaved), hierarchical=True.

The fp16 runs start GradScaler at 1.5 * 2**24, so the first steps overflow on every rank, and later one rank alone
overflows three times (its loss times 2**20; +Inf in a ternarized gradient; NaN in a full-precision one;
tests/workers/amp_common.py).  TernGrad's default on_nonfinite="propagate" makes the affected average NaN on every rank,
so GradScaler must skip exactly the steps it skips with Horovod's Compression.none / DDP's own allreduce, run in the
same launch on the same data from the same initial model.
"""
import os
import sys

import pytest
import torch

from support import forked_ranks
from test_horovod import load_results

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, "workers"))            # amp_common: the schedule the workers run
from amp_common import INIT_SCALE, SMALL_NAN_STEP, SPIKE_STEP, STEPS, TERN_INF_STEP  # noqa: E402

pytestmark = pytest.mark.slow       # every test here launches ranks

HVD_WORKER = os.path.join(HERE, "workers", "amp_hvd.py")
DDP_WORKER = os.path.join(HERE, "workers", "amp_ddp.py")
INJECTED = [SPIKE_STEP, TERN_INF_STEP, SMALL_NAN_STEP]
PLAIN = ["bf16_autocast", "half_static", "bf16_params"]


def launch_hvd(folder, np_, hosts, scenarios):
    forked_ranks.run_scenarios("horovod", np_, HVD_WORKER, [str(folder), hosts] + scenarios, str(folder))
    return {sc: load_results(folder, sc, np_) for sc in scenarios}


def launch_ddp(folder, np_, hosts, scenarios):
    forked_ranks.run_scenarios("torch", np_, DDP_WORKER, [str(folder), hosts] + scenarios, str(folder))
    return {sc: load_results(folder, sc, np_) for sc in scenarios}


@pytest.fixture(scope="module")
def hvd2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("amp_hvd2")
    res = launch_hvd(folder, 2, "-", ["fp16_none", "fp16_terngrad", "fp16_terngrad_min0", "fp16_terngrad_rq",
                                      "resume_save"])
    assert (folder / "resume.ckpt").exists()
    res.update(launch_hvd(folder, 2, "-", ["resume_load"] + PLAIN))     # a fresh process resumes
    return res


@pytest.fixture(scope="module")
def hvd4(tmp_path_factory):
    return launch_hvd(tmp_path_factory.mktemp("amp_hvd4"), 4, "h0,h0,h1,h1", ["fp16_none", "fp16_terngrad_hier"])


@pytest.fixture(scope="module")
def ddp2(tmp_path_factory):
    return launch_ddp(tmp_path_factory.mktemp("amp_ddp2"), 2, "-",
                      ["fp16_none", "fp16_terngrad", "fp16_terngrad_min0", "fp16_terngrad_rq"] + PLAIN)


@pytest.fixture(scope="module")
def ddp4(tmp_path_factory):
    return launch_ddp(tmp_path_factory.mktemp("amp_ddp4"), 4, "h0,h1,h0,h1", ["fp16_none", "fp16_terngrad_hier"])


def same_on_every_rank(ranks, what):
    """Parameters bit-identical and the per-step record (skips, scales, finiteness) alike on every rank."""
    for r, res in enumerate(ranks[1:], 1):
        for key in ("skipped", "scale", "finite"):
            assert res[key] == ranks[0][key], (what, key, r, res[key], ranks[0][key])
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], res["params"])), (what, r)
    assert all(torch.isfinite(p).all() for p in ranks[0]["params"]), what


def loss_went_down(res, what):
    taken = [loss for loss, skipped in zip(res["loss"], res["skipped"]) if not skipped]
    assert len(taken) >= 6, (what, res["skipped"])
    assert all(torch.isfinite(torch.tensor(res["loss"]))), (what, res["loss"])
    first, last = sum(taken[:3]) / 3, sum(res["loss"][-3:]) / 3
    assert last < first, (what, res["loss"])


def check_scaler_schedule(res, what):
    """What GradScaler must do here, whatever the exchange: a step is skipped exactly when its averaged gradients
    hold Inf/NaN (no parameter changed); the first steps overflow and back off by 1/2 each until the scale fits;
    afterwards only the injected steps are skipped (growth_interval 2000: the scale never grows)."""
    skipped, scale = res["skipped"], res["scale"]
    diag = f"{what}: skipped {skipped}, scale {scale}, max scaled grad / fp16 max " \
           f"{[round(m / 65504, 3) for m in res['max_grad']]}"
    assert len(skipped) == STEPS
    assert skipped == [not f for f in res["finite"]], diag
    first_taken = skipped.index(False)
    assert first_taken >= 2, diag                                  # the initial scale overflowed, more than once
    assert [s for s in range(STEPS) if skipped[s]] == list(range(first_taken)) + INJECTED, diag
    backoffs = 0
    for s in range(STEPS):
        backoffs += skipped[s]
        assert scale[s] == INIT_SCALE * 0.5 ** backoffs, diag


def check_fp16(ranks, baseline, hierarchical, nodes=None, min_numel_zero=False):
    what = "TernGrad"
    same_on_every_rank(ranks, what)
    same_on_every_rank(baseline, "baseline")
    for r, (tg, base) in enumerate(zip(ranks, baseline)):
        check_scaler_schedule(base, f"baseline rank {r}")
        check_scaler_schedule(tg, f"TernGrad rank {r}")
        # the same steps skipped and the same loss scale after every step as without compression
        assert tg["skipped"] == base["skipped"] and tg["scale"] == base["scale"], (r, tg["skipped"], base["skipped"])
        assert all(tg["skipped"][s] for s in INJECTED)             # one rank's overflow: skipped on every rank
        loss_went_down(tg, f"{what} rank {r}")
        loss_went_down(base, f"baseline rank {r}")
        # TernGrad did run: it ternarized (other parameters than the baseline's), and the NaN/Inf propagated
        assert tg["terngrad"] and not base["terngrad"]
        assert tg["stats"]["elements"] > 0 and tg["stats"]["nonfinite_propagated"] > 0, tg["stats"]
        assert (tg["uncompressed"] == 0) if min_numel_zero else (tg["uncompressed"] > 0)
        assert tg["config"].on_nonfinite == "propagate"
        assert tg["hierarchical"] == hierarchical and tg["nodes"] == nodes
    assert not all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], baseline[0]["params"]))


CASES = {
    "horovod-2": ("hvd2", "fp16_terngrad", False, None, False),
    "horovod-2-min_numel0": ("hvd2", "fp16_terngrad_min0", False, None, True),
    "horovod-2x2-nodes": ("hvd4", "fp16_terngrad_hier", True, [[0, 1], [2, 3]], False),
    "horovod-2-requantized": ("hvd2", "fp16_terngrad_rq", False, None, False),
    "ddp-2": ("ddp2", "fp16_terngrad", False, None, False),
    "ddp-2-min_numel0": ("ddp2", "fp16_terngrad_min0", False, None, True),
    "ddp-2x2-nodes": ("ddp4", "fp16_terngrad_hier", True, [[0, 2], [1, 3]], False),
    "ddp-2-requantized": ("ddp2", "fp16_terngrad_rq", False, None, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp16_gradscaler_skips_the_steps_fp32_exchange_skips(request, case):
    """fp16 autocast + GradScaler in the frontend's recipe, TernGrad at its defaults (the node-aware exchange
    forced on for 2 nodes x 2): the skipped steps and the loss scale after every step are those of the
    uncompressed run, the single-rank overflows are skipped on every rank, the ranks end bit-identical and the
    loss went down."""
    fixture, scenario, hierarchical, nodes, min0 = CASES[case]
    res = request.getfixturevalue(fixture)
    check_fp16(res[scenario], res["fp16_none"], hierarchical, nodes, min0)


def test_checkpoint_resume_across_skipped_steps_is_bit_identical(hvd2):
    """Steps 0..7 (5 skipped), rank 0 saves model, optimizer, GradScaler and compressor.state_dict(), steps 8..15
    (3 skipped) go on; a fresh process loads the checkpoint on every rank and runs steps 8..15: the same
    parameters bit for bit, the same skips, scales and losses."""
    for r, (saved, loaded) in enumerate(zip(hvd2["resume_save"], hvd2["resume_load"])):
        first, whole, resumed = saved["first"], saved["rest"], loaded["rest"]
        assert sum(first["skipped"]) >= 2 and not all(first["skipped"]), first["skipped"]
        assert sum(whole["skipped"]) == 3 and whole["steps"] == resumed["steps"] == list(range(8, STEPS))
        assert loaded["loaded_scale"] == first["scale"][-1] < INIT_SCALE
        for key in ("skipped", "scale", "finite", "loss"):
            assert resumed[key] == whole[key], (r, key, resumed[key], whole[key])
        assert all(torch.equal(a, b) for a, b in zip(whole["params"], resumed["params"])), r
        assert saved["stats"]["elements"] > 0 and loaded["stats"]["elements"] > 0
    same_on_every_rank([x["rest"] for x in hvd2["resume_load"]], "resumed")


DTYPES = {"bf16_autocast": "torch.float32", "half_static": "torch.float16", "bf16_params": "torch.bfloat16"}


@pytest.mark.parametrize("frontend", ["hvd2", "ddp2"])
@pytest.mark.parametrize("kind", PLAIN)
def test_bf16_autocast_and_low_precision_models_train(request, frontend, kind):
    """No GradScaler: bf16 autocast (fp32 parameters), a .half() model with a static loss scale of 128, a bfloat16
    model; TernGrad at its defaults on 2 ranks: every step taken, gradients in the parameters' dtype, ranks
    bit-identical, loss finite and going down."""
    ranks = request.getfixturevalue(frontend)[kind]
    same_on_every_rank(ranks, kind)
    for r, res in enumerate(ranks):
        assert not any(res["skipped"]) and all(res["finite"]), (r, res["skipped"])
        assert res["grad_dtypes"] == [DTYPES[kind]] and all(str(p.dtype) == DTYPES[kind] for p in res["params"])
        loss_went_down(res, f"{kind} rank {r}")
        assert res["loss"][-1] < 0.8 * res["loss"][0], res["loss"]
        assert res["stats"]["elements"] > 0 and res["uncompressed"] > 0 and res["config"].min_numel == 4096
