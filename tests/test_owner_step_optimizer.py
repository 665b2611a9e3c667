"""OwnerStepOptimizer on N thread-ranks (exchange/owner_step.py, optim/owner_step.py): the replicas stay identical
on every rank and within one step of the masters, the step is the study's owner-step arithmetic, the bits are the
codec's sizes, a resumed run continues bit for bit, and bad input, NaN/Inf and mismatched checkpoints fail clearly."""
import math
import os
import sys

import pytest
import torch

from horovod_terngrad import TernGradConfig
from horovod_terngrad.codec import nearest, sizes
from horovod_terngrad.errors import NonFiniteGradientError, TernGradError
from horovod_terngrad.exchange.thread_collectives import run_ranks
from horovod_terngrad.optim import AdamW, OwnerStepOptimizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

CFG = TernGradConfig(packing="base3", min_numel=1000, seed=5, levels=3)   # the ternary first stage; levels=4 beside it


def _fresh(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 60), torch.nn.Tanh(), torch.nn.Linear(60, 30))


_INIT = _fresh().state_dict()       # every rank starts from the same weights (threads share torch's generator)


def _model():
    model = _fresh()
    model.load_state_dict(_INIT)
    return model


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 40, generator=g), torch.randn(16, 30, generator=g)


def _train(c, steps, start=0, state=None, lr=1e-2, max_grad_norm=1.0, opt_cls=None, config=CFG, **kw):
    model = _model()
    opt = OwnerStepOptimizer(model.named_parameters(), opt_cls, collectives=c, config=config, lr=lr,
                             max_grad_norm=max_grad_norm, **kw)
    if state is not None:
        model.load_state_dict(state[c.rank][0])
        opt.load_state_dict(state[c.rank][1])
    for step in range(start, start + steps):
        x, y = _batch(c.rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict(),
            [s.clone() if s is not None else None for s in opt.shards], opt)


def test_replicas_identical_on_every_rank_and_close_to_masters():
    out = run_ranks(4, _train, 6)
    for r in range(1, 4):
        for k in out[0][0]:
            assert torch.equal(out[r][0][k], out[0][0][k]), k      # every rank computes on the same bits
    # each owner's master is within one step of its shard of the replica: |x - w| <= lr·(a few), never drifting
    opt0 = out[0][3]
    for r in range(4):
        opt = out[r][3]
        for i in opt._tern:
            lo, hi = sizes.reternarized_bounds(opt.params[i].numel(), 4)[r]
            if hi > lo:
                err = (out[r][2][i] - out[r][0][opt0.names[i]].reshape(-1)[lo:hi]).abs().max()
                assert float(err) <= 3.5 * 1e-2      # Adam's step is at most sqrt(1/v_floor)·lr


def test_ternarized_and_full_precision_parameters_are_split_by_the_config():
    out = run_ranks(2, _train, 1)
    opt = out[0][3]
    tern = {n for n, t in zip(opt.names, opt.ternary) if t}
    assert tern == {"0.weight", "2.weight"}          # 2400 and 1800 elements; the biases stay fp32


def test_step_is_the_owner_step_arithmetic():
    """Against a recomputation from the exchange's own pieces: the owners' exact averages (decoded from every
    rank's ternary payload), one inner AdamW step on the masters, the nearest ternary rounding of the difference."""
    def one(c):
        model = _model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = OwnerStepOptimizer(model.named_parameters(), collectives=c, config=CFG, lr=1e-2)
        x, y = _batch(c.rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        handles = opt.exchange.send_gradients([grads[opt.names[i]] for i in opt._tern], 0)
        owned = opt.exchange.owned_averages(handles)
        opt.exchange.nonfinite(handles)
        opt.zero_grad()
        for n, p in model.named_parameters():
            p.grad = grads[n]
        opt.steps = 1          # the recomputation above used the stream of step 0 (and rounds the same values)
        return before, grads, owned, opt
    # the exchange's pieces alone: every owner's shard of the average is the mean of the ranks' ternary values
    out = run_ranks(2, one)
    for r in range(2):
        before, grads, owned, opt = out[r]
        for j, i in enumerate(opt._tern):
            if owned[j] is None:
                continue
            avg, noise = owned[j]
            assert avg.dtype == torch.float32 and noise is not None and bool((noise >= 0).all())
            lo, hi = opt.exchange.owned[j]
            mean = (out[0][1][opt.names[i]] + out[1][1][opt.names[i]]).reshape(-1)[lo:hi] / 2
            # ternary values are unbiased estimates of the clipped mean: close in the mean, not equal
            assert float((avg - mean).mean().abs()) < 0.05 * float(mean.abs().mean()) + 1e-3


@pytest.mark.parametrize("weight_bucket,levels", [(0, 3), (128, 3), (128, 4)])
def test_the_study_simulator_and_the_optimizer_take_the_same_steps(weight_bucket, levels):
    """The whole-run study's owner-step (examples/owner_step.py: the engine's requantized first stage, one process)
    and this optimizer on thread-ranks, on the same batches: the same averages and noise estimates bit for bit (the
    first stage's bytes are the engine's), and the same masters and replicas to fp32 rounding: the one difference
    is the noise's scale factor |g|²/|average|², which AdamW computes over a shard here and over the whole tensor
    there (equal to 1 up to its last bit).  So the study's held-out losses are this optimizer's."""
    import owner_step
    N, steps = 4, 4
    cfg = TernGradConfig(exchange="requantized", packing="base3", hierarchical=False, seed=5, min_numel=0,
                         levels=levels)
    model = _model()
    sim = owner_step.OwnerStepSimulator(model, N, cfg, delta_bucket=weight_bucket)
    opt = AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        sim.to_replica()
        grads = []
        for r in range(N):
            x, y = _batch(r, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            grads.append([g.detach() for g in torch.autograd.grad(loss, sim.params)])
        avg = sim.average(grads)
        sim.to_master()
        for p, g in zip(sim.params, avg):
            p.grad = g
        opt.step()
        sim.send_weights()
    out = run_ranks(N, lambda c: _train(c, steps, config=cfg, max_grad_norm=None, weight_bucket_size=weight_bucket))
    for r in range(N):
        for i, (name, x) in enumerate(zip(sim.names, sim.replica)):
            assert torch.allclose(out[r][0][name], x, rtol=0, atol=1e-6), (r, name)
            shard = out[r][2][i]
            if shard is not None:
                lo, hi = sizes.reternarized_bounds(x.numel(), N)[r]
                assert torch.allclose(shard, sim.master[i].reshape(-1)[lo:hi], rtol=0, atol=1e-6), (r, name)


@pytest.mark.parametrize("levels", [3, 4])
def test_owners_averages_are_the_engines_bit_for_bit(levels):
    """Step 0's owned averages and noise estimates equal the engine's requantized first stage (the study's), with
    either first-stage code."""
    import owner_step
    N = 4
    cfg = TernGradConfig(exchange="requantized", packing="base3", hierarchical=False, seed=5, min_numel=0,
                         levels=levels)
    model = _model()
    sim = owner_step.OwnerStepSimulator(model, N, cfg)
    ref = AdamW(model.parameters(), lr=1e-2)
    grads = []
    for r in range(N):
        x, y = _batch(r, 0)
        grads.append([g.detach() for g in torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y),
                                                              sim.params)])
    avg = sim.average(grads)
    noise = [ref.precision_ledger.noise_of(p)[0] for p in sim.params]

    def owned(c):
        opt = OwnerStepOptimizer(_model().named_parameters(), collectives=c, config=cfg, lr=1e-2)
        handles = opt.exchange.send_gradients([grads[c.rank][i] for i in opt._tern], 0)
        assert opt.exchange.nonfinite(handles) == []
        return opt.exchange.owned_averages(handles), opt.exchange.owned
    checked = 0
    for got, bounds in run_ranks(N, owned):
        for i, (pair, (lo, hi)) in enumerate(zip(got, bounds)):
            if pair is not None:
                assert torch.equal(pair[0], avg[i].reshape(-1)[lo:hi]) and torch.equal(pair[1], noise[i][lo:hi])
                checked += 1
    assert checked == 13          # 4 shards of each weight, 3 of the first bias (60 elements), 2 of the second


def test_nearest_rounding_is_bounded_and_decodes_exactly():
    torch.manual_seed(0)
    d = torch.randn(1003)
    t, s = nearest.nearest_ternary(d, 0)
    q = t.float() * s
    assert float((d - q).abs().max()) <= float(s) / 2 + 1e-7
    payload = nearest.encode_nearest(d, "base3")
    assert payload.numel() == sizes.payload_size(1003, "base3")
    from horovod_terngrad.backends import for_device
    from horovod_terngrad.codec.packing import Header
    got = for_device(torch.device("cpu")).decode(payload, [Header("base3", 0, 0, 1003)], [0], 1)
    assert torch.equal(got, q)


@pytest.mark.parametrize("weight_bucket", [0, 128])
def test_bits_received_are_the_codec_sizes(weight_bucket):
    N, steps = 4, 3
    out = run_ranks(N, lambda c: _train(c, steps, weight_bucket_size=weight_bucket))
    opt = out[0][3]
    want = 0
    for i in opt._tern:
        n = opt.params[i].numel()
        want += (N - 1) * sizes.reternarized_chunk_bytes(n, N, "base3", 0, True)[0]
        w = sizes.owner_step_weight_chunk_bytes(n, N, "base3", 0, weight_bucket)
        want += sum(w) - w[0]
    assert opt.exchange.bytes_received == steps * want
    extra = (N - 1) / N * 32 / weight_bucket if weight_bucket else 0.0      # the weight stage's scalers
    assert (N - 1) / N * 3.2 + extra < opt.bits_received() < 4.0 + extra + 8 * (N - 1) * 52 / 1800


@pytest.mark.parametrize("config", [CFG, CFG.replace(levels=4)], ids=["ternary", "4level"])
def test_resumed_run_continues_bit_for_bit(config):
    whole = run_ranks(4, lambda c: _train(c, 6, config=config))
    first = run_ranks(4, lambda c: _train(c, 3, config=config))
    resumed = run_ranks(4, lambda c: _train(c, 3, start=3, state=[(f[0], f[1]) for f in first], config=config))
    for r in range(4):
        for k in whole[r][0]:
            assert torch.equal(resumed[r][0][k], whole[r][0][k]), (r, k)
        for a, b in zip(whole[r][2], resumed[r][2]):
            assert (a is None and b is None) or torch.equal(a, b)


def test_checkpoint_of_another_world_size_is_refused():
    two = run_ranks(2, _train, 1)

    def load(c):
        model = _model()
        opt = OwnerStepOptimizer(model.named_parameters(), collectives=c, config=CFG, lr=1e-2)
        opt.load_state_dict(two[0][1])
    with pytest.raises(TernGradError, match="world is 2, this optimizer's 4"):
        run_ranks(4, load)


def test_nonfinite_gradient_skips_the_step_on_every_rank():
    def body(c, on_nonfinite):
        model = _model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = OwnerStepOptimizer(model.named_parameters(), collectives=c, config=CFG.replace(
            on_nonfinite=on_nonfinite), lr=1e-2)
        x, y = _batch(c.rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if c.rank == 1:
            model[0].weight.grad[3, 3] = float("nan")
        opt.step()
        return before, model.state_dict(), opt.skipped_steps
    for before, after, skipped in run_ranks(3, body, "propagate"):
        assert skipped == 1 and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(NonFiniteGradientError, match="0.weight"):
        run_ranks(3, body, "raise")


def test_lr_scheduler_and_param_groups_reach_the_inner_optimizer():
    def body(c):
        model = _model()
        groups = [{"params": [(n, p) for n, p in model.named_parameters() if n.endswith("weight")],
                   "weight_decay": 0.1},
                  {"params": [(n, p) for n, p in model.named_parameters() if n.endswith("bias")],
                   "weight_decay": 0.0}]
        opt = OwnerStepOptimizer(groups, AdamW, collectives=c, config=CFG, lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        for step in range(3):
            x, y = _batch(c.rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        return [g["lr"] for g in opt.inner.param_groups], [g["weight_decay"] for g in opt.inner.param_groups]
    lrs, decays = run_ranks(2, body)[0]
    assert lrs == [pytest.approx(1e-2 / 8)] * 2 and decays == [0.1, 0.0]


def test_bad_parameters_are_named():
    model = _model()
    with pytest.raises(TypeError, match="named_parameters"):
        OwnerStepOptimizer(model.parameters(), collectives=_Solo(), lr=1e-2)
    with pytest.raises(ValueError, match="collectives must be"):
        OwnerStepOptimizer(model.named_parameters(), collectives="nccl", lr=1e-2)


class _Solo:
    rank, size = 0, 1

    def alltoall_async(self, *a, **k):
        raise AssertionError("not called")


def test_trains_like_fp32_adamw_on_a_small_problem():
    """Whole (short) runs at the same lr: owner-step ends close to fp32 AdamW on averaged gradients."""
    def run(c, owner):
        model = _model()
        if owner:
            opt = OwnerStepOptimizer(model.named_parameters(), collectives=c, config=CFG, lr=3e-3)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        w_true = torch.randn(30, 40, generator=torch.Generator().manual_seed(7)) / 6
        for step in range(300):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(64, 40, generator=g)
            y = x @ w_true.T
            if owner:
                xs, ys = x.chunk(c.size)[c.rank], y.chunk(c.size)[c.rank]
                torch.nn.functional.mse_loss(model(xs), ys).backward()
            else:
                torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            g = torch.Generator().manual_seed(10 ** 6)
            x = torch.randn(512, 40, generator=g)
            return float(torch.nn.functional.mse_loss(model(x), x @ w_true.T))
    fp32 = run(types_solo(), False)
    assert fp32 < 0.03
    owner = run_ranks(4, run, True)[0]
    assert math.isfinite(owner) and owner < 1.3 * fp32 + 1e-3


def types_solo():
    class S:
        rank, size = 0, 1
    return S()


def test_a_rank_without_gradients_takes_part_with_zeros():
    """A rank out of data keeps calling step() (the rule in place of hvd.join(), whose alltoall cannot run with a
    joined rank): its gradients count as zeros, and every rank still ends with the same weights."""
    def body(c):
        model = _model()
        opt = OwnerStepOptimizer(model.named_parameters(), collectives=c, config=CFG, lr=1e-2)
        for step in range(3):
            if not (c.rank == 2 and step == 2):
                x, y = _batch(c.rank, step)
                torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return model.state_dict()
    out = run_ranks(3, body)
    assert all(torch.equal(out[r][k], out[0][k]) for r in range(3) for k in out[0])


def test_from_optimizer_keeps_the_groups_and_takes_terngrads_adamw():
    """Built from a script's torch.optim.AdamW with two groups: the same steps as built directly with
    optim.AdamW and those groups."""
    def body(c, direct):
        model = _model()
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if n.endswith("bias")]
        if direct:
            named = dict(model.named_parameters())
            groups = [{"params": [(n, p) for n, p in named.items() if n.endswith("weight")], "weight_decay": 0.1},
                      {"params": [(n, p) for n, p in named.items() if n.endswith("bias")], "weight_decay": 0.0}]
            opt = OwnerStepOptimizer(groups, AdamW, collectives=c, config=CFG, lr=2e-3, betas=(0.9, 0.95))
        else:
            base = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                     lr=2e-3, betas=(0.9, 0.95))
            opt = OwnerStepOptimizer.from_optimizer(base, model.named_parameters(), collectives=c, config=CFG)
            assert type(opt.inner) is AdamW
        for step in range(3):
            x, y = _batch(c.rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return model.state_dict()
    a, b = run_ranks(2, body, True)[0], run_ranks(2, body, False)[0]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_from_optimizer_refuses_a_stepped_optimizer_and_unnamed_parameters():
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not in named_parameters"):
        OwnerStepOptimizer.from_optimizer(base, list(model.named_parameters())[:2], collectives=_Solo())
    model(torch.randn(2, 40)).sum().backward()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    base.step()
    with pytest.raises(ValueError, match="has taken steps"):
        OwnerStepOptimizer.from_optimizer(base, model.named_parameters(), collectives=_Solo())


def test_masters_start_from_the_parameters_at_the_first_step():
    """The optimizer built before DDP (or Accelerate's prepare) broadcast rank 0's weights: the masters are taken
    from the parameters at the first step, so every rank's shard starts from the broadcast weights."""
    def body(c):
        model = _fresh(seed=100 + c.rank)               # each rank its own init, as before a broadcast
        opt = OwnerStepOptimizer(model.named_parameters(), collectives=c, config=CFG, lr=1e-2)
        model.load_state_dict(_INIT)                    # the broadcast
        x, y = _batch(c.rank, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        return model.state_dict()
    out = run_ranks(3, body)
    for k in out[0]:
        assert all(torch.equal(out[r][k], out[0][k]) for r in range(3))
        assert float((out[0][k] - _INIT[k]).abs().max()) < 0.05      # one step from the broadcast weights


def test_ranks_with_different_parameters_all_fail_at_the_first_step():
    def body(c):
        model = _fresh(seed=100 + c.rank)
        opt = OwnerStepOptimizer(model.named_parameters(), collectives=c, config=CFG, lr=1e-2)
        try:
            opt.step()
        except TernGradError as e:
            return str(e)
        return None
    out = run_ranks(3, body)
    assert all(msg is not None and "broadcast" in msg for msg in out)


def test_bf16_autocast_trains():
    def body(c):
        model = _model()
        opt = OwnerStepOptimizer(model.named_parameters(), collectives=c, config=CFG, lr=1e-2)
        x, y = _batch(c.rank, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        return model.state_dict()
    out = run_ranks(2, body)
    assert all(torch.equal(out[1][k], out[0][k]) and not torch.equal(out[0][k], _INIT[k]) for k in _INIT)


def _scaled_train(c, steps, scaler_kw=None, poison=None, on_nonfinite="propagate", autocast=None):
    """``steps`` steps through ``scaler.step(opt)`` / ``scaler.update()`` (no scaler when ``scaler_kw`` is None);
    ``poison``: (rank, step) whose gradient gets an Inf.  (weights, scale after each update, skipped steps)."""
    model = _model()
    opt = OwnerStepOptimizer(model.named_parameters(), collectives=c, config=CFG.replace(on_nonfinite=on_nonfinite),
                             lr=1e-2, max_grad_norm=1.0)
    scaler = torch.amp.GradScaler("cpu", **scaler_kw) if scaler_kw is not None else None
    scales = []
    for step in range(steps):
        x, y = _batch(c.rank, step)
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if poison == (c.rank, step):
            model[2].weight.grad[0, 0] = float("inf")
        if scaler:
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}, scales, opt.skipped_steps


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")
def test_fp16_gradscaler_unscales_and_every_rank_skips_and_scales_alike():
    # a power-of-two scale on an fp32 model: scaling and unscaling are exact, so the same bits as no scaler
    plain = run_ranks(3, _scaled_train, 4)
    scaled = run_ranks(3, lambda c: _scaled_train(c, 4, {"init_scale": 2.0 ** 12, "growth_interval": 1000}))
    for r in range(3):
        assert all(torch.equal(scaled[r][0][k], plain[r][0][k]) for k in _INIT), r
        assert scaled[r][1] == [2.0 ** 12] * 4 and scaled[r][2] == 0
    # an Inf on one rank at step 1: every rank skips that step and every scaler backs off, with "raise" set too
    # (an overflow under a scaler is its probing, not an error)
    kw = {"init_scale": 2.0 ** 12, "growth_interval": 2}
    out = run_ranks(3, lambda c: _scaled_train(c, 4, kw, poison=(2, 1), on_nonfinite="raise"))
    for weights, scales, skipped in out:
        assert skipped == 1 and scales == [2.0 ** 12, 2.0 ** 11, 2.0 ** 11, 2.0 ** 12]
        assert all(torch.equal(weights[k], out[0][0][k]) for k in _INIT)
    # fp16 autocast with the default scaler (2^16, whose first steps may overflow) trains, every rank alike
    fp16 = run_ranks(2, lambda c: _scaled_train(c, 3, {}, autocast=torch.float16))
    assert fp16[0][1] == fp16[1][1] and fp16[0][2] == fp16[1][2]
    assert all(torch.equal(fp16[1][0][k], fp16[0][0][k]) for k in _INIT)
    assert any(not torch.equal(fp16[0][0][k], _INIT[k]) for k in _INIT)


@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself:FutureWarning")
def test_unscale_before_the_step_is_answered_with_a_warning_and_changes_nothing(caplog):
    def body(c, unscale_first):
        model = _model()
        opt = OwnerStepOptimizer(model.named_parameters(), collectives=c, config=CFG, lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        for step in range(2):
            x, y = _batch(c.rank, step)
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return model.state_dict()
    plain = run_ranks(2, body, False)
    with caplog.at_level("WARNING", logger="horovod_terngrad"):
        unscaled = run_ranks(2, body, True)
    assert all(torch.equal(unscaled[r][k], plain[r][k]) for r in range(2) for k in _INIT)
    assert sum("reaches only the full-precision" in m for m in caplog.messages) == 2      # once per rank's optimizer
