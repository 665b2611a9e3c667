"""FSDP2 / HSDP with TernGrad between replicas, on real processes: gloo, a (2, 2) mesh and a (3, 2) mesh
(tests/workers/fsdp_scenarios.py runs the training on forked ranks with torchrun's environment,
tests/support/forked_ranks.py; this file checks it), and a killed rank under torchrun itself.

The reference is independent of the frontend and of FSDP's internals: each unit's flat shard is laid out again
from the parameters' full shapes alone (FSDP's torch.chunk rows, ceil(dim0 / S) per shard, zero padding), and
every parameter's shard is averaged across its replicas by tests/helpers.expected_average (the reference
codec), with the stream keyed by the replica's global rank and the unit's call count.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import expected_exchange
from support import forked_ranks
from test_ddp import load
from test_horovod import LAUNCH_TIMEOUT, rank_env

pytestmark = pytest.mark.slow       # every test here launches ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "fsdp_scenarios.py")
EXACT = ["exact", "exact_sharded", "exact_reternarized", "exact_requantized", "exact_bf16", "exact_bf16p", "accum", "frozen_unused", "compile", "buckets"]


def launch(out, nproc, replicas, scenarios):
    forked_ranks.run_scenarios("torch", nproc, WORKER, [str(out), str(replicas)] + scenarios, str(out))


@pytest.fixture(scope="module")
def mesh22(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp22")
    scenarios = EXACT + ["resume", "amp", "nan_propagate", "nan_zero", "raise", "fallback"]
    launch(out, 4, 2, scenarios)
    return {sc: load(out, sc, 4) for sc in scenarios}


@pytest.fixture(scope="module")
def mesh32(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp32")
    scenarios = ["exact", "resume"]
    launch(out, 6, 3, scenarios)
    return {sc: load(out, sc, 6) for sc in scenarios}


def replica_groups(ranks):
    """Global ranks grouped by shard index (the replicate groups), each in ascending rank order."""
    groups = {}
    for res in ranks:
        groups.setdefault(res["coords"][1], []).append(res["rank"])
    return {s: sorted(g) for s, g in groups.items()}


def layout(params, S, s):
    """(fqn, offset, real numel) of each parameter with a gradient in shard ``s`` of a unit's flat shard."""
    out, off = [], 0
    for fqn, shape, requires_grad in params:
        if not requires_grad:
            continue
        rows = math.ceil(shape[0] / S)
        rest = math.prod(shape[1:])
        real = max(0, min(rows, shape[0] - s * rows)) * rest
        out.append((fqn, off, real))
        off += rows * rest
    return out, off


def check_exact(ranks, skipped_units=()):
    """Every hook call of every rank against the reference; returns how many elements were checked."""
    cfg = ranks[0]["config"]
    R = ranks[0]["replicas"]
    S = ranks[0]["size"] // R
    checked = 0
    for s, group in replica_groups(ranks).items():
        calls = [ranks[r]["calls"] for r in group]
        assert len({len(c) for c in calls}) == 1, "replicas made different numbers of hook calls"
        counts = {}
        for k in range(len(calls[0])):
            unit = calls[0][k][0]
            assert all(c[k][0] == unit for c in calls), "replicas called the hook for different units"
            step = counts.get(unit, 0)
            counts[unit] = step + 1
            members, total = layout(ranks[0]["units"][unit], S, s)
            unit_cfg = cfg
            if ranks[group[0]]["layout"][unit] == "buckets":      # the whole flat shard, one scaler per 65536
                members = [(f"{unit}.shard" if unit else "shard", 0, total)]
                unit_cfg = cfg.replace(bucket_size=cfg.bucket_size or 65536)
            inputs = [c[k][1] for c in calls]
            outputs = [c[k][2] for c in calls]
            assert all(i.numel() == total for i in inputs), (unit, total, [i.numel() for i in inputs])
            for o in outputs[1:]:
                assert torch.equal(o, outputs[0]), f"replicas of shard {s} differ after unit '{unit}'"
            for fqn, off, n in members:
                if n == 0:
                    continue
                segs = [i[off:off + n] for i in inputs]
                got = outputs[0][off:off + n]
                if cfg.compresses(fqn, n):
                    want = expected_exchange(segs, fqn, step, unit_cfg, ranks=group)
                    assert torch.equal(got, want), f"{fqn} (shard {s}, step {step}) differs from the reference"
                else:
                    want = (sum(x.float() for x in segs) / R).to(got.dtype)
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
                checked += n
    return checked


@pytest.mark.parametrize("scenario", EXACT)
def test_every_shard_is_averaged_across_replicas_bit_for_bit_as_the_reference(mesh22, scenario):
    ranks = mesh22[scenario]
    assert check_exact(ranks) > 0
    layouts = {v for res in ranks for v in res["layout"].values()}
    assert layouts == ({"buckets"} if scenario == "buckets" else {"params"})
    # TernGrad ternarized the large shards (not everything fell back to full precision)
    assert all(res["stats"]["tensors"] > 0 and res["stats"]["payload_bytes_sent"] > 0 for res in ranks)


def test_bf16_shards_are_averaged_in_bf16(mesh22):
    calls = mesh22["exact_bf16"][0]["calls"]
    assert {c[1].dtype for c in calls} == {torch.bfloat16}
    assert {c[1].dtype for c in mesh22["exact_bf16p"][0]["calls"]} == {torch.float32}


def test_every_replica_of_every_shard_is_identical_after_training(mesh22, mesh32):
    for ranks in [mesh22[sc] for sc in EXACT] + [mesh32["exact"]]:
        for group in replica_groups(ranks).values():
            first = ranks[group[0]]["shards"]
            for r in group[1:]:
                for name, t in ranks[r]["shards"].items():
                    assert torch.equal(t, first[name]), f"rank {r}'s shard of {name} differs from rank {group[0]}'s"


def test_three_replicas_of_two_shards_are_exact(mesh32):
    ranks = mesh32["exact"]
    assert {len(g) for g in replica_groups(ranks).values()} == {3}
    assert check_exact(ranks) > 0


def test_uneven_first_dimensions_and_an_empty_shard(mesh22):
    ranks = mesh22["exact"]
    by_shard = {res["coords"][1]: res["shards"] for res in ranks}
    assert by_shard[0]["emb.weight"].shape[0] == 19 and by_shard[1]["emb.weight"].shape[0] == 18
    assert by_shard[0]["gain"].numel() == 80 and by_shard[1]["gain"].numel() == 0
    assert by_shard[0]["blocks.0.up.weight"].shape[0] == 24 and by_shard[1]["blocks.0.up.weight"].shape[0] == 23


def test_accumulation_and_units_without_gradients(mesh22):
    # accumulation: one reduction per unit per step (the micro-batch without sync calls no hook)
    assert all(v == 3 for v in mesh22["accum"][0]["unit_steps"].values())
    # block 2 ran in steps 0 and 2 only; a frozen weight is left out of its unit's shard
    steps = mesh22["frozen_unused"][0]["unit_steps"]
    assert steps["blocks.2"] == 2 and steps["blocks.1"] == 3


def test_resume_through_dcp_is_bit_identical(mesh22, mesh32):
    for ranks in (mesh22["resume"], mesh32["resume"]):
        for res in ranks:
            assert res["saved_steps"] and res["restored_steps"] == res["saved_steps"]
            for name, t in res["straight"].items():
                assert torch.equal(res["resumed"][name], t), f"rank {res['rank']}: {name} differs after resuming"


def test_gradscaler_skips_the_steps_native_hsdp_skips(mesh22):
    ranks = mesh22["amp"]
    for res in ranks:
        assert res["terngrad"]["skipped"] == res["native"]["skipped"], f"rank {res['rank']}"
        assert res["terngrad"]["scales"] == res["native"]["scales"]
        assert {4, 7} <= set(res["native"]["skipped"])
        assert all(math.isfinite(x) for x in res["terngrad"]["shards"]["head.weight"].flatten().tolist())
    assert len({tuple(res["terngrad"]["skipped"]) for res in ranks}) == 1


@pytest.mark.parametrize("policy", ["propagate", "zero"])
def test_nan_on_one_rank(mesh22, policy):
    ranks = mesh22[f"nan_{policy}"]
    for res in ranks:
        native = {n: ok for n, (ok, _) in res["native"].items()}
        tern = {n: ok for n, (ok, _) in res["terngrad"].items()}
        assert not all(native.values()), "the poisoned activation made no gradient NaN"
        if policy == "propagate":
            assert tern == native, f"rank {res['rank']}: NaN reaches other shards than native HSDP's"
        else:
            assert all(tern.values())
            for n, ok in native.items():
                if not ok and ranks[0]["terngrad"][n][1].numel() >= 64:    # ternarized and zeroed
                    assert not res["terngrad"][n][1].any(), n
    for group in replica_groups(ranks).values():
        for name in ranks[group[0]]["terngrad"]:
            grads = [ranks[r]["terngrad"][name][1] for r in group]
            assert all(torch.equal(g.nan_to_num(7.0), grads[0].nan_to_num(7.0)) for g in grads)


def test_raise_is_refused_with_a_reason(mesh22):
    for res in mesh22["raise"]:
        assert res["refused"] and "propagate" in res["refused"]


def test_one_dimensional_mesh_runs_fsdps_own_path_and_says_so_once(mesh22):
    for res in mesh22["fallback"]:
        assert not res["active"] and not res["active2"] and res["hooked"] == 0
        said = [m for m in res["records"] if "FSDP's own path" in m]
        assert len(said) == (1 if res["rank"] == 0 else 0), said


def test_a_killed_rank_ends_the_job_with_an_error(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", WORKER,
           str(tmp_path), "2", "kill"]
    try:
        p = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the job hung for {LAUNCH_TIMEOUT}s after a rank died:\n{e.stdout}\n{e.stderr}")
    assert p.returncode != 0
    assert "exitcode  : 3" in p.stderr or "exit code 3" in p.stderr or "exitcode: 3" in p.stderr, p.stderr[-3000:]
