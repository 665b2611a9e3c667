"""Owner-step training in the simulator (examples/owner_step.py): the owners' exact averages and noise estimates,
the weight differences' roundings (bounded, unbiased), the replica's error over many steps, and the bits."""
import math
import os
import sys

import pytest
import torch

from horovod_terngrad import TernGradConfig, codec
from horovod_terngrad.backends import for_device
from horovod_terngrad.codec import sizes
from horovod_terngrad.codec.packing import Header
from horovod_terngrad.exchange import engine as engine_module

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import owner_step  # noqa: E402
from horovod_terngrad.optim import AdamW

N = 4
IN, OUT = 40, 50          # one 2000-element weight: 4 shards of 500


def _setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(IN, OUT, bias=False)
    cfg = TernGradConfig(exchange="requantized", packing="base3", hierarchical=False, seed=3, min_numel=0, levels=3)
    sim = owner_step.OwnerStepSimulator(model, N, cfg)
    opt = AdamW(model.parameters(), lr=1e-2)
    grads = [[torch.randn(OUT, IN) * (1 + r)] for r in range(N)]
    return model, cfg, sim, opt, grads


def test_owners_average_and_noise_estimate_are_the_first_stage_exactly():
    """Rank 0 gets every owner's exact average of its shard and the first stage's noise estimate with the
    minibatch's share taken out per shard (codec/squares.py): recomputed here from each rank's own ternarization
    (one scaler per shard, the engine's stream per rank, the clip at c·σ)."""
    model, cfg, sim, opt, grads = _setup()
    avg = sim.average(grads)[0].reshape(-1)
    noise, _ = opt.precision_ledger.noise_of(model.weight)
    n = IN * OUT
    bounds = sizes.reternarized_bounds(n, N)
    shard = sizes.reternarized_encode_bucket(n, N)
    backend = for_device(torch.device("cpu"))
    values, clipped = [], []
    for r in range(N):
        g = grads[r][0].reshape(-1).contiguous()
        prep = backend.prepare(g, shard, cfg.clip_factor)
        key = codec.stream_key(cfg.seed, 0, codec.tensor_id("weight"), r)
        payload = backend.encode(g, prep.threshold, prep.scalers, shard, key, cfg.packing, shape=(n,))
        values.append(backend.decode(payload, [Header(cfg.packing, 0, shard, n)], [0], 1))
        t = float(prep.threshold)
        clipped.append(g.clamp(-t, t))
    want = sum(values) / N
    assert torch.allclose(avg, want, rtol=1e-6, atol=1e-7)
    raw = sum(v * v for v in values) / N ** 2
    for lo, hi in bounds:
        q = sum(float((c[lo:hi] ** 2).sum()) for c in clipped) / N ** 2
        factor = max(0.0, 1 - q / float(raw[lo:hi].sum()))
        assert 0 < factor < 1                                 # the squares took a share out
        assert torch.allclose(noise[lo:hi], raw[lo:hi] * factor, rtol=1e-4, atol=1e-9)


def test_the_engine_keeps_its_transport_outside_the_owner_step():
    model, cfg, sim, opt, grads = _setup()
    before = engine_module.TRANSPORTS["requantized"]
    sim.average(grads)
    assert engine_module.TRANSPORTS["requantized"] is before
    with owner_step.owner_transport():
        assert engine_module.TRANSPORTS["requantized"] is owner_step.TRANSPORT
    assert engine_module.TRANSPORTS["requantized"] is before


def test_nearest_ternary_rounds_to_the_nearest_of_three_levels_per_bucket():
    torch.manual_seed(1)
    d = torch.randn(1000) * torch.rand(1000)
    q = owner_step.nearest_ternary(d, 128)
    for lo in range(0, 1000, 128):
        x, y = d[lo:lo + 128], q[lo:lo + 128]
        s = float(x.abs().max())
        assert set(torch.unique(y.abs()).tolist()) <= {0.0, s}
        assert float((x - y).abs().max()) <= s / 2 + 1e-7
        assert float(y[x.abs().argmax()]) == float(x[x.abs().argmax()])     # the largest is exact
    assert torch.equal(owner_step.nearest_ternary(torch.zeros(50), 16), torch.zeros(50))


def test_the_replica_stays_within_one_step_of_the_master_with_nearest_rounding():
    """replica += nearest(master - replica) after every step: the error is one rounding of (step + previous error),
    so it never exceeds the largest step, however many steps (s <= 2·max|step|, |error| <= s/2)."""
    torch.manual_seed(2)
    w = torch.zeros(640)
    x = torch.zeros(640)
    worst_step, worst_error = 0.0, 0.0
    for t in range(2000):
        step = torch.randn(640) * 1e-3 * (1 + torch.rand(640) * 3) + 2e-4    # a drift: errors would pile up
        worst_step = max(worst_step, float(step.abs().max()))
        w += step
        x += owner_step.nearest_ternary(w - x, 640)
        worst_error = max(worst_error, float((w - x).abs().max()))
    assert worst_error <= worst_step
    assert float((w - x).abs().max()) < 0.01 * float(w.abs().max())


def test_stochastic_weight_difference_is_unbiased():
    torch.manual_seed(3)
    d = torch.randn(300) * 1e-3
    draws = torch.stack([owner_step.stochastic_ternary(d, 100, codec.stream_key(0, k, 7, 1), "base3")
                         for k in range(4000)])
    s = torch.stack([d[i:i + 100].abs().max().expand(100) for i in range(0, 300, 100)]).reshape(-1)
    assert set(torch.unique((draws / s).round().abs()).tolist()) <= {0.0, 1.0}
    sd = torch.sqrt((s * d.abs() - d * d).clamp(min=0) / draws.shape[0])
    assert bool(((draws.mean(0) - d).abs() <= 5 * sd + 1e-9).all())


def test_the_replica_follows_the_master_in_the_simulator():
    """One owner-step: the optimizer steps the master; the replica moves by ternary differences whose error is at
    most half a scaler; the full-precision tensors' replica is the master itself."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.Tanh(), torch.nn.Linear(50, 3))
    cfg = TernGradConfig(exchange="requantized", packing="base3", hierarchical=False, min_numel=1000)
    sim = owner_step.OwnerStepSimulator(model, N, cfg, rounding="nearest", delta_bucket=128)
    opt = AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 40), torch.randint(0, 3, (8,))
    start = [p.detach().clone() for p in sim.params]
    for _ in range(3):
        sim.to_replica()
        avg = sim.average(sim.worker_gradients(x, y, torch.nn.functional.cross_entropy))
        sim.to_master()
        for p, g in zip(sim.params, avg):
            p.grad = g
        opt.step()
        sim.send_weights()
    assert sim.ternary == [True, False, False, False]
    w, r = sim.master[0], sim.replica[0]
    assert not torch.equal(w, start[0]) and not torch.equal(r, start[0])
    assert float((w - r).abs().max()) <= sim.error_max and sim.error_max < float((w - start[0]).abs().max())
    for i in (1, 2, 3):
        assert sim.replica[i].data_ptr() == sim.master[i].data_ptr()
    assert all(p.data_ptr() == m.data_ptr() for p, m in zip(sim.params, sim.master))


def test_bits_are_the_codecs_sizes_and_the_engines_counters():
    """The gradient stage's bytes (codec/sizes.py) are what the engine counted in its alltoall; the weight
    stage's are one ternary payload per shard; together under 4 bits per element at N = 16 in base-3."""
    model, cfg, sim, opt, grads = _setup()
    sim.average(grads)
    n = IN * OUT
    stand_in = sum(owner_step.OwnerShardStage.owner_chunks(
        type("E", (), {"coll": type("C", (), {"size": N})})(),
        type("T", (), {"numel": n, "want_noise": True, "group": type("G", (), {"bucket_size": 0})})())[1:])
    grad, delta = owner_step.received_bytes(n, N, cfg.packing)
    assert sim.stats.bytes_received - stand_in == grad
    assert grad == (N - 1) * (sizes.HEADER_BYTES + sizes.SCALER_BYTES + sizes.SQUARES_BYTES + 100)
    assert delta == (N - 1) * (sizes.HEADER_BYTES + sizes.SCALER_BYTES + 100)
    sim.send_weights()
    assert sim.bits_received() == (8 * grad / n, 8 * delta / n)
    big = 1 << 20
    g16, d16 = owner_step.received_bytes(big, 16, "base3", delta_bucket=128)
    assert 8 * (g16 + d16) / big < 3.3


def test_exact_weights_leave_the_replica_at_the_master_and_count_32_bits():
    model, cfg, sim, opt, grads = _setup()
    sim = owner_step.OwnerStepSimulator(model, N, cfg, rounding="exact")
    sim.to_replica()
    avg = sim.average(grads)
    sim.to_master()
    model.weight.grad = avg[0]
    opt.step()
    sim.send_weights()
    assert torch.allclose(sim.replica[0], sim.master[0], rtol=0, atol=1e-7) and sim.error_max <= 1e-7
    assert sim.bits_received()[1] == 8 * (N - 1) * 4 * 500 / 2000


@pytest.mark.slow
@pytest.mark.one_process
def test_lm_scale_study_runs_owner_step(tmp_path):
    """study_lm_scale's owner-step methods: a finite held-out loss of the master and of the replica, close to each
    other; the bits split into the two stages; one scaler per 128 elements of the difference costs weight bits
    only."""
    import study_lm_scale as sls
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(("The quick brown fox jumps over the lazy dog. " * 3000).encode())
    rows = sls.main(["--model", "gpt2", "--corpus", str(corpus), "--width", "32", "--layers", "1", "--seq-len", "32",
                     "--batch", "8", "--steps", "3", "--workers", "4", "--seeds", "0", "--evals", "0",
                     "--eval-windows", "16", "--exchanges", "owner-step-nearest,owner-step-stochastic@b128",
                     "--out", str(tmp_path / "runs")])
    by = {r["method"]: r for r in rows}
    assert set(by) == {"owner-step-nearest", "owner-step-stochastic@b128"}
    for r in rows:
        assert math.isfinite(r["held_out"]) and abs(r["held_out"] - r["held_out_replica"]) < 0.05
        assert r["bits_received"] == r["bits_gradient"] + r["bits_weights"] and r["exchange"] == r["method"].split("@")[0]
        assert 0 < r["replica_error_max"] < 0.05
    near, buck = by["owner-step-nearest"], by["owner-step-stochastic@b128"]
    assert near["bits_gradient"] == buck["bits_gradient"] and buck["bits_weights"] > near["bits_weights"]


def test_the_lenet_study_runs_owner_step_with_momentum_sgd():
    """study_lenet.py --exchange owner-step: the owners step momentum SGD on their shards (no noise estimate
    asked), every rank's copy within one step of the master, the bits of the two ternary stages."""
    import study_lenet
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g)
    data = {"train": (x, y), "test": (x[:64], y[:64])}
    res = study_lenet.train(data, 4, "terngrad", "momentum", 6, seed=0, exchange="owner-step")
    assert res["exchange"] == "owner-step" and 0 <= res["test_acc"] <= 1
    assert 2.0 < res["bits_per_element"] < 4.0          # (N-1)/N·3.2 = 2.4 plus the shards' headers
