"""The DDP frontend (frontends/ddp.py) and its collectives (exchange/dist_collectives.py) under real ranks:
2 processes, gloo, forked with torchrun's environment (tests/support/forked_ranks.py; one launch runs every
scenario of tests/workers/ddp_scenarios.py; a launch that hangs fails after LAUNCH_TIMEOUT), and the DDP example
under ``python -m torch.distributed.run`` itself.

The averages DDP leaves in ``p.grad`` are checked bit for bit against an independent recomputation
(tests/helpers.expected_average) from the gradients every rank handed the hook, and against the Horovod
frontend's own results for the same model, data and settings (tests/workers/hvd_scenarios.py on Horovod's
Gloo).
"""
import os
import subprocess
import sys

import pytest
import torch

from helpers import expected_average, expected_exchange
from support import forked_ranks
from test_horovod import BIN, HERE, by_name_and_step, rank_env

WORKER = os.path.join(HERE, "workers", "ddp_scenarios.py")
HVD_WORKER = os.path.join(HERE, "workers", "hvd_scenarios.py")
LAUNCH_TIMEOUT = 300
NP = 2

EXACT = ["shared_allgather_2bit", "shared_allgather_2bit_sync", "sync_on_ddps_group", "shared_sharded_base3", "shared_sharded_2bit_buckets",
         "per_rank_allgather_2bit", "per_rank_allgather_base3_buckets", "reternarized_2bit", "requantized_2bit",
         "small_fusion_groups", "ramped_groups",
         "auto_exchange",
         "exclude_min_numel", "worker_restarts",
         "no_sync_accumulate", "static_graph", "bucket_view", "find_unused", "fp16", "bf16", "compiled"]
TWINS = {"twin_exact": "exact", "twin_exact_sharded": "exact_sharded", "twin_exact_base3_buckets": "exact_base3_buckets",
         "twin_exact_per_rank_bpps2": "exact_per_rank_bpps2"}
OTHER = ["join_uneven", "join_uneven_sharded", "collectives", "nan_raise", "nan_raise_per_rank", "nan_zero", "nan_then_continue", "fp_inf_raise", "fp_inf_zero", "resume", "register",
         "sparse", "mismatch", "auto_off"]


def run_launch(cmd, what):
    try:
        p = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what} hung for {LAUNCH_TIMEOUT}s:\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"


def load(folder, scenario, nproc=NP):
    """Every rank's saved record of a scenario, checked for a crash and for the world size."""
    ranks = [torch.load(os.path.join(folder, f"{scenario}.rank{r}.pt"), weights_only=False) for r in range(nproc)]
    for r, res in enumerate(ranks):
        assert "crash" not in res, f"{scenario} rank {r}:\n{res['crash']}"
        assert res["size"] == nproc
    return ranks


# a test that uses one of these launches (module fixtures) is slow (conftest.py)
SLOW_FIXTURES = ("ddp2", "hvd2")


@pytest.fixture(scope="module")
def ddp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp2")
    scenarios = EXACT + list(TWINS) + OTHER
    forked_ranks.run_scenarios("torch", NP, WORKER, [str(out)] + scenarios, str(out))
    return {sc: load(out, sc) for sc in scenarios}


@pytest.fixture(scope="module")
def hvd2(tmp_path_factory):
    """The Horovod frontend's runs of the same training (hvd_scenarios.py, Gloo, 2 ranks)."""
    out = tmp_path_factory.mktemp("hvd2")
    scenarios = sorted(set(TWINS.values()))
    forked_ranks.run_scenarios("horovod", NP, HVD_WORKER, [str(out)] + scenarios, str(out))
    return {sc: load(out, sc) for sc in scenarios}


def check_exact(ranks):
    """Every average DDP left in p.grad equals expected_average of what the ranks handed the hook; parameters
    the policy keeps at full precision equal the plain mean; the models stay identical on every rank.
    Returns the number of (parameter, step) averages checked bit for bit."""
    cfg = ranks[0]["config"]
    inputs = [by_name_and_step(r["inputs"]) for r in ranks]
    outputs = [by_name_and_step(r["outputs"]) for r in ranks]
    assert set(inputs[0]) == set(inputs[1])
    checked = 0
    for (name, step) in sorted(inputs[0]):
        grads = [inputs[r][(name, step)] for r in range(NP)]
        present = [outputs[r].get((name, step)) for r in range(NP)]
        if present[0] is None:           # a parameter no rank used: DDP leaves its .grad as None
            assert all(p is None for p in present) and all(not g.any() for g in grads), name
            continue
        if cfg.compresses(name, grads[0].numel()):
            want = expected_exchange(grads, name, step, cfg)
            for r in range(NP):
                assert present[r].dtype == grads[r].dtype
                assert torch.equal(present[r], want), f"{name} step {step} rank {r}"
            checked += 1
        else:
            mean = torch.stack([g.float() for g in grads]).sum(0) / NP
            for r in range(NP):
                torch.testing.assert_close(present[r].float(), mean)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
    return checked


# -- the collectives ------------------------------------------------------------------------------------------
def test_dist_collectives_max_sum_unequal_allgather_uneven_alltoall_and_errors(ddp2):
    r0, r1 = ddp2["collectives"]
    for res in (r0, r1):
        ex = res["exchanged"]       # default: lengths / splits exchanged first, so they may differ by rank
        assert ex["max"].tolist() == [2.5, 0.0, 7.0] and ex["sum"].tolist() == [2, 1, 6]
        assert ex["gather"].tolist() == [0, 1, 2] + [50 + i for i in range(7)]
        assert ex["empty"].numel() == 0 and ex["polled"]
        eq = res["equal"]
        assert eq["gather"].tolist() == [0, 1, 2, 3, 4, 50, 51, 52, 53, 54]
        # the error: wrapped as a CollectiveError, torch's error kept as the cause
        name, is_dist_error, cause, msg = res["error"]
        assert is_dist_error and cause == "ValueError" and "complex" in msg and "'bad'" in msg
    # rank r sent (r + 1) * (j + 1) bytes of value 10 r + j to rank j: rank j gets them in sender order
    assert r0["exchanged"]["a2a"].tolist() == [0, 10, 10]
    assert r1["exchanged"]["a2a"].tolist() == [1, 1, 11, 11, 11, 11]
    assert r0["equal"]["a2a"].tolist() == [0, 10] and r1["equal"]["a2a"].tolist() == [1, 1, 11, 11]


# -- bit identity --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sc", EXACT)
def test_ddp_averages_are_bit_identical_to_the_reference(ddp2, sc):
    ranks = ddp2[sc]
    checked = check_exact(ranks)
    names = ranks[0]["names"]
    if sc == "exclude_min_numel":      # 'head.*' excluded, small tensors kept in full precision
        assert 0 < checked < 3 * len(names) and ranks[0]["stats"]["tensors"] == checked
    elif sc in ("find_unused", "sync_on_ddps_group"):   # 'dead.*' is used by no rank: not checked
        assert checked == 3 * (len(names) - 2)
    else:
        assert checked == 3 * len(names)
    assert sorted(ranks[0]["steps"].values()) == sorted(ranks[1]["steps"].values())


def test_ramped_groups_take_more_collectives_and_give_the_unramped_averages_bit_for_bit(ddp2):
    """Each bucket cut into groups of 8, 16, 32, ... elements (ddp_bucket.RAMP_NUMEL) sends more, smaller
    payloads than the same settings cut at fusion_numel alone, and every average is the same bits."""
    ramped, plain = ddp2["ramped_groups"], ddp2["per_rank_allgather_2bit"]
    assert ramped[0]["stats"]["collectives"] > plain[0]["stats"]["collectives"]
    for a, b in zip(ramped, plain):
        got, want = by_name_and_step(a["outputs"]), by_name_and_step(b["outputs"])
        assert set(got) == set(want)
        for key in want:
            assert torch.equal(got[key], want[key]), key


def test_ramp_cut_doubles_each_group_up_to_fusion_numel():
    from horovod_terngrad.config import TernGradConfig
    from horovod_terngrad.exchange.fusion import TensorSpec, cut
    specs = [TensorSpec(str(i), 100) for i in range(40)]
    cfg = TernGradConfig(min_numel=0, fusion_numel=1000)
    sizes = [sum(100 for _ in g) for g in cut(specs, cfg, ramp_numel=200).groups]
    assert sizes == [200, 400, 800, 1000, 1000, 600]
    assert cut(specs, cfg, ramp_numel=5000).groups == cut(specs, cfg).groups     # a ramp above the limit: no change
    off = TernGradConfig(min_numel=0, fusion_numel=0)
    assert cut(specs, off, ramp_numel=200).groups == tuple((str(i),) for i in range(40))


def test_auto_measures_the_link_and_sends_full_precision_where_ternarizing_does_not_pay(ddp2):
    """exchange="auto" over torch.distributed: the link is measured and agreed (identical on both ranks);
    with a codec slower than the bytes it saves every bucket is one plain allreduce (exact means)."""
    on, off = ddp2["auto_exchange"], ddp2["auto_off"]
    for ranks, pays in ((on, True), (off, False)):
        assert ranks[0]["link"] == ranks[1]["link"] and ranks[0]["link"][0] == 2 and ranks[0]["link"][2] is pays
    for r in off:
        assert r["stats"]["tensors"] == 0 and r["stats"]["collectives"] == 0
    ins = [by_name_and_step(r["inputs"]) for r in off]
    for key, got in by_name_and_step(off[0]["outputs"]).items():
        torch.testing.assert_close(got, (ins[0][key] + ins[1][key]) / 2)


def test_ddp_averages_are_bit_identical_to_the_horovod_frontends(ddp2, hvd2):
    """Same model, data, seed and settings through the Horovod frontend and through DDP's hook:
    every per-step average and the trained parameters agree bit for bit, on every rank."""
    for twin, hvd_sc in TWINS.items():
        d, h = ddp2[twin], hvd2[hvd_sc]
        assert d[0]["config"] == h[0]["config"], twin
        assert check_exact(d) == 3 * len(d[0]["names"])
        for r in range(NP):
            d_out, h_out = by_name_and_step(d[r]["outputs"]), by_name_and_step(h[r]["outputs"])
            assert set(d_out) == set(h_out) and len(d_out) == 3 * len(d[0]["names"]), twin
            for key in d_out:
                assert torch.equal(d_out[key], h_out[key]), f"{twin} {key} rank {r}"
            for a, b in zip(d[r]["params"], h[r]["params"]):
                assert torch.equal(a, b), twin


def test_the_asynchronous_hook_returns_before_the_exchange_is_done(ddp2):
    """asynchronous=True: a bucket's future completes only after the hook was handed the next bucket (the
    worker finishes bucket i after starting i+1), so the hook returns while the exchange is under way and
    backward goes on; asynchronous=False: the hook returns a completed future."""
    for done in (r["done_at_return"] for r in ddp2["shared_allgather_2bit"]):
        assert len(done) >= 7 and not any(d for last, d in done if not last)
    for done in (r["done_at_return"] for r in ddp2["shared_allgather_2bit_sync"]):
        assert all(d for _, d in done)


def test_the_worker_thread_ends_when_idle_and_a_new_one_finishes_the_bucket_in_flight(ddp2):
    """worker_restarts: backward pauses 0.2 s between two buckets while the worker ends after 0.02 s idle, with
    the earlier bucket still in flight; the next bucket starts a new worker, which finishes it (averages
    exact, checked above).  Iteration 0 has one bucket (no pause between buckets); iterations 1 and 2 each
    end a worker in the pause: at least 3 workers."""
    for res in ddp2["worker_restarts"]:
        assert res["workers"] >= 3


def test_the_worker_thread_is_stopped_at_interpreter_exit(ddp2):
    """The atexit handler ends a running worker thread (the state leaves the running set), so no daemon
    thread is left for the interpreter's finalization to kill (that can abort a rank at exit)."""
    for res in ddp2["shared_allgather_2bit"]:
        assert res["running_before_exit"] == (True, True)
        assert res["running_after_exit"] == (False, False, False)
    for res in ddp2["shared_allgather_2bit_sync"]:     # asynchronous=False: no thread at all
        assert res["running_before_exit"] == (False, False)


def test_sync_and_async_hooks_give_the_same_bits(ddp2):
    a, s = ddp2["shared_allgather_2bit"], ddp2["shared_allgather_2bit_sync"]
    for r in range(NP):
        for x, y in zip(a[r]["params"], s[r]["params"]):
            assert torch.equal(x, y)


# -- DDP features ---------------------------------------------------------------------------------------------
def test_buckets_are_rebuilt_after_the_first_iteration_and_keyed_by_name(ddp2):
    """DDP rebuilds its buckets in the order gradients became ready, after iteration 0 (after iteration 1 with
    static_graph=True).  torch 2.13 on CPU starts with every parameter in one bucket, in registration order;
    bucket_cap_mb=0.002 then gives 3 buckets, bucket 0 holding other parameters than before.  The averages
    stay exact (checked above): nothing is keyed on the bucket index."""
    for sc in ("shared_allgather_2bit", "static_graph", "bucket_view"):
        buckets = ddp2[sc][0]["buckets"]
        first = [names for it, _, names in buckets if it == 0]
        last = [names for it, _, names in buckets if it == 2]
        assert len(first) >= 1 and len(last) >= 3, sc
        assert first[0] != last[0], sc
        assert sorted(sum(first, [])) == sorted(sum(last, [])), sc
        rebuilt_after = 1 if sc == "static_graph" else 0
        assert [names for it, _, names in buckets if it == rebuilt_after + 1] == last, sc


def test_no_sync_accumulates_locally_then_exchanges_once(ddp2):
    ranks = ddp2["no_sync_accumulate"]
    names = ranks[0]["names"]
    assert len(ranks[0]["inputs"]) == 3 * len(names)           # one exchange per step, of the accumulated sum
    assert all(v == 3 for v in ranks[0]["steps"].values())


def test_find_unused_parameters_locally_unused_count_as_zeros(ddp2):
    ranks = ddp2["find_unused"]
    r1_inputs = by_name_and_step(ranks[1]["inputs"])
    assert not r1_inputs[("extra.weight", 0)].any()           # rank 1 did not use 'extra'
    assert ranks[0]["steps"]["dead.weight"] == 3               # every bucket is exchanged, unused or not


@pytest.mark.parametrize("sc", ["join_uneven", "join_uneven_sharded"])
def test_join_with_uneven_inputs_the_joined_rank_exchanges_zeros(ddp2, sc):
    """Under ``Join([ddp])`` a rank out of batches (rank 0 after 2 of 4 steps; sharded: rank 1 after 1 of 4)
    runs the hook on zero buckets (DDP's join hook), so its collectives match the training rank's: nothing
    hangs, and the training rank's averages are TernGrad's of (zeros, its gradient), bit for bit."""
    ranks = ddp2[sc]
    cfg, names = ranks[0]["config"], ranks[0]["names"]
    mine = [r["my_steps"] for r in ranks]
    inputs = [by_name_and_step(r["inputs"]) for r in ranks]
    outputs = [by_name_and_step(r["outputs"]) for r in ranks]
    assert set(inputs[0]) == set(inputs[1]) == {(n, s) for n in names for s in range(max(mine))}
    checked = 0
    for (name, step) in sorted(inputs[0]):
        grads = [inputs[r][(name, step)] for r in range(NP)]
        want, _ = expected_average(grads, name, step, cfg)
        for r in range(NP):
            if step >= mine[r]:          # joined: the hook got zeros, and p.grad is not touched
                assert not grads[r].any() and (name, step) not in outputs[r], (name, step, r)
            else:
                assert torch.equal(outputs[r][(name, step)], want), (name, step, r)
                checked += 1
    assert checked == len(names) * sum(mine) and min(mine) < max(mine)
    assert all(sorted(set(r["steps"].values())) == [max(mine)] for r in ranks)   # the same streams on both


def test_a_compiled_ddp_model_calls_the_hook_with_every_bucket(ddp2):
    """torch.compile(ddp_model) (bit identity checked with the other exact scenarios): dynamo compiled the
    forward (graphs counted), and the hook saw every parameter at every step."""
    ranks = ddp2["compiled"]
    assert all(r["graphs"] >= 1 for r in ranks)
    assert len(ranks[0]["inputs"]) == 3 * len(ranks[0]["names"]) == len(ranks[0]["outputs"])


def test_fp16_and_bf16_gradients(ddp2):
    for sc, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        outs = ddp2[sc][0]["outputs"]
        assert outs and all(t.dtype == dtype for _, t in outs), sc


@pytest.mark.parametrize("sc", ["nan_raise", "nan_raise_per_rank"])
def test_nan_on_one_rank_raises_on_every_rank(ddp2, sc):
    """Shared scaler (the handshake tells every rank) and per-rank scalers (the payload headers do): backward
    of step 1 raises on both ranks with the same message; DDP rethrows the hook's error as a RuntimeError
    naming NonFiniteGradientError, which the state keeps as last_error."""
    raised = ddp2[sc]
    for res in raised:
        assert res["error"] is not None and res["steps_done"] == 1
        kind, mro, msg = res["error"]
        assert "NaN or Inf on rank" in msg and "NonFiniteGradientError" in msg, msg
        assert res["last_error"] == "NonFiniteGradientError"
    first_line = [r["error"][2].splitlines()[0] for r in raised]
    assert first_line[0] == first_line[1]


def test_nan_zero_policy_and_training_on_after_an_error(ddp2):
    zeroed = ddp2["nan_zero"]
    assert all(r["error"] is None and r["zeroed"] > 0 for r in zeroed)
    assert zeroed[0]["zeroed"] == zeroed[1]["zeroed"]
    for a, b in zip(zeroed[0]["params"], zeroed[1]["params"]):
        assert torch.equal(a, b)
    cont = ddp2["nan_then_continue"]
    assert cont[0]["seen"] == cont[1]["seen"] == [None, "RuntimeError", None]    # the step after trains
    for a, b in zip(cont[0]["params"], cont[1]["params"]):
        assert torch.equal(a, b)


def test_inf_in_a_full_precision_tensor_follows_on_nonfinite(ddp2):
    """Every tensor under min_numel goes through the hook's plain fp32 allreduce: rank 1's Inf reaches both
    ranks' sums, so both raise naming the tensor (raise), or both zero that average and train on (zero)."""
    for res in ddp2["fp_inf_raise"]:
        assert res["error"] and "'body.weight'" in res["error"] and "full precision" in res["error"], res
        assert res["last_error"] == "NonFiniteGradientError"
    a, b = ddp2["fp_inf_zero"]
    assert a["error"] is None and a["zeroed"] == b["zeroed"] == 1 and a["uncompressed"] > 0
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y) and torch.isfinite(x).all()


def test_state_dict_resumes_the_same_random_streams(ddp2):
    for res in ddp2["resume"]:
        for a, b in zip(res["straight"], res["resumed"]):
            assert torch.equal(a, b)
        assert any(not torch.equal(a, b) for a, b in zip(res["straight"], res["forgot"]))
        assert all(v == 2 for v in res["ckpt_terngrad"]["steps"]["global"].values())
    for a, b in zip(ddp2["resume"][0]["resumed"], ddp2["resume"][1]["resumed"]):
        assert torch.equal(a, b)


def test_register_installs_the_hook(ddp2):
    r0, r1 = ddp2["register"]
    assert r0["tensors"] > 0 and all(v == 2 for v in r0["steps"].values())
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


def test_a_sparse_gradient_is_a_clear_error_naming_the_parameter_on_every_rank(ddp2):
    for res in ddp2["sparse"]:
        assert "TypeError: TernGrad: gradient '0.weight' is sparse" in res["error"], res["error"]
        assert res["last_error"].startswith("TypeError")


def test_ranks_with_different_settings_fail_together(ddp2):
    for res in ddp2["mismatch"]:     # checked at the first bucket; every later bucket fails alike
        assert res["error"] and "differ from rank 0" in res["error"]
        assert all(e and e.startswith("RankMismatchError") for e in res["errors"]), res["errors"]


# -- without ranks -----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.one_process
def test_package_loads_the_ddp_frontend_lazily():
    code = ("import sys, horovod_terngrad as tg\n"
            "assert 'horovod_terngrad.frontends.ddp' not in sys.modules\n"
            "assert tg.ddp.register and 'horovod_terngrad.ddp' in sys.modules\n"
            "from horovod_terngrad import ddp\n"
            "import horovod_terngrad.ddp as again\n"
            "assert ddp is again is tg.ddp and ddp.register and ddp.TernGradState and ddp.terngrad_hook\n"
            "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=rank_env())
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


@pytest.mark.slow
@pytest.mark.one_process
@pytest.mark.parametrize("statement", ["import horovod_terngrad.ddp as m",
                                       "from horovod_terngrad.ddp import register, TernGradState, terngrad_hook"])
def test_horovod_terngrad_ddp_is_a_module_path(statement):
    """README's module path works as the first import of a fresh process, as a module and by name."""
    code = (f"{statement}\n"
            "import horovod_terngrad.frontends.ddp as f, horovod_terngrad.ddp as m\n"
            "assert m.register is f.register and m.TernGradState is f.TernGradState\n"
            "assert m.terngrad_hook is f.terngrad_hook and m.find_ddp is f.find_ddp\n"
            "assert m.__name__ == 'horovod_terngrad.ddp' and m.__file__.endswith('ddp.py')\n"
            "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=rank_env())
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr


# -- the example, as users launch it -------------------------------------------------------------------------------
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "ddp_mnist.py")


def run_example(tmp_path, hook, steps=60, extra=()):
    out = tmp_path / f"{hook}.json"
    run_launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NP), EXAMPLE,
                "--hook", hook, "--max-steps", str(steps), "--test-limit", "1000", "--log-every", "0",
                "--json", str(out)] + list(extra), f"examples/ddp_mnist.py --hook {hook}")
    import json
    return json.loads(out.read_text())


@pytest.mark.slow
def test_torchrun_example_trains_lenet_with_terngrad(tmp_path):
    res = run_example(tmp_path, "terngrad")
    assert res["ranks"] == NP and res["steps"] == 60 and res["params_identical"]
    assert res["loss_last"] < 0.6 * res["loss_first"], res          # ~2.1 -> ~0.6 in 60 steps
    assert res["test_acc"] > 0.6, res
    tg = res["terngrad"]
    # conv2.weight (25,000), fc1.weight (400,000), fc2.weight (5,000) ternarized every step; conv1.weight (500)
    # and the biases (580) under min_numel=4096 travel uncompressed
    assert tg["tensors"] == 3 * 60 and tg["elements"] == 430000 * 60 and tg["uncompressed_elements"] == 1080 * 60
    assert 2.0 <= tg["bits_per_element"] < 2.01


@pytest.mark.slow
def test_torchrun_example_powersgd_on_gloo_runs_past_its_start(tmp_path):
    """powerSGD_hook on gloo issues collectives from gloo's callback threads; ops/ddp_hooks.py serializes the
    buckets so every rank issues them in one order (unserialized, this run aborts or hangs)."""
    res = run_example(tmp_path, "powersgd", steps=40, extra=["--powersgd-start", "3", "--powersgd-rank", "2"])
    assert res["steps"] == 40 and res["params_identical"]
    assert res["loss_last"] < 0.7 * res["loss_first"], res
