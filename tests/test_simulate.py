"""The N-worker simulator gives the bytes of a real run: checked against 2 real Horovod ranks."""
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from horovod_terngrad import TernGradConfig
from horovod_terngrad.modelling.simulate import Simulator, batch_indices, worker_slice

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "workers"))


@pytest.mark.slow
def test_simulator_matches_two_real_horovod_ranks_bit_for_bit(tmp_path):
    import hvd_scenarios as W
    from test_horovod import launch
    real = launch(tmp_path, "gloo", 2, ["lenet_sim"])["lenet_sim"]
    torch.set_num_threads(1)
    model, x, y, opt = W.sim_setup()
    sim = Simulator(model, 2, TernGradConfig(seed=W.SIM_SEED, exclude=W.SIM_EXCLUDE, min_numel=0), grad_mode="loop")
    for step in range(W.SIM_STEPS):
        idx = batch_indices(W.SIM_SEED, step, len(x), W.SIM_BATCH)
        sim.step(x[idx], y[idx], F.cross_entropy, opt)
    for rank in range(2):
        for a, b in zip(model.parameters(), real[rank]["params"]):
            assert torch.equal(a.detach(), b)


@pytest.mark.parametrize("cfg", [dict(), dict(packing="base3", bucket_size=100), dict(shared_scaler=False),
                                 dict(clip_factor=0.0), dict(exchange="sharded"), dict(exchange="auto")])
def test_simulator_is_the_exchange_on_threaded_ranks_bit_for_bit(cfg):
    """The simulator drives N engines from one thread over shared buffers; the same engines on N threads
    (run_ranks, copied buffers) give identical averages over several steps (stream keys advance per step)
    and identical counters."""
    from horovod_terngrad.exchange import Engine, run_ranks
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Tanh(), torch.nn.Linear(300, 5))
    config = TernGradConfig(seed=7, min_numel=0, **cfg)   # every tensor through the engine, as below
    sim = Simulator(model, 5, config)
    grads = []
    for step in range(3):
        x, y = torch.randn(10, 20), torch.randint(0, 5, (10,))
        grads.append(sim.worker_gradients(x, y, F.cross_entropy))

    def body(c):
        # the simulator's ranks never call hvd.join, so its engines run with joins=False (no 4-byte
        # presence allreduce per step ahead of per-rank payloads); the threaded engines are told the same
        ex = Engine(c, config, joins=False)
        outs = []
        for g in grads:
            tickets = [ex.start(t, name) for t, name in zip(g[c.rank], sim.names)]
            outs.append([ex.finish(t) for t in tickets])
        return outs, ex.stats

    threaded = run_ranks(5, body)
    for step, g in enumerate(grads):
        for a, b in zip(threaded[0][0][step], sim.average(g)):
            assert torch.equal(a, b), step
    for field in ("tensors", "elements", "payload_bytes_sent", "handshake_bytes_sent", "bytes_received", "collectives"):
        assert getattr(threaded[0][1], field) == getattr(sim.stats, field), field
    assert sim.stats.tensors == 12 and sim.stats.bytes_received > sim.stats.payload_bytes_sent > 0
    # a handshake per tensor and step; per-rank scalers send nothing but payloads (no presence check)
    assert (sim.stats.handshake_bytes_sent > 3 * 4) if config.shares_scaler else sim.stats.handshake_bytes_sent == 0


@pytest.mark.parametrize("exchange", ["allgather", "sharded"])
def test_policy_keeps_excluded_and_small_tensors_in_fp32(exchange):
    """exclude= and min_numel= tensors are averaged in fp32 (as the frontend hands them to Horovod's
    allreduce); the others are still ternarized, with the same streams as without the policy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Tanh(), torch.nn.Linear(300, 5))
    x, y = torch.randn(12, 20), torch.randint(0, 5, (12,))
    plain = Simulator(model, 3, TernGradConfig(seed=3, exchange=exchange, min_numel=0))
    policy = Simulator(model, 3, TernGradConfig(seed=3, exchange=exchange, exclude=(r"^2\.",), min_numel=301))
    g = plain.worker_gradients(x, y, F.cross_entropy)
    mean = Simulator(model, 3, compression="none").average(g)
    a, b = plain.average(g), policy.average(g)
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert torch.equal(b[0], a[0]) and not torch.equal(b[0], mean[0])      # ternarized, same stream
    for i in (1, 2, 3):                                                       # 300 < 301 elements; "^2\."
        assert torch.equal(b[i], mean[i]) and not torch.equal(a[i], mean[i]), names[i]
    assert policy.stats.tensors == 1 and plain.stats.tensors == 4


def test_simulated_nonfinite_and_mismatch():
    from horovod_terngrad import NonFiniteGradientError, RankMismatchError
    sim = Simulator(torch.nn.Linear(3, 2), 3, TernGradConfig(on_nonfinite="raise"))
    good = [torch.randn(2, 3) for _ in range(3)]
    bad = list(good)
    bad[1] = good[1].clone()
    bad[1][0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match=r"'w'.*rank.*1"):
        sim.average_tensor(bad, "w")
    zero = Simulator(torch.nn.Linear(3, 2), 3, TernGradConfig(on_nonfinite="zero"))
    assert torch.isnan(Simulator(torch.nn.Linear(3, 2), 3).average_tensor(bad, "w")).all()   # the default
    assert torch.equal(zero.average_tensor(bad, "w"), torch.zeros(2, 3)) and zero.stats.nonfinite_zeroed == 1
    with pytest.raises(RankMismatchError, match="'w'"):
        sim.average_tensor([good[0], good[1], torch.randn(3, 2)], "w")
    with pytest.raises(RankMismatchError, match="'w'"):      # the engine keeps working after a failed step
        sim.average_tensor([good[0], good[1], torch.randn(3, 2)], "w")
    assert torch.equal(sim.average_tensor(good, "v"), zero.average_tensor(good, "v"))


def test_vmap_gradients_match_the_loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x, y = torch.randn(16, 12), torch.randint(0, 3, (16,))
    loop = Simulator(model, 4, grad_mode="loop").worker_gradients(x, y, F.cross_entropy)
    vm = Simulator(model, 4, grad_mode="vmap").worker_gradients(x, y, F.cross_entropy)
    for gl, gv in zip(loop, vm):
        for a, b in zip(gl, gv):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fp32_baseline_is_the_batch_gradient():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 2)
    x, y = torch.randn(8, 5), torch.randint(0, 2, (8,))
    avg = Simulator(model, 4, compression="none").average(
        Simulator(model, 4).worker_gradients(x, y, F.cross_entropy))
    full = torch.autograd.grad(F.cross_entropy(model(x), y), list(model.parameters()))
    for a, b in zip(avg, full):
        torch.testing.assert_close(a, b)


def test_batches_and_slices():
    a = batch_indices(3, 0, 100, 10)
    assert torch.equal(a, batch_indices(3, 0, 100, 10)) and a.unique().numel() == 10
    assert not torch.equal(a, batch_indices(3, 1, 100, 10))
    assert torch.equal(torch.cat([worker_slice(a, r, 5) for r in range(5)]), a)
    with pytest.raises(ValueError, match="does not split evenly"):
        Simulator(torch.nn.Linear(2, 2), 3).worker_gradients(torch.randn(4, 2), torch.zeros(4, dtype=torch.long),
                                                            F.cross_entropy)


@pytest.mark.slow
@pytest.mark.one_process
def test_reduced_fig3_study_terngrad_within_margin_of_fp32(tmp_path):
    """The Fig. 3 study at 300 iterations (the paper runs 10,000): TernGrad with 8 simulated workers
    reaches the fp32 run's test accuracy within 2 points, with both optimizers, and the study writes its
    table and plot."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import study_lenet
    from horovod_terngrad.operations.datasets import load_mnist
    torch.set_num_threads(1)
    data = load_mnist()
    data["test"] = (data["test"][0][:3000], data["test"][1][:3000])
    results = []
    for opt in ("momentum", "vanilla"):
        base = study_lenet.train(data, 1, "none", opt, 300, seed=1)
        tern = study_lenet.train(data, 8, "terngrad", opt, 300, seed=1)
        assert base["test_acc"] > 0.9 and tern["test_acc"] > 0.9
        assert abs(tern["test_acc"] - base["test_acc"]) <= 0.02, (opt, base["test_acc"], tern["test_acc"])
        assert 1.9 < tern["bits_per_element"] < 2.2
        results += [base, tern]
    study_lenet.write_outputs(results, str(tmp_path), 300)
    assert (tmp_path / "lenet_study.png").stat().st_size > 10_000
    assert "| momentum | 8 |" in (tmp_path / "lenet_study.md").read_text()
