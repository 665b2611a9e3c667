"""OwnerStepOptimizer on real ranks (tests/workers/owner_step_ranks.py, on forked ranks with a launcher's
environment: tests/support/forked_ranks.py): three ranks of torch.distributed (the model in DDP with
local_gradients_hook) and three of Horovod (no DDP): every rank holds the same weights after every step, both
frontends give the same bits, a run resumed from torch.save'd state dicts continues bit for bit, the bits
received are the codec's sizes, and fp16 autocast with GradScaler skips the same steps and moves the same scale on
every rank when one rank alone overflows."""
import os
import sys

import pytest

from support import forked_ranks
from test_ddp import load

from horovod_terngrad.codec import sizes

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "owner_step_ranks.py")
sys.path.append(os.path.dirname(WORKER))         # owner_step_ranks: the schedule the workers run
NP = 3
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def torch3(tmp_path_factory):
    out = tmp_path_factory.mktemp("owner_torch")
    forked_ranks.run_scenarios("torch", NP, WORKER, [str(out), "torch", "train", "resume", "amp"], str(out))
    return {sc: load(out, sc, NP) for sc in ("train", "resume", "amp")}


@pytest.fixture(scope="module")
def hvd3(tmp_path_factory):
    out = tmp_path_factory.mktemp("owner_hvd")
    forked_ranks.run_scenarios("horovod", NP, WORKER, [str(out), "horovod", "train", "amp"], str(out))
    return {sc: load(out, sc, NP) for sc in ("train", "amp")}


def test_every_rank_holds_the_same_weights_after_every_step(torch3, hvd3):
    for runs in (torch3["train"], hvd3["train"]):
        assert all(r["finite"] for r in runs)
        assert all(r["sums"] == runs[0]["sums"] for r in runs)
        assert all(r["norm"] == runs[0]["norm"] for r in runs)       # the clip's norm: one sum in rank order
        assert len(set(runs[0]["sums"])) == len(runs[0]["sums"])     # the weights move every step


def test_horovod_and_torch_distributed_give_the_same_bits(torch3, hvd3):
    assert hvd3["train"][0]["sums"] == torch3["train"][0]["sums"]


def test_resumed_run_continues_bit_for_bit(torch3):
    for r in torch3["resume"]:
        assert r["resumed"] == r["whole"][len(r["whole"]) // 2:]
    assert torch3["resume"][0]["whole"] == torch3["train"][0]["sums"]     # DDP with the hook changes nothing


def test_bits_received_are_the_codec_sizes(torch3):
    # the worker's two ternarized weights (32x96 and 96x48), base-3, with the squares trailer, 3 ranks
    for rank, res in enumerate(torch3["train"]):
        got = 0
        for n in (32 * 96, 96 * 48):
            grad = sizes.reternarized_chunk_bytes(n, NP, "base3", 0, True)
            weights = sizes.owner_step_weight_chunk_bytes(n, NP, "base3")
            got += (NP - 1) * grad[rank] + sum(weights) - weights[rank]
        assert res["bits"] == pytest.approx(8 * got / (32 * 96 + 96 * 48))


def test_fp16_gradscaler_skips_alike_on_every_rank_when_one_rank_overflows(torch3, hvd3):
    from owner_step_ranks import AMP_SPIKE, STEPS
    for runs in (torch3["amp"], hvd3["amp"]):
        assert all(r["finite"] for r in runs)
        assert all(r["sums"] == runs[0]["sums"] and r["scales"] == runs[0]["scales"] for r in runs)
        skipped = runs[0]["skipped"]
        assert 1 <= skipped < STEPS and all(r["skipped"] == skipped for r in runs)
        # rank 1's spike: every rank's scaler backed off at that step and the weights stayed put there
        assert runs[0]["scales"][AMP_SPIKE] < runs[0]["scales"][AMP_SPIKE - 1]
        assert runs[0]["sums"][AMP_SPIKE] == runs[0]["sums"][AMP_SPIKE - 1]
    assert hvd3["amp"][0]["sums"] == torch3["amp"][0]["sums"]
