"""The DDP hook where users meet it: a state built before the process group (Lightning's
``DDPStrategy(ddp_comm_state=...)``), pickled with its model (Lightning's spawn launcher), ``register()`` on the
wrappers of torch.compile, Lightning, Fabric, Accelerate and transformers; and the recipes in examples/, each run
as users launch it on 2 CPU processes (gloo): Lightning's DDPStrategy, Accelerate's prepared model (plain and
torch.compile'd), the transformers Trainer, and examples/transformers_lm.py on both frontends.

Lightning, Accelerate and transformers are test dependencies (``scripts/setup.sh --test``); the tests that need
one skip without it.
"""
import glob
import json
import os
import pickle
import subprocess
import sys

import pytest
import torch

from support import forked_ranks
from test_horovod import BIN, HERE, rank_env

ROOT = os.path.dirname(HERE)
EXAMPLES = os.path.join(ROOT, "examples")
WORKER = os.path.join(HERE, "workers", "ddp_ecosystem.py")
TIMEOUT = 240
NP = 2


def launch(cmd, what, cwd=None, timeout=TIMEOUT):
    """Run a launcher command (ranks' environment); fails the test on a hang or a non-zero exit; its stdout."""
    try:
        p = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what} hung for {timeout}s:\n{e.stdout}\n{e.stderr}")
    assert p.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    return p.stdout


def torchrun(script, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NP), script,
            *map(str, args)]


def results(stdout):
    """The ``result: {...}`` every rank prints, by rank (ranks share the pipe: found anywhere in a line)."""
    dec, out, at = json.JSONDecoder(), [], stdout.find("result: {")
    while at >= 0:
        obj, end = dec.raw_decode(stdout, at + len("result: "))
        out.append(obj)
        at = stdout.find("result: {", end)
    return sorted(out, key=lambda r: r.get("rank", 0))


# -- without ranks ------------------------------------------------------------------------------------------------
def test_the_state_is_built_and_pickled_without_torch_distributed():
    import torch.distributed as dist

    from horovod_terngrad import ddp as tg_ddp
    assert not dist.is_initialized()
    model = torch.nn.Sequential(torch.nn.Linear(8, 600), torch.nn.Linear(600, 2))
    state = tg_ddp.TernGradState(model, packing="base3", seed=7, exclude=("^1",))
    assert state.collectives is None and state.process_group is None and "first bucket" in repr(state)
    state.steps.update({"0.weight": 5, "1.weight": 5})
    state.stats.tensors = 10
    model2, again = pickle.loads(pickle.dumps((model, state)))
    assert again.config == state.config and dict(again.steps) == {"0.weight": 5, "1.weight": 5}
    assert again.stats.tensors == 10 and again.state_dict() == state.state_dict()
    assert again.collectives is None and again._worker.thread is None and again.process_group is None
    # pickled with the model, the state's names are the unpickled model's own parameters
    assert {n: p for p, n in again.names.values()} == dict(model2.named_parameters())
    assert [n for _, n in again.names.values()] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    bare = pickle.loads(pickle.dumps(tg_ddp.TernGradState()))
    assert bare.names == {} and not bare._named


def test_register_refuses_what_holds_no_ddp_model():
    from horovod_terngrad import ddp as tg_ddp
    with pytest.raises(TypeError, match="found none in Linear"):
        tg_ddp.register(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="found none in OptimizedModule"):
        tg_ddp.find_ddp(torch.compile(torch.nn.Linear(2, 2)))


# -- the state under real ranks ------------------------------------------------------------------------------------
SCENARIOS = ["pickled_before_init", "unnamed_direct", "exclude_needs_names", "wrappers"]


# a test that uses one of these launches (module fixtures) is slow (conftest.py)
SLOW_FIXTURES = ("eco",)


@pytest.fixture(scope="module")
def eco(tmp_path_factory):
    out = tmp_path_factory.mktemp("eco")
    forked_ranks.run_scenarios("torch", NP, WORKER, [str(out)] + SCENARIOS, str(out), timeout=TIMEOUT)
    res = {}
    for sc in SCENARIOS:
        res[sc] = [torch.load(os.path.join(out, f"{sc}.rank{r}.pt"), weights_only=False) for r in range(NP)]
        for r, one in enumerate(res[sc]):
            assert "crash" not in one, f"{sc} rank {r}:\n{one['crash']}"
    return res


def test_a_state_pickled_with_its_model_before_init_process_group_trains(eco):
    r0, r1 = eco["pickled_before_init"]
    for r in (r0, r1):
        assert r["before"] == (None, None, {})                      # no group until the first bucket
        assert r["steps"] == {n: 2 for n in ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias")}
        assert r["tensors"] == 12 and "size=2" in r["repr"]
        assert r["again_steps"] == r["steps"] and r["again_groups"] is None and r["again_config"] == r["config"]
    assert r0["checksum"] == r1["checksum"]


def test_a_state_without_names_names_parameters_by_the_order_the_hook_meets_them(eco):
    r0, r1 = eco["unnamed_direct"]
    assert r0["steps"] == r1["steps"] == {f"param.{k}": 2 for k in range(6)}
    assert r0["checksum"] == r1["checksum"]


def test_exclude_without_names_fails_every_bucket_on_every_rank_with_a_clear_error(eco):
    for r in eco["exclude_needs_names"]:
        assert len(r["errors"]) == 2 and all("exclude= needs parameter names" in e for e in r["errors"]), r


def test_register_finds_ddp_in_wrappers_and_refuses_a_second_hook(eco):
    r0, r1 = eco["wrappers"]
    assert r0["found"] == {"compiled": True, "hf_trainer": True, "lightning_trainer": True,
                           "lightning_module": True, "lightning_wrapper": True, "fabric_module": True}
    assert set(r0["steps"].values()) == {2} and r0["checksum"] == r1["checksum"]
    err = r0["errors"]
    assert "already has TernGrad's hook" in err["again"] and "already has TernGrad's hook" in err["again_compiled"]
    assert "already has the communication hook allreduce_hook" in err["other_hook"]
    assert "already serves another DDP model" in err["state_reused"]
    assert "found none in Sequential" in err["not_ddp"]


# -- the recipes, launched as users launch them ----------------------------------------------------------------------
@pytest.mark.slow
def test_lightning_ddp_strategy_with_the_spawn_launcher_runs_the_hook(tmp_path):
    """Trainer(strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=terngrad_hook, start_method="spawn"),
    accelerator="cpu", devices=2): the state, built before any process group, is pickled into both processes;
    the callback registers it (Lightning does only on CUDA); its counters prove the hook ran on every step."""
    pytest.importorskip("lightning")
    out = tmp_path / "lightning"
    stdout = launch([sys.executable, os.path.join(EXAMPLES, "lightning_ddp.py"), "--out", str(out),
                     "--max-steps", "20"], "examples/lightning_ddp.py", cwd=tmp_path)
    ranks = [json.loads(open(f).read()) for f in sorted(glob.glob(str(out / "rank*.json")))]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world"] == 2 for r in ranks)
    for r in ranks:
        assert r["hooks"] == ["terngrad_hook"] and r["strategy_holds_this_state"]
        # Linear(32, 256) and Linear(256, 256) ternarized on each of the 20 steps, named as in the LightningModule
        assert r["steps"] == {"net.0.weight": 20, "net.2.weight": 20} and r["tensors"] == 40
        assert r["elements"] == 20 * (32 * 256 + 256 * 256) and 2.0 <= r["bits_per_element"] < 2.02
        assert r["uncompressed_elements"] == 20 * (256 + 256 + 256 * 10 + 10)
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    assert "rank 0: 20 steps" in stdout


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", ["no", "eager"])
def test_accelerate_prepared_model_with_the_hook(dynamo):
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    r0, r1 = results(launch(torchrun(os.path.join(EXAMPLES, "accelerate_ddp.py"), "--dynamo", dynamo, "--steps", 10),
                            f"examples/accelerate_ddp.py --dynamo {dynamo}"))
    assert r0["distributed_type"] == "DistributedType.MULTI_CPU" and r0["ranks"] == 2
    assert r0["prepared"] == ("DistributedDataParallel" if dynamo == "no" else "OptimizedModule")
    assert r0["ddp"] == "DistributedDataParallel"
    for r in (r0, r1):
        assert r["steps"] == 10 and r["stream_steps"] == [10] and r["tensors"] == 100
        assert 2.0 <= r["bits_per_element"] < 2.03 and r["loss_last"] < r["loss_first"]
    assert r0["checksum"] == r1["checksum"]


@pytest.mark.slow
def test_transformers_trainer_with_the_callback():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    r0, r1 = results(launch(torchrun(os.path.join(EXAMPLES, "hf_trainer_ddp.py"), "--max-steps", 10),
                            "examples/hf_trainer_ddp.py"))
    for r in (r0, r1):
        assert r["ranks"] == 2 and r["wrapped"] == "DistributedDataParallel" and r["global_step"] == 10
        # GPT-2, 2 layers: wte, wpe and 4 matrices per layer ternarized on each step
        assert r["tensors"] == 100 and r["stream_steps"] == [10] and 2.0 <= r["bits_per_element"] < 2.03
        assert r["losses"][-1] < r["losses"][0]
    assert r0["checksum"] == r1["checksum"]


@pytest.mark.slow
def test_transformers_lm_example_on_both_frontends(tmp_path):
    """examples/transformers_lm.py briefly with the DDP hook (torchrun) and with Horovod (horovodrun --gloo), with
    horovod_terngrad.optim.AdamW and the nanoGPT recipe (weight decay on matrices, warm-up, cosine, gradient-norm
    clip: on Horovod after synchronize(), the step under skip_synchronize()): the loss falls, every rank ends with
    the same parameters, 2 bits per ternarized element, the bits over the run include the optimizer's refreshes
    (more than the 2-bit payload alone); and the two frontends refresh on the same steps and train bit for bit
    alike (the same averages, tests/test_ddp.py's twins)."""
    pytest.importorskip("transformers")
    script = os.path.join(EXAMPLES, "transformers_lm.py")
    common = ["--optim", "tg-adamw", "--recipe", "nanogpt", "--warmup", "4", "--steps", "16", "--log-every", "8",
              "--n-embd", "64", "--n-head", "2"]
    ddp = results(launch(torchrun(script, "--frontend", "ddp", *common), "transformers_lm.py --frontend ddp"))[0]
    hvd_out = launch([os.path.join(BIN, "horovodrun"), "--gloo", "-np", str(NP), "-H", f"localhost:{NP}",
                      sys.executable, script, "--frontend", "horovod", *common], "transformers_lm.py --frontend horovod")
    hvd = results(hvd_out)[0]
    for r in (ddp, hvd):
        assert r["ranks"] == 2 and r["steps"] == 16 and r["params_identical"] and r["optim"] == "tg-adamw"
        assert r["batch_size"] == 16 and r["global_batch"] == 32 and r["seq_len"] > 0      # the recipe's 16
        assert r["loss_last"] < r["loss_first"], r
        assert 2.0 <= r["bits_per_element_ternarized"] < 2.02
        # 16 steps of the default schedule: 8 warm-up refreshes + steps 11 and 15 at 32 bits, the rest 2-bit
        assert 2.1 < r["bits_per_element_overall"] < 32
        assert r["tokens_per_s"] > 0
    assert ddp["loss_last"] == hvd["loss_last"] and ddp["held_out_loss"] == hvd["held_out_loss"]
    assert "tokens/s" in hvd_out and "bits/element" in hvd_out
